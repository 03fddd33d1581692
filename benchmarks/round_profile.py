"""Microseconds of Python per decode round outside the model's inference, per drafter, with cProfile's top entries.

Loads the bench's target (SmolLM2-135M, int8_asym, the bench's OpenVINO config) once per drafter, decodes the
bench's prompts greedily with ``min_new_tokens = max_new_tokens`` (as ``xpuspec bench`` does), and times every
engine step; the time inside the backend's ``InferRequest.infer`` during the round
is subtracted. A round is one :meth:`xpuspec.engine.Engine.step` (admit, prefill, propose, verify, accept, emit), run
on the engine's own thread, where the profile is taken too. ``plain`` runs the engine's own plain rounds (the native
hand-over is switched off here, so that the engine's per-round work is what is measured).

    PYTHONPATH=.:plugins python benchmarks/round_profile.py [--drafters plain,prompt_lookup,hybrid,suffix,eagle3]
        [--prompts 2] [--max-new-tokens 64] [--repeats 2] [--top 12] [--head FOLDER]

Prints, per drafter: rounds, median and mean microseconds of Python per round outside ``infer``, the share of the
round that is, and the cProfile entries with the most own time (``infer`` among them). ``eagle3`` drafts with
``--head FOLDER``.
"""

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time

import torch

from xpuspec import AutoModelForCausalLM, AutoTokenizer, SpeculativeConfig
from xpuspec.bench import prompts as prompt_sets
from xpuspec.bench.systems import xpuspec_ov_config, DEFAULT_KV_CACHE_PRECISION
from xpuspec.engine import Engine

MODEL = "smollm2-135m-instruct"


class Clock:
    """Seconds spent inside ``infer`` since the last reset."""

    def __init__(self):
        self.infer_s = 0.0


class TimedRequest:
    """An ``InferRequest`` stand-in that times ``infer`` and forwards everything else."""

    def __init__(self, request, clock: Clock):
        object.__setattr__(self, "_request", request)
        object.__setattr__(self, "_clock", clock)

    def infer(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return self._request.infer(*args, **kwargs)
        finally:
            self._clock.infer_s += time.perf_counter() - t0

    def __getattr__(self, name):
        return getattr(self._request, name)


def time_infer(runner, clock: Clock) -> int:
    """Wrap every InferRequest the runner holds (attributes, and ``stages[i].request``); how many were wrapped."""
    import openvino as ov

    wrapped = 0
    for name, value in list(vars(runner).items()):
        if isinstance(value, ov.InferRequest):
            setattr(runner, name, TimedRequest(value, clock))
            wrapped += 1
    for stage in getattr(runner, "stages", ()):
        if isinstance(stage.request, ov.InferRequest):
            object.__setattr__(stage, "request", TimedRequest(stage.request, clock))
            wrapped += 1
    return wrapped


def load(drafter: str, head=None):
    spec = None if drafter == "plain" else SpeculativeConfig(mode=drafter, draft=head if drafter == "eagle3" else None)
    model = AutoModelForCausalLM.from_pretrained(MODEL, device="cpu", load_in_low_bit="int8_asym", speculative=spec,
                                                 ov_config=xpuspec_ov_config(DEFAULT_KV_CACHE_PRECISION) or None)
    return model


def profile(drafter: str, items, max_new: int, repeats: int, top: int, head=None) -> dict:
    model = load(drafter, head)
    clock = Clock()
    runners = [model.runner] + ([model.draft_model.runner] if model.draft_model is not None else [])
    wrapped = sum(time_infer(r, clock) for r in runners)
    if drafter == "plain":
        model.runner.native_greedy = lambda *a, **k: None  # measure the engine's own plain rounds
    rounds_us, shares = [], []
    real_step = Engine.step
    profiler, profiling = cProfile.Profile(), [False]

    def timed_step(engine):
        before, t0 = clock.infer_s, time.perf_counter()
        if profiling[0]:
            profiler.enable()
        try:
            return real_step(engine)
        finally:
            if profiling[0]:
                profiler.disable()
            wall = time.perf_counter() - t0
            inside = clock.infer_s - before
            if wall > 0 and engine.live or inside > 0:
                rounds_us.append((wall - inside) * 1e6)
                shares.append((wall - inside) / wall)

    def run():
        for ids in items:
            out = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=max_new, min_new_tokens=max_new,
                                 do_sample=False, speculative=drafter != "plain")
            assert out.shape[1] == len(ids) + max_new

    run()  # warm up: compiles widths, measures the cost profile
    Engine.step = timed_step
    try:
        for _ in range(repeats):
            run()
        timed = list(rounds_us)
        profiling[0] = True
        run()
    finally:
        Engine.step = real_step
    buffer = io.StringIO()
    stats = pstats.Stats(profiler, stream=buffer)
    stats.sort_stats("tottime").print_stats(top)
    return {"drafter": drafter, "rounds": len(timed), "median_us": statistics.median(timed),
            "mean_us": statistics.mean(timed), "share": statistics.mean(shares), "wrapped": wrapped,
            "profile": buffer.getvalue()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--drafters", default="plain,prompt_lookup,hybrid,suffix")
    p.add_argument("--prompts", default="2", help="--prompts of xpuspec bench (default 2 per code, prose, edit)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2, help="timed passes over the prompts (default 2)")
    p.add_argument("--top", type=int, default=12, help="cProfile entries shown (default 12)")
    p.add_argument("--no-profile", action="store_true", help="print the timings only")
    p.add_argument("--head", default=None, metavar="FOLDER", help="the EAGLE-3 head of drafter eagle3")
    args = p.parse_args(argv)
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    chosen = prompt_sets.select(prompt_sets.parse_prompt_spec(args.prompts))
    items = [tokenizer(text).input_ids for texts in chosen.values() for text in texts]
    results = [profile(d.strip(), items, args.max_new_tokens, args.repeats, args.top, args.head)
               for d in args.drafters.split(",")]
    print(f"{'drafter':<15}{'rounds':>8}{'median us':>11}{'mean us':>9}{'share':>7}")
    for r in results:
        print(f"{r['drafter']:<15}{r['rounds']:>8}{r['median_us']:>11.0f}{r['mean_us']:>9.0f}{r['share']:>7.0%}")
    if not args.no_profile:
        for r in results:
            print(f"\n==== {r['drafter']} (infer requests timed: {r['wrapped']})")
            print(r["profile"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
