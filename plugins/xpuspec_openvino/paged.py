"""Runner over the paged-attention form of an OpenVINO LLM IR: one compiled copy, and a second for 1-token steps
where the passes alternate widths.

OpenVINO's ``paged_attention_transformation`` (the one openvino_genai applies for its default
``ATTENTION_BACKEND="PA"``) turns the stateful IR into a stateless one: the KV cache becomes inputs
``key_cache.<layer>`` / ``value_cache.<layer>`` (blocks of ``block_size`` tokens, shaped by the plugin,
``[blocks, kv_heads, block_size, head_dim]`` on CPU) that the caller allocates and owns, and the
tokens are described by ``past_lens``, ``subsequence_begins``, ``block_indices``,
``block_indices_begins`` and ``max_context_len``. Inputs ``input_ids`` and ``position_ids`` are
int64 ``[n]``; ``logits`` come out as ``[n, 1, vocab]``.

Owning the cache buys two things a stateful model cannot give a speculative loop:

* **Rollback is free and exact**: tokens past ``past_lens`` are simply overwritten by the next pass.
* **Two compiled copies can share one cache**: one runs only 1-token steps, the other every wider pass (prefill,
  padded verify). The CPU plugin re-prepares a model whenever its input length changes, so a loop alternating
  1-token steps with verify passes runs faster with a copy per width. Each compiled copy holds its own repacked
  weights, so the second copy is made only where the widths will alternate (:meth:`PagedRunner.expect_mixed_widths`:
  a draft model, a prompt-lookup target); plain decoding and a target verifying a draft model's rounds at one
  padded width keep one copy.

**1-token passes that compute differently.** Where the plugin's 1-token pass computes otherwise than its wider
passes (:mod:`.numerics` measures it, at tolerance 0), plain steps and verify passes must still compute alike, so
that speculative output is the plain output:

* where the probe finds **split steps** exact (``traits.split_steps``), every step and verify pass
  (:meth:`PagedRunner.forward_batch`, :meth:`PagedSequence.forward_steps`) feeds each token as a subsequence of
  its own, so each computes alike whatever the pass's width and rows; plain steps of a batch run 1 token per row.
  The CPU kernel attends a pass of fewer subsequences than its threads in another loop (another order of sums), so
  a split pass is padded to :attr:`PagedRunner.split_width` subsequences (the padding rolled back): a request
  alone still pays 2 tokens a step on 2 threads, and split steps are used only up to :data:`SPLIT_MAX_THREADS`.
  Prompt passes (``forward``) keep the wide kernel, their 1-token passes padded to 2; a sequence offers the prefix
  cache only the blocks its prompt passes wrote (a block a step wrote would differ from the same tokens prefilled);
* else every 1-token pass runs as a 2-token one (``traits.single_step_width == 2``, the second token rolled back).

openvino_genai's engine steps one token at a time from a prefill whose steps the runner's would not match, so it
does not decode for such a runner.
"""

import dataclasses
import logging
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import openvino as ov
import torch

from xpuspec.errors import KVBudgetError, ModelSourceError
from xpuspec.kv_blocks import BlockPool
from xpuspec.runner import Runner, RunnerTraits, on_whole_vocabulary

from . import numerics
from .genai_engine import GenAIGreedy
from .graph import LOGITS_TO_KEEP, add_taps, keep_head_rows, keep_last_logits, num_layers
from .ir import MODEL_BIN, read_ir

log = logging.getLogger("xpuspec")

#: Tokens the KV cache holds at first; it doubles (one copy) when a request needs more.
INITIAL_CAPACITY = 1024
#: Passes a second compiled copy runs when it is made: its first inferences finish work the compile left, and
#: should not be timed as steps.
WARM_UP_PASSES = 4
#: Split steps only where the plugin runs this many threads or fewer: a split pass is padded to as many
#: subsequences as threads (module docstring), which a request alone pays for in every step.
SPLIT_MAX_THREADS = 2
def plugin_threads(compiled: ov.CompiledModel) -> int:
    """The threads the plugin runs ``compiled`` on (``INFERENCE_NUM_THREADS``, at least 1): the fewest subsequences
    of a split pass (module docstring)."""
    return max(1, int(compiled.get_property("INFERENCE_NUM_THREADS")))


