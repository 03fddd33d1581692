"""Speculative decoding: the same greedy text as plain decoding, in fewer target passes.

    python examples/speculative.py [MODEL] [--mode MODE] [--draft DRAFT] [--max-new-tokens N]

MODE is one of prompt_lookup (the default), hybrid, self, layer_skip, suffix, suffix_hybrid; --draft names a draft model
(a path or a built-in name with the target's tokenizer) and drafts with it. The script generates with
speculation, then plainly, prints both texts and the speculative request's figures, and exits with
status 1 if the texts differ.
"""

import argparse

from xpuspec import AutoModelForCausalLM, AutoTokenizer

# Code that repeats its own structure: prompt lookup drafts the repeated lines for free.
PROMPT = ("class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\n\n"
          "class Point3D:\n    def __init__(self, x, y, z):")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="smollm2-135m-instruct")
    parser.add_argument("--mode", default="prompt_lookup", choices=["prompt_lookup", "hybrid", "self", "layer_skip", "suffix", "suffix_hybrid"])
    parser.add_argument("--draft", default=None, help="a draft model; overrides --mode")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    args = parser.parse_args()

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, load_in_low_bit="int8_asym",
                                                 speculative=args.draft or args.mode)

    inputs = tokenizer(PROMPT, return_tensors="pt")
    fast = model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False)
    stats = model.last_generate_stats
    plain = model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False, speculative=False)

    new = slice(inputs.input_ids.shape[1], None)
    print("speculative:", repr(tokenizer.decode(fast[0, new], skip_special_tokens=True)))
    print("plain:      ", repr(tokenizer.decode(plain[0, new], skip_special_tokens=True)))
    print(stats.summary())
    print(f"target passes: {stats.target_forwards} for {stats.new_tokens} new tokens")
    same = fast.tolist() == plain.tolist()
    print("identical to plain greedy:", same)
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
