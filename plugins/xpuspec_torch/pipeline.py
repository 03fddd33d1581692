"""A layer-split pipeline of one transformers model over the processes of a torchrun job (SPMD).

Every rank runs the same script and the same decode loop. Rank r holds decoder layers ``[a_r, b_r)``
with its own ``DynamicCache`` over those layers only; rank 0 also holds the embedding, the last rank
the final norm and the LM head (with tied embeddings that is a second copy of the embedding matrix,
counted in its ``weight_bytes``). In :meth:`TorchPipelineRunner.forward` rank 0 embeds and runs its
layers, each rank sends its hidden states ``[1, k, hidden]`` to the next with ``torch.distributed``
``send``/``recv``, and the last rank broadcasts the logits ``[k, vocab]`` to all ranks, so every
rank's decode loop takes the same decisions. ``rollback`` and ``reset`` are local: every rank calls
them identically. Before each forward one ``all_reduce`` of six integers checks that all ranks are
in step (same KV length, same tokens); a divergence (sampling with different seeds) raises
:class:`PipelineError` instead of mismatched transfers.

Plain point-to-point operations carry the hidden states, with the length every rank already knows
(all ranks hold the same tokens). ``torch.distributed.pipelining`` does not fit a decode loop, whose
length changes every call: its schedules size their receive buffers once, at the first step (why, in
detail: ``docs/design.md``, "The torchrun pipeline").
"""

from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from xpuspec.distributed import World, init, lost_rank
from xpuspec.errors import PipelineConfigError, PipelineError
from xpuspec.runner import RunnerTraits
from xpuspec.stages import balanced_split, check_split

from .runner import TorchRunner, parameter_bytes

#: Architectures whose base model runs ``inputs_embeds`` straight into the first decoder layer (no
#: embedding scale), so a later stage can feed its received hidden states there.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def check_plan(config, stages: int, split: Optional[Sequence[int]], world: Optional[World]) -> None:
    """Refuse a pipeline that cannot be built, before any slow work.

    Raises:
        PipelineConfigError: unsupported architecture, a plan :func:`xpuspec.stages.check_split` refuses
            (more stages than layers, a bad ``split``), not started by torchrun, or a torchrun world size
            other than ``stages``.
    """
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise PipelineConfigError(f"The torch pipeline splits {', '.join(SUPPORTED_MODEL_TYPES)} models, not "
                                  f"{config.model_type!r}; run it in one process (no pipeline_parallel_stages).")
    check_split(split, stages, config.num_hidden_layers)
    if world is None:
        raise PipelineConfigError(f"{stages} pipeline stages need {stages} processes: run "
                                  f"`torchrun --nproc-per-node {stages} ...`.")
    if world.world_size != stages:
        raise PipelineConfigError(f"{stages} pipeline stages but torchrun started {world.world_size} processes; run "
                                  f"`torchrun --nproc-per-node {stages} ...` (one process per stage).")


def _keep_layers(model, first: int, end: int, is_first: bool, is_last: bool) -> None:
    """Cut ``model`` down to decoder layers ``[first, end)``, renumbered from 0 for this stage's own cache."""
    inner = model.model
    inner.layers = torch.nn.ModuleList(inner.layers[first:end])
    for i, layer in enumerate(inner.layers):
        layer.self_attn.layer_idx = i
    model.config.num_hidden_layers = end - first
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[first:end]
    if not is_first:
        inner.embed_tokens = None  # the LM head keeps a tied weight alive on the last stage
    if not is_last:
        inner.norm = torch.nn.Identity()
        model.lm_head = None


def load_stage(model_path, config, stages: Sequence[str], split: Optional[Sequence[int]], dtype,
               world: Optional[World]) -> "TorchPipelineRunner":
    """Load this rank's stage of a pipeline of ``len(stages)`` stages and join the process group.

    Args:
        model_path: a Hugging Face model folder.
        config: its ``PretrainedConfig`` (checked before anything is loaded).
        stages: one device per stage (``"cpu"``, ``"xpu:1"``); rank r runs on ``stages[r]``.
        split: decoder layers per stage, or ``None`` to balance weight bytes (:func:`balanced_split`).
        dtype: ``torch.float32`` or ``torch.float16``.
        world: this process's place (:func:`xpuspec.distributed.torchrun_world`).

    Raises:
        PipelineConfigError: see :func:`check_plan`.
        PipelineError: the ranks could not form the group, or a rank was lost while loading.
    """
    from transformers import AutoModelForCausalLM

    check_plan(config, len(stages), split, world)
    device = stages[world.rank]
    init(device)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    if split is None:
        split = balanced_split([parameter_bytes(layer) for layer in model.model.layers],
                               parameter_bytes(model.model.embed_tokens),
                               parameter_bytes(model.model.norm) + parameter_bytes(model.lm_head), len(stages))
    bounds = [(sum(split[:i]), sum(split[:i + 1])) for i in range(len(split))]
    _keep_layers(model, *bounds[world.rank], world.rank == 0, world.rank == world.world_size - 1)
    return TorchPipelineRunner(model.to(device).eval(), device, world, bounds, stages)


