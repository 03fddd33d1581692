"""Time to first token of a short request while the engine is busy, in process (xpuspec.engine).

Three figures on SmolLM2 int8_asym (OpenVINO paged runner, greedy):

1. idle: a short request's TTFT on an idle model;
2. behind a long request: the same short request, sent from a second thread once a 400-token request has emitted
   its first token (before the one engine, that request held the model and the short one waited for its end);
3. a long prompt arriving: a request decoding 200 tokens, and a prompt of ``--long-prompt`` tokens sent once it
   runs; the decoding request's longest gap between two tokens, with chunked prefill (chunks of the time budget
   :data:`xpuspec.batching.PREFILL_BUDGET_S`, the default; chunks of a fixed 256 tokens) and with the prompt
   prefilled in one pass.

Run: ``PYTHONPATH=.:plugins python benchmarks/engine_ttft.py``. Prints the figures; timings, not assertions.
"""

import argparse
import threading
import time

import torch

from xpuspec import AutoModelForCausalLM, AutoTokenizer
from xpuspec.batching import PREFILL_BUDGET_S, PREFILL_CHUNK

MODEL = "smollm2-135m-instruct"


class Clock:
    """A streamer noting the time of each new token (the first put is the prompt)."""

    def __init__(self):
        self.times, self.started = [], threading.Event()

    def put(self, value):
        self.times.append(time.perf_counter())
        if len(self.times) == 2:
            self.started.set()

    def end(self):
        pass


def short_ttft(model, ids):
    t0 = time.perf_counter()
    model.generate(ids, max_new_tokens=8, do_sample=False)
    return model.last_generate_stats.ttft_s, time.perf_counter() - t0


def behind(model, long_ids, short_ids, **long_kwargs):
    clock = Clock()
    worker = threading.Thread(target=model.generate, args=(long_ids,),
                              kwargs=dict(max_new_tokens=400, do_sample=False, eos_token_id=None, streamer=clock,
                                          **long_kwargs))
    worker.start()
    clock.started.wait()
    ttft, _ = short_ttft(model, short_ids)
    long_running = worker.is_alive()
    worker.join()
    return ttft, long_running


def longest_gap(model, running_ids, prompt_ids, budget_s, chunk):
    engine = model._engine_loop().engine
    engine.prefill_budget_s, engine.prefill_chunk, engine.prefill_rate = budget_s, chunk, None
    clock = Clock()
    worker = threading.Thread(target=model.generate, args=(running_ids,),
                              kwargs=dict(max_new_tokens=200, do_sample=False, eos_token_id=None, streamer=clock))
    worker.start()
    clock.started.wait()
    time.sleep(0.2)
    t0 = time.perf_counter()
    model.generate(prompt_ids, max_new_tokens=4, do_sample=False)
    prompt_ttft = model.last_generate_stats.ttft_s
    worker.join()
    gaps = [b - a for a, b in zip(clock.times[1:], clock.times[2:]) if b >= t0]
    return max(gaps), sorted(gaps)[len(gaps) // 2], prompt_ttft


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--long-prompt", type=int, default=2000)
    args = parser.parse_args()
    tok = AutoTokenizer.from_pretrained(MODEL)
    model = AutoModelForCausalLM.from_pretrained(MODEL, device="cpu", load_in_low_bit="int8_asym")
    short_ids = tok("The capital of France is", return_tensors="pt").input_ids
    long_ids = tok("Once upon a time, in a small village,", return_tensors="pt").input_ids
    text = open(__file__).read() * 20
    prompt_ids = tok(text, return_tensors="pt").input_ids[:, :args.long_prompt]
    model.generate(short_ids, max_new_tokens=8, do_sample=False)  # warm up
    idle = [short_ttft(model, short_ids)[0] for _ in range(3)]
    print(f"short request alone: TTFT {min(idle) * 1000:.0f} ms (best of 3)")
    ttft, running = behind(model, long_ids, short_ids)
    print(f"short request while a 400-token request runs: TTFT {ttft * 1000:.0f} ms "
          f"({ttft / min(idle):.2f}x idle; the long request still running at its end: {running})")
    for name, budget_s, chunk in ((f"chunks of a {PREFILL_BUDGET_S} s budget", PREFILL_BUDGET_S, PREFILL_CHUNK),
                                  ("chunks of 256 tokens", None, 256), ("one pass", None, 10 ** 9)):
        worst, median, prompt_ttft = longest_gap(model, long_ids, prompt_ids, budget_s, chunk)
        print(f"a {prompt_ids.shape[1]}-token prompt arriving, prefilled in {name}: the running request's longest "
              f"gap {worst * 1000:.0f} ms (median {median * 1000:.0f} ms); the prompt's TTFT {prompt_ttft * 1000:.0f} ms")
    model.close()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