def stepping(found: numerics.StepNumerics, split_width: int) -> RunnerTraits:
    """How a paged runner with the probe's findings ``found`` and :func:`plugin_threads` ``split_width`` steps (module
    docstring): split steps where the probe found them exact and the threads are at most
    :data:`SPLIT_MAX_THREADS`, else 1-token passes ``found.single_step_width`` wide; verify passes keep one width
    (rollback of the padding is free)."""
    split = found.split_exact and split_width <= SPLIT_MAX_THREADS
    return RunnerTraits(single_step_width=1 if split else found.single_step_width, fixed_verify_width=True,
                        split_steps=split, split_width=split_width if split else 1)


def subsequences(past: int, end: int, split: bool) -> List[Tuple[int, int]]:
    """The ``(first, end)`` positions of the subsequences that feed positions ``past`` to ``end - 1`` of one
    sequence: one per token where ``split`` (module docstring), else one."""
    return [(p, p + 1) for p in range(past, end)] if split else [(past, end)]


_DESCRIPTORS = ("input_ids", "position_ids", "past_lens", "subsequence_begins", "block_indices",
                "block_indices_begins", "max_context_len", LOGITS_TO_KEEP)


def paged_model(model: ov.Model) -> ov.Model:
    """Apply OpenVINO's paged-attention transformation and make the LM head run on the last
    ``logits_to_keep`` positions only (changes ``model`` in place).

    Raises:
        ModelSourceError: the IR has no SDPA that the transformation can turn into paged attention.
    """
    from openvino._offline_transformations import paged_attention_transformation

    paged_attention_transformation(model)
    if not any(i.any_name.startswith("key_cache.") for i in model.inputs):
        raise ModelSourceError("OpenVINO's paged-attention transformation found no attention to convert in this "
                               "IR. Load it with ov_config={'ATTENTION_BACKEND': 'SDPA'}.")
    return keep_last_logits(model, axis=0)


#: KV-cache precisions that the CPU plugin's paged attention takes only under the same inference
#: precision: an f32 cache under bf16 inference and a bf16 cache under f32 inference fail to compile; f16 and u8
#: caches compile under either.
_CACHE_NEEDS_SAME_PRECISION = ("f32", "bf16")
_TYPE_NAMES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "uint8": "u8"}


def _type_name(value) -> str:
    name = value.get_type_name() if isinstance(value, ov.Type) else str(value).lower()
    return _TYPE_NAMES.get(name, name)


def check_cpu_cache_precision(core: ov.Core, device: str, config: dict) -> None:
    """Refuse, before compiling, a KV-cache precision that paged attention on CPU ``device`` (an
    OpenVINO CPU device name) rejects under the inference precision in force: ``config``'s
    ``INFERENCE_PRECISION_HINT``, else the plugin's default (bf16 on CPUs with AVX512-BF16 or AMX,
    f32 elsewhere).

    Raises:
        ValueError: an f32 or bf16 ``KV_CACHE_PRECISION`` under another inference precision.
    """
    cache = config.get("KV_CACHE_PRECISION")
    if cache is None or _type_name(cache) not in _CACHE_NEEDS_SAME_PRECISION:
        return
    hint = config.get("INFERENCE_PRECISION_HINT")
    precision = _type_name(hint if hint is not None else core.get_property(device.upper(), "INFERENCE_PRECISION_HINT"))
    if precision != _type_name(cache):
        raise ValueError(
            f"ov_config KV_CACHE_PRECISION={cache!r} needs INFERENCE_PRECISION_HINT={_type_name(cache)!r} on this CPU "
            f"(in force: {precision!r}; an f32 KV cache is xpuspec's default where ov_config sets none): OpenVINO's CPU paged attention keeps an f32 or bf16 KV cache only in its own "
            "compute precision. Set both alike (xpuspec's default is f32 for both, which keeps speculative decoding "
            "exact), use KV_CACHE_PRECISION 'u8' or 'f16', or ATTENTION_BACKEND='SDPA'.")


