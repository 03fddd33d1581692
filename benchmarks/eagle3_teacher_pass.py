"""The target's pass a head learns from, on OpenVINO (what ``train-draft`` uses) against transformers' float32 model
(what it used before), on one random 320-token sequence (seed 0): seconds, the taps' relative difference, and the
share of positions whose greedy token agrees. Two passes each; the second is the figure.

    PYTHONPATH=.:plugins python benchmarks/eagle3_teacher_pass.py MODEL [TORCH_THREADS]
"""

import sys
import time

import torch
import transformers

from xpuspec import AutoModelForCausalLM
from xpuspec.sources import resolve_source
from xpuspec.speculative.eagle3 import default_layer_ids
from xpuspec.speculative.eagle3_train import TargetPasses


def main() -> None:
    name = sys.argv[1]
    torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 1)
    source = resolve_source(name)
    ids = default_layer_ids(transformers.AutoConfig.from_pretrained(source.path).num_hidden_layers)
    passes = TargetPasses(AutoModelForCausalLM.from_pretrained(name, load_in_low_bit="int8_asym"), ids)
    reference = transformers.AutoModelForCausalLM.from_pretrained(source.path, dtype=torch.float32).eval()
    seq = torch.randint(100, 20000, (320,), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        t0 = time.perf_counter()
        taps, logits = passes(seq)
        t1 = time.perf_counter()
        with torch.no_grad():
            out = reference(seq[None], output_hidden_states=True)
        t2 = time.perf_counter()
        want = torch.cat([out.hidden_states[i][0] for i in ids], -1)
        agree = float((logits.argmax(-1) == out.logits[0].argmax(-1)).float().mean())
        print(f"OpenVINO int8 {t1 - t0:.3f} s, transformers fp32 {t2 - t1:.3f} s; taps' relative difference "
              f"{float((taps - want).norm() / want.norm()):.4f}; greedy tokens agreeing {agree:.3f}", flush=True)


if __name__ == "__main__":
    main()
