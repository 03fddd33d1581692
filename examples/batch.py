"""Batched generate: several prompts in one call, each row as it would be alone.

    python examples/batch.py [MODEL] [--max-new-tokens N]

Generates for three prompts in one padded batch (prompt lookup drafting per row), then each prompt alone, prints
the texts and exits with status 1 if a row differs from its prompt alone.
"""

import argparse

from xpuspec import AutoModelForCausalLM, AutoTokenizer

PROMPTS = ["def fibonacci(n):", "The capital of France is", "class Point:\n    def __init__(self, x, y):"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="smollm2-135m-instruct")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    args = parser.parse_args()

    tok = AutoTokenizer.from_pretrained(args.model)
    tok.pad_token, tok.padding_side = tok.pad_token or tok.eos_token, "left"
    model = AutoModelForCausalLM.from_pretrained(args.model, load_in_low_bit="int8_asym")
    batch = tok(PROMPTS, padding=True, return_tensors="pt")
    out = model.generate(**batch, max_new_tokens=args.max_new_tokens, do_sample=False, prompt_lookup_num_tokens=3,
                         pad_token_id=tok.pad_token_id)
    rows = tok.batch_decode(out[:, batch.input_ids.shape[1]:], skip_special_tokens=True)
    stats = model.last_generate_stats  # the batch's, with .rows per prompt
    same = True
    for prompt, text in zip(PROMPTS, rows):
        ids = tok(prompt, return_tensors="pt").input_ids
        alone = model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False)
        alone_text = tok.decode(alone[0, ids.shape[1]:], skip_special_tokens=True)
        same &= alone_text == text
        print(f"{prompt!r} -> {text!r}")
    print(f"batch of {len(PROMPTS)}: {stats.new_tokens} new tokens in {stats.target_forwards} batched passes")
    print(f"every row identical to its prompt alone: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
