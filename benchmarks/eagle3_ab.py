"""Decode tokens/s of ``generate`` with an EAGLE-3 head drafting ``--k`` tokens every round (the cost model off, so
the head drafts in every round whatever it costs): SmolLM2-135M int8_asym, 3 prose and 3 code prompts of the bench in
its chat template, 64 greedy tokens each (EOS held back). Prints one JSON line: tokens/s and a digest of the outputs.

For an A/B of two checkouts (``git worktree add``), alternate processes:

    for r in 1 2 3; do for side in new old; do
        PYTHONPATH=$side:$side/plugins python benchmarks/eagle3_ab.py --head HEAD; done; done

The digest must be equal on both sides: greedy output is the target's whatever the head drafts.
"""

import argparse
import hashlib
import json
import time


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--head", required=True, help="the EAGLE-3 head's folder")
    p.add_argument("--k", type=int, default=4, help="tokens the head drafts every round")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--max-new-tokens", type=int, default=64)
    args = p.parse_args()

    from xpuspec import AutoModelForCausalLM, AutoTokenizer, SpeculativeConfig
    from xpuspec.bench import prompts
    from xpuspec.bench.systems import xpuspec_ov_config

    tok = AutoTokenizer.from_pretrained(args.model)
    spec = SpeculativeConfig(mode="eagle3", draft=args.head, num_assistant_tokens=args.k,
                             num_assistant_tokens_schedule="constant", cost_model=False)
    model = AutoModelForCausalLM.from_pretrained(args.model, load_in_low_bit="int8_asym", speculative=spec,
                                                 ov_config=xpuspec_ov_config("f32"))
    texts = prompts.full_set("prose")[:3] + prompts.full_set("code")[:3]
    rows = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                    return_tensors="pt", return_dict=True)["input_ids"] for t in texts]
    model.generate(rows[0], max_new_tokens=16, do_sample=False)  # warm-up: compiled widths, the head's tables
    new = args.max_new_tokens
    seconds, outputs = 0.0, []
    for ids in rows:
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)
        seconds += time.perf_counter() - t0
        outputs.append(out[0, ids.shape[1]:].tolist())
    print(json.dumps({"tok_s": round(sum(map(len, outputs)) / seconds, 1),
                      "outputs": hashlib.sha1(str(outputs).encode()).hexdigest()[:10],
                      "load": open("/proc/loadavg").read().split()[:3]}))


if __name__ == "__main__":
    main()
