"""Held-out acceptance of an EAGLE-3 head against its training: one row per checkpoint of a ``train-draft`` run.

    PYTHONPATH=.:plugins python benchmarks/eagle3_curve.py --model qwen2.5-coder-1.5b-instruct --out /tmp/e3q/head \
        [--held 24] [--low-bit int8_asym] CHECKPOINT...

``--out`` is the run's folder (its ``init`` head and ``own-outputs.json``, the target's continuations); each
CHECKPOINT is a copy of its ``train-state.pt`` taken during the run (the run keeps only the latest). Each is scored
on the first ``--held`` sequences of the run's held-out tenth (sequences no step trained on), teacher-forced, as
``train-draft`` reports at its end (:func:`xpuspec.speculative.eagle3_train.evaluate`): per draft position, the
share of positions whose draft and every earlier one equal the target's greedy tokens. Training tokens: steps
times the sequences per step times the mean length of the training sequences.
"""

import argparse
import json
import statistics
from pathlib import Path

import torch

from xpuspec import AutoModelForCausalLM
from xpuspec.speculative.eagle3 import Eagle3Head, read_head
from xpuspec.speculative.eagle3_train import TargetPasses, evaluate


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoints", nargs="+")
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True, help="the train-draft run's --out folder")
    p.add_argument("--held", type=int, default=24, help="held-out sequences scored (default 24)")
    p.add_argument("--low-bit", default="int8_asym")
    args = p.parse_args()
    out = Path(args.out)
    sequences = json.loads((out / "own-outputs.json").read_text())
    spec = read_head(out / "init")
    target = None
    print("| checkpoint | steps | training tokens | held-out acceptance per position |")
    print("|---|---:|---:|---|")
    for path in sorted(args.checkpoints):
        state = torch.load(path, weights_only=False)
        if target is None:
            target = TargetPasses(AutoModelForCausalLM.from_pretrained(args.model, load_in_low_bit=args.low_bit),
                                  spec.layer_ids)
        head = Eagle3Head.load(spec, spec.layer_ids)  # train-draft's init head names its taps
        head.load_state_dict(state["head"])
        head.eval()
        held = [torch.tensor(sequences[i]) for i in state["order"][:state["held"]][:args.held]]
        train_len = statistics.mean(len(sequences[i]) for i in state["order"][state["held"]:])
        rates = evaluate(head, target, held, spec.speculative_tokens)
        tokens = state["step"] * state.get("batch_size", 1) * train_len
        print(f"| {Path(path).name} | {state['step']} | {tokens:,.0f} | "
              f"{', '.join(f'{r:.3f}' for r in rates)} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
