"""Where suffix decoding's time goes against prompt lookup on the session set: drafted and kept tokens, target passes,
and seconds drafting against seconds verifying, summed over the requests (SmolLM2 int8_asym, greedy, 64 new tokens,
the model's defaults otherwise; one model per mode, the requests in session order).

    python benchmarks/suffix_profile.py
"""
from xpuspec import AutoModelForCausalLM, AutoTokenizer
from xpuspec.bench import prompts
tok = AutoTokenizer.from_pretrained("smollm2-135m-instruct")
texts = prompts.select(prompts.parse_prompt_spec("session:12"))["session"]
for mode in ("prompt_lookup", "suffix"):
    m = AutoModelForCausalLM.from_pretrained("smollm2-135m-instruct", device="cpu", load_in_low_bit="int8_asym", speculative=mode)
    if mode == "suffix":
        m.suffix_cache().clear()
    tot = dict(drafted=0, accepted=0, passes=0, draft_s=0.0, verify_s=0.0, new=0, rounds_with_draft=0)
    for t in texts:
        ids = tok(t, return_tensors="pt").input_ids
        m.generate(ids, max_new_tokens=64, do_sample=False)
        s = m.last_generate_stats
        tot["drafted"] += s.drafted_tokens; tot["accepted"] += s.accepted_tokens; tot["passes"] += s.target_forwards
        tot["draft_s"] += s.draft_s; tot["verify_s"] += s.verify_s; tot["new"] += s.new_tokens
        tot["rounds_with_draft"] += int(sum(s.acceptance_counts.judged[:1])) if s.acceptance_counts else 0
    print(mode, {k: round(v, 3) if isinstance(v, float) else v for k, v in tot.items()}, flush=True)
