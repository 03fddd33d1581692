"""Run by ``torchrun`` from tests/test_torchrun.py: load a pipeline, take prompt logits and greedy continuations.

Usage: ``torchrun --nproc-per-node N tests/torchrun_worker.py MODEL OUT.pt STAGES SPLIT NEW_TOKENS PROMPT...``
with SPLIT ``-`` for the balanced split or ``15,15``. With ``$CRASH_RANK`` set, that rank exits
with status 1 right after its first forward (a crashed rank). The model is loaded with
``speculative="prompt_lookup"``; per prompt it records the prompt logits, the plain greedy ids
(``speculative=False``) and the prompt-lookup greedy ids. Rank 0 saves
``{"device_map", "weight_bytes", "logits", "greedy", "lookup", "stats"}`` to OUT.pt, rank r > 0 to OUT.pt.rankR.
"""

import os
import sys

import torch
from xpuspec_torch.pipeline import TorchPipelineRunner

from xpuspec import AutoModelForCausalLM, AutoTokenizer
from xpuspec.distributed import torchrun_world


def crash_after_first_forward(rank: str) -> None:
    forward = TorchPipelineRunner.forward

    def crashing(self, *args, **kwargs):
        logits = forward(self, *args, **kwargs)
        if str(self.world.rank) == rank:
            os._exit(1)
        return logits

    TorchPipelineRunner.forward = crashing


def main(model_name, out, stages, split, new_tokens, *prompts):
    if os.environ.get("CRASH_RANK"):
        crash_after_first_forward(os.environ["CRASH_RANK"])
    model = AutoModelForCausalLM.from_pretrained(
        model_name, backend="torch", load_in_low_bit="fp32", pipeline_parallel_stages=int(stages),
        split=None if split == "-" else [int(n) for n in split.split(",")],
        speculative="prompt_lookup")
    tokenizer = AutoTokenizer.from_pretrained(model_name)
    result = {"device_map": model.runner.device_map, "weight_bytes": model.runner.weight_bytes,
              "logits": [], "greedy": [], "lookup": [], "stats": []}
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        result["logits"].append(model(ids).logits[0])
        for key, speculative in (("greedy", False), ("lookup", None)):
            out_ids = model.generate(ids, max_new_tokens=int(new_tokens), do_sample=False, speculative=speculative)
            result[key].append(out_ids[0].tolist())
            result["stats"].append(model.last_generate_stats.summary())
    rank = torchrun_world().rank
    torch.save(result, out if rank == 0 else f"{out}.rank{rank}")


if __name__ == "__main__":
    main(*sys.argv[1:])