class TorchPipelineRunner(TorchRunner):
    """This rank's stage of a layer-split pipeline; see the module docstring. ``rollback`` and ``reset``
    are :class:`TorchRunner`'s, on this stage's own cache.

    Attributes:
        weight_bytes: bytes of the weights this rank holds.
        device_map: one dict per stage, the same on every rank: ``{"stage": i, "device": "cpu",
            "layers": [a, b], "weight_bytes": int, "rank": r}``.
    """

    traits = RunnerTraits(lockstep=True, uses_torch_threads=True)

    def __init__(self, model, device: str, world: World, bounds: Sequence[Tuple[int, int]], stages: Sequence[str]):
        super().__init__(model, device)
        self.world = world
        self.is_first, self.is_last = world.rank == 0, world.rank == world.world_size - 1
        mine = {"stage": world.rank, "device": device, "layers": list(bounds[world.rank]),
                "weight_bytes": self.weight_bytes, "rank": world.rank}
        self._device_map: List[dict] = [{}] * world.world_size
        with lost_rank(world.rank, 0 if world.rank else 1, "exchanging the stage report after loading"):
            dist.all_gather_object(self._device_map, mine)
        if [entry["device"] for entry in self._device_map] != list(stages):
            raise PipelineConfigError(f"The ranks were given different stage devices: "
                                      f"{[entry['device'] for entry in self._device_map]}; pass the same list to every rank.")

    def _check_in_step(self, tokens: Sequence[int]) -> None:
        """Raise :class:`PipelineError` unless every rank holds the same KV length and feeds the same tokens."""
        mine = [self.length, len(tokens), sum((i + 1) * t for i, t in enumerate(tokens)) % (1 << 40)]
        seen = torch.tensor(mine + [-v for v in mine], dtype=torch.long, device=self.device)
        with lost_rank(self.world.rank, 0 if self.world.rank else 1, "checking that the ranks are in step"):
            dist.all_reduce(seen, op=dist.ReduceOp.MAX)
        high, low = seen[:3].tolist(), [-v for v in seen[3:].tolist()]
        if high != low:
            raise PipelineError(
                f"The ranks' decode loops diverged (KV length, tokens fed: {low[:2]} on one rank, {high[:2]} on "
                "another): every rank must run the same generate call, and sampling needs the same seed on every rank "
                "(torch.manual_seed(s) with one s before generate).")

    @property
    def device_map(self) -> List[dict]:
        return self._device_map

    @torch.inference_mode()
    def forward(self, tokens: Sequence[int], logits_to_keep: Optional[int] = None, exact: bool = True) -> torch.Tensor:
        """Run ``tokens`` through the whole pipeline; every rank gets the logits.

        Returns:
            float32 ``[k, vocab_size]`` (``[logits_to_keep, vocab_size]``) on the CPU, identical on every rank.

        Raises:
            PipelineError: a rank was lost (crash or ``$XPUSPEC_DIST_TIMEOUT``), or the ranks diverged.
        """
        rank, k = self.world.rank, len(tokens)
        self._check_in_step(tokens)
        if self.is_first:
            inputs = {"input_ids": torch.tensor([list(tokens)], dtype=torch.long, device=self.device)}
        else:
            hidden = torch.empty(1, k, self.model.config.hidden_size, dtype=self.model.dtype, device=self.device)
            with lost_rank(rank, rank - 1, "receiving hidden states"):
                dist.recv(hidden, src=rank - 1)
            inputs = {"inputs_embeds": hidden}
        last = self.world.world_size - 1
        rows = min(logits_to_keep or k, k)
        if self.is_last:
            logits = self.model(**inputs, past_key_values=self.cache, use_cache=True,
                                logits_to_keep=rows).logits[0].float()
        else:
            out = self.model.model(**inputs, past_key_values=self.cache, use_cache=True).last_hidden_state
            with lost_rank(rank, rank + 1, "sending hidden states"):
                dist.send(out.contiguous(), dst=rank + 1)
            logits = torch.empty(rows, self.vocab_size, dtype=torch.float32, device=self.device)
        with lost_rank(rank, 0 if self.is_last else last, "broadcasting the logits"):
            dist.broadcast(logits, src=last)
        return logits.cpu()