class PagedRunner(Runner):
    """A whole model on one device, with a paged KV cache; see the module docstring.

    The cache is a pool of blocks shared by sequences: the runner's own (its batch-1 Runner methods) and any
    opened with :meth:`open_sequence`, each a :class:`PagedSequence` holding its own block table. One
    :meth:`forward_batch` runs a single inference over several sequences, as openvino_genai's continuous batching
    feeds ``PagedAttention`` (concatenated tokens, per-sequence ``past_lens``, ``subsequence_begins`` and block
    tables). :meth:`set_kv_budget` caps the blocks in use (:class:`xpuspec.errors.KVBudgetError` past it).
    Passes and changes to the block pool are serialized by a lock, so sequences may run from several threads (an
    overlapped draft's workers, one per row, beside the engine's thread).

    Args:
        core: the ``openvino.Core`` to compile with.
        folder: IR folder holding ``openvino_model.xml/.bin`` (stateful, as optimum-intel exports it).
        device: xpuspec device name (``"cpu"``, ``"gpu.1"``).
        config: OpenVINO compile properties (``KV_CACHE_PRECISION`` sets the cache's element type).
        capacity: tokens the KV cache holds before it first grows.
        head_tokens: score only these token ids (a draft's LM head cut to frequent tokens,
            :func:`.graph.keep_head_rows`); the logits of every other token are ``-inf``. ``None``: all.

    Raises:
        ModelSourceError: the IR is damaged or cannot take paged attention.
    """

    attention_backend = "PA"

    def __init__(self, core: ov.Core, folder: Path, device: str, config: dict, capacity: int = INITIAL_CAPACITY,
                 head_tokens: Optional[Sequence[int]] = None, is_cpu: bool = False):
        self.folder, self.device, self.configs = Path(folder), device, [dict(config)]
        model = read_ir(core, self.folder)
        self.num_layers = num_layers(model)
        self.vocab_size = int(model.output("logits").partial_shape[-1].get_length())
        self.head_tokens = (None if head_tokens is None
                            else torch.as_tensor(keep_head_rows(model, head_tokens), dtype=torch.long))
        paged_model(model)
        self._core, self._model = core, model  # for a step copy (the compiled model keeps the constants anyway)
        compiled = core.compile_model(model, device.upper(), self.configs[0])
        self._wide = compiled.create_infer_request()
        self._step = self._wide  # until expect_mixed_widths() compiles a copy of its own
        self._cache_inputs = [i for i in compiled.inputs if i.any_name.split(".")[0] in ("key_cache", "value_cache")]
        unknown = {i.any_name for i in compiled.inputs} - set(_DESCRIPTORS) - {i.any_name for i in self._cache_inputs}
        if unknown:
            raise ModelSourceError(f"The paged-attention model has inputs xpuspec does not feed: {sorted(unknown)}. "
                                   "Load it with ov_config={'ATTENTION_BACKEND': 'SDPA'}.")
        value_shape = next(i for i in self._cache_inputs if i.any_name.startswith("value_cache")).partial_shape
        self.block_size = int(value_shape[2].get_length())
        self.weight_bytes = (self.folder / MODEL_BIN).stat().st_size
        self.execution_devices = [str(d) for d in compiled.get_property("EXECUTION_DEVICES")]
        self.block_bytes = 0  # bytes of one block over every layer's key and value cache
        self._guard = threading.RLock()  # one pass or pool change at a time (sequences of several threads)
        self._pool = BlockPool(self.block_size, self._grow)  # which sequences hold which blocks; the prefix cache
        self._pool.add(self._grow(-(-capacity // self.block_size)))
        self._own = PagedSequence(self)  # the sequence the batch-1 Runner methods run on
        self._genai = GenAIGreedy(self.folder, device.upper(), config, attention_backend="PA")
        self._taps: List[str] = []  # outputs of the tapped layers' hidden states (set_taps)
        #: the fewest subsequences of a split pass: the plugin's threads (module docstring)
        self.split_width = plugin_threads(compiled)
        found = self._probe_numerics(is_cpu)
        #: the width of a 1-token prompt pass (2 where a 1-token pass computes otherwise than wider ones)
        self.prompt_width = found.single_step_width
        self.traits = dataclasses.replace(stepping(found, self.split_width), batches=True)

    def _probe_numerics(self, is_cpu: bool) -> numerics.StepNumerics:
        """How 1-token passes compute against wider ones, and whether split steps match them (:mod:`.numerics`)."""
        def measure():
            return numerics.probe(lambda tokens: self._pass(tokens, len(tokens)), self.rollback, self.reset,
                                  numerics.probe_tokens(self.folder, self.vocab_size),
                                  lambda tokens: self._infer([(self._own, tokens)], len(tokens), False, split=True))

        identity = numerics.device_identity(self._core, self.device.upper(), is_cpu)
        return numerics.cached_probe(self.folder, identity, self.configs[0], measure)

    @property
    def length(self) -> int:
        return self._own.length

    @property
    def last_taps(self):
        return self._own.last_taps

    def set_taps(self, layer_ids: Sequence[int]) -> None:
        """Recompile with outputs for the residual stream entering ``layer_ids`` (:func:`.graph.add_taps`): every
        pass then leaves each sequence's ``last_taps``. The KV cache is kept; a second compiled copy for the steps
        is made again when asked for (:meth:`expect_mixed_widths`)."""
        model = read_ir(self._core, self.folder)
        if self.head_tokens is not None:
            keep_head_rows(model, self.head_tokens.tolist())
        paged_model(model)
        names = add_taps(model, layer_ids)
        wide = self._core.compile_model(model, self.device.upper(), self.configs[0]).create_infer_request()
        for port in self._cache_inputs:
            wide.set_tensor(port.any_name, self._wide.get_tensor(port.any_name))
        self._model, self._wide, self._step, self._taps = model, wide, wide, names

    @property
    def compiled_copies(self) -> int:
        """Compiled copies of the model this runner holds: 1, or 2 after :meth:`expect_mixed_widths`."""
        return 1 if self._step is self._wide else 2

    def expect_mixed_widths(self) -> float:
        """Compile a second copy for the 1-token steps (once; see the module docstring) and run it
        :data:`WARM_UP_PASSES` times; returns the seconds it took (0 when made already). It shares the KV cache
        and holds a second copy of the weights (the RSS grows by about the size of the IR's weights)."""
        if self._step is not self._wide:
            return 0.0
        start = time.perf_counter()
        log.info("%s: a second compiled copy for 1-token steps (about %.0f MiB more)", numerics.ir_label(self.folder),
                 self.weight_bytes / 2**20)
        self._step = self._core.compile_model(self._model, self.device.upper(), self.configs[0]).create_infer_request()
        for port in self._cache_inputs:
            self._step.set_tensor(port.any_name, self._wide.get_tensor(port.any_name))
        width = self.traits.single_step_width
        for _ in range(WARM_UP_PASSES):  # past the cache's contents, which stay as they are
            self._infer([(self._own, [0] * width)], 1, step=True, split=self.traits.split_steps)
            self._own.rollback(width)
        return time.perf_counter() - start

    @property
    def device_map(self) -> List[dict]:
        return [{"stage": 0, "device": self.device, "layers": [0, self.num_layers], "weight_bytes": self.weight_bytes,
                 "execution_devices": self.execution_devices}]

    @property
    def capacity(self) -> int:
        """Tokens the runner's own sequence holds before its next block is taken from the pool."""
        return self._own.capacity

    # -- the block pool ---------------------------------------------------------------------------------------
    @property
    def blocks_in_use(self) -> int:
        """KV blocks held by sequences (the runner's own included; not idle blocks of the prefix cache)."""
        return self._pool.in_use

    @property
    def kv_budget_blocks(self) -> Optional[int]:
        """The most blocks in use (:meth:`set_kv_budget`), or ``None`` for no limit."""
        return self._pool.budget

    @property
    def prefix_cache(self) -> BlockPool:
        """The block pool: its prefix cache (``prefix_caching``, ``queries``, ``hits``, ``cached``)."""
        return self._pool

    def set_prefix_caching(self, on: bool) -> None:
        """Share full KV blocks across this runner's sequences by their tokens (:mod:`xpuspec.kv_blocks`); off
        empties the cache."""
        with self._guard:
            self._pool.set_prefix_caching(on)

    def set_kv_budget(self, budget_bytes: Optional[int]) -> None:
        """Cap the KV cache's blocks in use at ``budget_bytes`` (``None``: no cap). A pass that would need more
        raises :class:`xpuspec.errors.KVBudgetError` before it runs.

        Raises:
            ValueError: a budget below one block (:attr:`block_bytes` bytes), or not an integer.
        """
        if budget_bytes is None:
            self._pool.budget = None
            return
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < self.block_bytes:
            raise ValueError(f"set_kv_budget({budget_bytes!r}): give an integer number of bytes of at least one KV "
                             f"block ({self.block_bytes} bytes: {self.block_size} tokens over every layer).")
        self._pool.budget = budget_bytes // self.block_bytes

    def blocks_for(self, tokens: int) -> int:
        """Blocks a sequence of ``tokens`` tokens holds."""
        return -(-tokens // self.block_size)

    def budget_message(self, needed_blocks: int, what: str) -> str:
        """What :class:`KVBudgetError` says: the budget, what is needed, and what to change."""
        budget = self._pool.budget
        return (f"{what} needs {needed_blocks} KV blocks ({needed_blocks * self.block_bytes / 2**20:.1f} MiB, "
                f"{self.block_size} tokens a block) but the KV budget is {budget} blocks "
                f"({budget * self.block_bytes / 2**20:.1f} MiB; {self.blocks_in_use} in use). Raise the budget "
                "(runner.set_kv_budget(bytes), `xpuspec serve --kv-budget-mib`), or shorten the prompt or "
                "max_new_tokens, or run fewer sequences at once.")

    def _take(self, n: int, what: str) -> List[int]:
        """``n`` new blocks (:meth:`xpuspec.kv_blocks.BlockPool.take`: free, then evicted from the prefix cache,
        then new ones, the cache doubling within the budget).

        Raises:
            KVBudgetError: more blocks in use than the budget allows; nothing is taken.
        """
        with self._guard:
            return self._pool.take(n, lambda needed: self.budget_message(needed, what))

    def _give_back(self, blocks: List[int]) -> None:
        with self._guard:
            self._pool.release(blocks)

    def _copy_block(self, block: int) -> int:
        """A new block holding what ``block`` holds, over every layer's keys and values (copy on write)."""
        new = self._take(1, "a copy of a shared block")[0]
        for port in self._cache_inputs:
            data = self._wide.get_tensor(port.any_name).data
            data[new] = data[block]
        return new

    def _grow(self, blocks: int) -> int:
        """Reallocate the cache for at least ``blocks`` blocks (doubling), keeping what it holds; block ids stay.
        Returns the blocks it holds."""
        held, budget = self._pool.blocks, self._pool.budget
        blocks = max(blocks, 2 * held)
        if budget is not None:
            blocks = max(min(blocks, budget), held + 1)
        block_bytes = 0
        for port in self._cache_inputs:
            shape = [blocks] + [d.get_length() for d in list(port.partial_shape)[1:]]
            tensor = ov.Tensor(port.element_type, shape)
            if held:
                tensor.data[:held] = self._wide.get_tensor(port.any_name).data
                tensor.data[held:] = 0
            else:
                tensor.data[:] = 0
            block_bytes += tensor.byte_size // blocks
            self._step.set_tensor(port.any_name, tensor)
            self._wide.set_tensor(port.any_name, tensor)
        self.block_bytes = block_bytes
        return blocks

    # -- sequences --------------------------------------------------------------------------------------------
    def open_sequence(self) -> "PagedSequence":
        """A new empty sequence on this runner's compiled model and block pool (close it to free its blocks)."""
        return PagedSequence(self)

    def forward_batch(self, parts: Sequence[Tuple["PagedSequence", Sequence[int]]]) -> List[torch.Tensor]:
        """One inference over several sequences of this runner: ``parts`` is ``[(sequence, tokens), ...]`` (each
        sequence at most once, tokens non-empty), each appended to its own sequence's cache.

        Returns:
            per part, float32 ``[len(tokens), vocab_size]``: row i scores the token after ``tokens[i]``. With
            ``traits.split_steps`` each token computes as a 1-token step of its sequence; else each part's tokens
            run as given (a caller that wants a 1-token part to compute as a wider one pads it).

        Raises:
            KVBudgetError: the parts' new blocks do not fit the budget (no sequence changes).
            ValueError: a sequence of another runner, a sequence twice, or an empty part.
        """
        seqs = [seq for seq, _ in parts]
        if len({id(s) for s in seqs}) != len(seqs) or any(s.runner is not self or s.closed for s in seqs):
            raise ValueError("forward_batch: each part needs an open sequence of this runner, each at most once.")
        if not parts or any(len(tokens) == 0 for _, tokens in parts):
            raise ValueError("forward_batch: give at least one part, each with at least one token.")
        total = sum(len(t) for _, t in parts)
        rows = self._infer(parts, total, step=False, split=self.traits.split_steps)
        out, at = [], 0
        for _, tokens in parts:
            out.append(rows[at:at + len(tokens)])
            at += len(tokens)
        return out

    def _infer(self, parts, keep: int, step: bool, split: bool = False) -> torch.Tensor:
        """One inference over ``parts`` (``[(sequence, tokens)]``); the logits of the last ``keep`` tokens of all.
        ``step``: on the steps' compiled copy. ``split``: each token a 1-token subsequence (module docstring)."""
        with self._guard:
            return self._infer_held(parts, keep, step, split)

    def _infer_held(self, parts, keep: int, step: bool, split: bool) -> torch.Tensor:
        pad = max(0, self.split_width - sum(len(t) for _, t in parts)) if split else 0
        fed = parts if not pad else [*parts[:-1], (parts[-1][0], [*parts[-1][1]] + [parts[-1][1][-1]] * pad)]
        taken = []
        try:
            for seq, tokens in fed:
                taken.append((seq, seq.reserve(seq.length + len(tokens))))
                seq.own_from(seq.length, seq.length + len(tokens))
        except KVBudgetError:
            for seq, blocks in taken:
                seq.release(blocks)
            raise
        ids, positions, past_lens, begins, table, table_begins = [], [], [], [0], [], [0]
        longest = 0
        for seq, tokens in fed:
            past, end = seq.length, seq.length + len(tokens)
            ids.extend(tokens)
            positions.extend(range(past, end))
            for first, last in subsequences(past, end, split):
                past_lens.append(first)
                begins.append(begins[-1] + last - first)
                table.extend(seq.blocks[:self.blocks_for(last)])
                table_begins.append(len(table))
            if split:
                seq.stepped_from = min(past, seq.stepped_from)
            longest = max(longest, end)
        feed: Dict[str, np.ndarray] = {
            "input_ids": np.asarray(ids, dtype=np.int64),
            "position_ids": np.asarray(positions, dtype=np.int64),
            "past_lens": np.asarray(past_lens, dtype=np.int32),
            "subsequence_begins": np.asarray(begins, dtype=np.int32),
            "block_indices": np.asarray(table, dtype=np.int32),
            "block_indices_begins": np.asarray(table_begins, dtype=np.int32),
            "max_context_len": np.array(longest, dtype=np.int32),
            LOGITS_TO_KEEP: np.array([keep + pad], dtype=np.int64),
        }
        request = self._step if step else self._wide
        request.infer(feed, share_inputs=True)
        taps = (np.concatenate([request.get_tensor(name).data.reshape(len(ids), -1) for name in self._taps], axis=-1)
                if self._taps else None)
        at = 0
        for seq, tokens in parts:
            if taps is not None:  # the tapped hidden states of this sequence's tokens, from its first position
                seq.last_taps = (seq._length, torch.from_numpy(np.array(taps[at:at + len(tokens)], dtype=np.float32)))
            at += len(tokens)
            seq.tokens[seq._length:] = tokens
            seq._length += len(tokens)
        rows = torch.from_numpy(np.array(request.get_output_tensor(0).data, dtype=np.float32).reshape(keep + pad, -1))
        rows = rows[:keep]  # the padding's rows last
        return on_whole_vocabulary(rows, self.head_tokens, self.vocab_size)

    # -- the runner's own sequence (batch 1) ------------------------------------------------------------------
    def forward(self, tokens: Sequence[int], logits_to_keep: Optional[int] = None, exact: bool = True) -> torch.Tensor:
        return self._own.forward(tokens, logits_to_keep, exact)

    def forward_steps(self, tokens: Sequence[int]) -> torch.Tensor:
        return self._own.forward_steps(tokens)

    def _pass(self, tokens: Sequence[int], keep: int, step: bool = False) -> torch.Tensor:
        """One inference over ``tokens``, appended to the runner's own sequence; the logits of the last ``keep``.
        ``step``: a pass of the steps' width, run on the steps' copy."""
        return self._infer([(self._own, tokens)], keep, step)

    def native_greedy(self, prompt, max_new_tokens, min_new_tokens, eos, on_token):
        """openvino_genai's C++ loop with its paged-attention backend on the same IR and device; ``None``
        where this runner pads its 1-token passes or splits its steps (the engine's lone 1-token steps would
        compute otherwise) or scores only some tokens (the engine scores all)."""
        if self.traits.single_step_width > 1 or self.traits.split_steps or self.head_tokens is not None:
            return None
        return self._genai.generate(prompt, max_new_tokens, min_new_tokens, eos, on_token)

    def rollback(self, n: int) -> None:
        self._own.rollback(n)

    def reset(self) -> None:
        self._own.reset()


class PagedSequence(Runner):
    """One sequence on a :class:`PagedRunner`'s compiled model and block pool: a Runner of its own (forward,
    rollback, reset), for the batched engine and for drafters of concurrent requests. :meth:`close` gives its
    blocks back to the pool; :meth:`reserve` takes blocks ahead (an engine admitting a request).

    With the runner's prefix caching on, :meth:`reuse_prefix` starts an empty sequence on the cached blocks of its
    prompt and :meth:`share` publishes its accepted full blocks (:mod:`xpuspec.kv_blocks`); a pass never writes into
    a block that is cached or held by another sequence (:meth:`own_from` copies it first)."""

    def __init__(self, runner: PagedRunner):
        self.runner = runner
        self.blocks: List[int] = []
        self.tokens: List[int] = []  # the token at each position written (past ``length``: rolled back)
        self.stepped_from = float("inf")  # the first position a split step wrote (module docstring)
        self._length = 0
        self.closed = False
        for name in ("device", "vocab_size", "weight_bytes", "num_layers", "head_tokens", "block_size"):
            setattr(self, name, getattr(runner, name))

    @property
    def traits(self) -> RunnerTraits:
        return self.runner.traits

    @property
    def length(self) -> int:
        return self._length

    @property
    def capacity(self) -> int:
        return len(self.blocks) * self.block_size

    def reserve(self, tokens: int) -> List[int]:
        """Hold blocks for ``tokens`` tokens; returns the blocks newly taken.

        Raises:
            KVBudgetError: they do not fit the runner's KV budget (nothing is taken).
        """
        if self.closed:
            raise ValueError("this sequence is closed; open a new one with runner.open_sequence().")
        need = self.runner.blocks_for(tokens) - len(self.blocks)
        taken = self.runner._take(need, f"a sequence of {tokens} tokens")
        self.blocks += taken
        return taken

    def own_from(self, start: int, end: int) -> None:
        """Make the blocks holding positions ``start`` to ``end - 1`` this sequence's own before a pass writes
        there (they are held already, :meth:`reserve`): a block that is cached or held by another sequence is
        replaced by a copy (copy on write).

        Raises:
            KVBudgetError: no block is left for a copy (the blocks copied so far stay copied).
        """
        pool = self.runner.prefix_cache
        for i in range(start // self.block_size, -(-end // self.block_size)):
            if pool.shared(self.blocks[i]):
                old, self.blocks[i] = self.blocks[i], self.runner._copy_block(self.blocks[i])
                pool.release([old])

    def reuse_prefix(self, prompt: Sequence[int]) -> int:
        """Start this empty sequence on the cached blocks that ``prompt`` starts with (none where the runner's
        prefix caching is off); returns the tokens it now holds, whole blocks short of the prompt's last token
        (whose logits a pass must compute)."""
        if self._length or self.blocks:
            raise ValueError("reuse_prefix: the sequence must be empty (reset it first).")
        with self.runner._guard:
            self.blocks = self.runner.prefix_cache.match(list(prompt[:-1]))
        self._length = len(self.blocks) * self.block_size
        self.tokens = list(prompt[:self._length])
        return self._length

    def share(self, accepted: Sequence[int]) -> None:
        """Publish the full blocks this sequence holds whose tokens begin ``accepted`` (a request's context: its
        prompt and accepted output), so that later sequences reuse them; drafts past them stay private."""
        n = 0
        for written, want in zip(self.tokens[:min(self._length, self.stepped_from)], accepted):
            if written != want:
                break
            n += 1
        full = n // self.block_size
        with self.runner._guard:
            self.runner.prefix_cache.publish(self.blocks[:full], self.tokens[:full * self.block_size])

    def release(self, blocks: List[int]) -> None:
        """Give back ``blocks`` (the last taken, from :meth:`reserve`)."""
        keep = set(blocks)
        self.blocks = [b for b in self.blocks if b not in keep]
        self.runner._give_back(blocks)

    def forward_steps(self, tokens: Sequence[int]) -> torch.Tensor:
        if not self.traits.split_steps:
            return self.forward(tokens)
        return self.runner._infer([(self, tokens)], len(tokens), step=len(tokens) == 1, split=True)

    def forward(self, tokens: Sequence[int], logits_to_keep: Optional[int] = None, exact: bool = True) -> torch.Tensor:
        keep = min(logits_to_keep or len(tokens), len(tokens))
        step = self.runner.prompt_width if exact else 1  # the width of the runner's 1-token passes
        padding = max(0, step - len(tokens))
        if padding:  # a 1-token pass that would compute differently from wider ones (module docstring)
            rows = self.runner._infer([(self, list(tokens) + [tokens[-1]] * padding)], keep + padding, step=True)
            self._length -= padding
            return rows[:keep]
        return self.runner._infer([(self, tokens)], keep, step=len(tokens) == step)

    def rollback(self, n: int) -> None:
        if not 0 <= n <= self._length:
            raise ValueError(f"rollback({n}) with {self._length} tokens in the KV cache")
        self._length -= n

    def reset(self) -> None:
        """Empty the sequence and give its blocks back (it takes them again as it grows)."""
        self.runner._give_back(self.blocks)
        self.blocks, self.tokens, self._length, self.stepped_from = [], [], 0, float("inf")

    def close(self) -> None:
        """Give the sequence's blocks back to the pool (it cannot run again)."""
        if not self.closed:
            self.runner._give_back(self.blocks)
            self.blocks, self.tokens, self._length, self.closed = [], [], 0, True
