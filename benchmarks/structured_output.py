"""Structured output on SmolLM2 int8: 50 JSON-schema requests, constrained plain decoding against constrained prompt
lookup, side by side.

Prints, per mode: requests whose output parses and validates (``jsonschema``), outputs identical to plain
constrained output, new tokens, decode seconds and tokens/s, the grammar's seconds per new token against the
decode step (plain decode_s / new tokens), and the lookup/plain speed ratio. Modes alternate per request so load
changes hit both alike.

    PYTHONPATH=.:plugins python benchmarks/structured_output.py [--requests 50] [--lookup 8]
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from schemas import TOKEN_BUDGET, parse_and_validate, requests  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=50)
    parser.add_argument("--lookup", type=int, default=8, help="prompt_lookup_num_tokens")
    args = parser.parse_args()
    import xpuspec.grammar as grammar
    from xpuspec import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained("smollm2-135m-instruct")
    model = AutoModelForCausalLM.from_pretrained("smollm2-135m-instruct", device="cpu", load_in_low_bit="int8_asym")
    busy = {}
    original = grammar.GrammarMatcher.__init__

    def tracked(self, *a, **kw):  # note each request's matcher, to read its busy_s
        original(self, *a, **kw)
        busy["last"] = self

    grammar.GrammarMatcher.__init__ = tracked
    modes = {"plain": dict(speculative=False), "lookup": dict(prompt_lookup_num_tokens=args.lookup)}
    totals = {m: dict(valid=0, same=0, tokens=0, decode_s=0.0, grammar_s=0.0, drafted=0, accepted=0, guessed=0, guesses_kept=0, forwards=0)
              for m in modes}
    print(f"load before {open('/proc/loadavg').read().strip()}")
    start = time.time()
    for i, (messages, fmt, schema) in enumerate(requests()[:args.requests]):
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                      return_dict=True)["input_ids"]
        outs = {}
        for mode, kw in (modes.items() if i % 2 == 0 else reversed(list(modes.items()))):
            out = model.generate(ids, max_new_tokens=TOKEN_BUDGET, do_sample=False, response_format=fmt, **kw)
            new = out[0, ids.shape[1]:].tolist()
            outs[mode] = new
            st, t = model.last_generate_stats, totals[mode]
            try:
                parse_and_validate(tok.decode(new, skip_special_tokens=True), schema)
                t["valid"] += 1
            except Exception as exc:  # reported, not raised: the count is the figure
                print(f"request {i} {mode}: INVALID {type(exc).__name__}: {str(exc)[:120]}")
            t["tokens"] += st.new_tokens
            t["decode_s"] += st.decode_s
            t["grammar_s"] += busy["last"].busy_s
            t["drafted"] += st.drafted_tokens
            t["accepted"] += st.accepted_tokens
            t["guessed"] += st.guessed_tokens
            t["guesses_kept"] += st.guesses_accepted
            t["forwards"] += st.target_forwards
        for mode in modes:
            totals[mode]["same"] += outs[mode] == outs["plain"]
    n = min(args.requests, 50)
    print(f"load after {open('/proc/loadavg').read().strip()}; {time.time() - start:.0f} s")
    step = totals["plain"]["decode_s"] / max(1, totals["plain"]["tokens"] - n)
    for mode, t in totals.items():
        speed = (t["tokens"] - n) / t["decode_s"]
        print(f"{mode}: valid {t['valid']}/{n}, identical to plain {t['same']}/{n}, new tokens {t['tokens']}, "
              f"decode {t['decode_s']:.1f} s = {speed:.1f} tok/s, grammar {t['grammar_s'] / t['tokens'] * 1e3:.2f} "
              f"ms/token = {t['grammar_s'] / t['tokens'] / step:.1%} of a plain decode step ({step * 1e3:.1f} ms), "
              f"drafted {t['drafted']} accepted {t['accepted']}, free guesses (lookup in the 2-wide slot, grammar-forced "
              f"tokens) {t['guessed']} kept {t['guesses_kept']}, target forwards {t['forwards']} = "
              f"{t['tokens'] / t['forwards']:.2f} tokens per forward")
    p, lk = totals["plain"], totals["lookup"]
    ratio = ((lk["tokens"] - n) / lk["decode_s"]) / ((p["tokens"] - n) / p["decode_s"])
    print(f"lookup / plain constrained decode speed: {ratio:.2f}x")


if __name__ == "__main__":
    main()
