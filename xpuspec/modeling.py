"""The model class: :class:`XpuspecModelForCausalLM`, what ``from_pretrained`` (:mod:`xpuspec.loading`) returns:
``generate`` (every request a job of the model's engine, :mod:`xpuspec.engine`), ``model(input_ids)``, and
``save_low_bit``."""

import json
import logging
import os
import threading
from pathlib import Path
from typing import Optional

import torch
from transformers import GenerationConfig
from transformers.modeling_outputs import CausalLMOutputWithPast

from .batching import DEFAULT_MAX_BATCH
from .cache import METADATA_FILE, atomic_folder, read_metadata, refuse_replacing_anything_kept
from .errors import OutputExistsError, SpeculativeConfigError
from .generation import (GenerationStats, batch_stats, eos_ids, pack_output,
                         resolve_generation_config, stop_strings)
from .inputs import check_fits, check_input_ids, prompt_rows, row_config
from .sources import ModelSource
from .speculative.config import SpeculativeConfig
from .speculative.policy import PolicyBook
from .speculative.profile import SWEEP_WIDTHS, TargetCosts
from .speculative.resident import ReleasableRunner
from .speculative.pairing import plan_speculation

log = logging.getLogger("xpuspec")


class XpuspecModelForCausalLM:
    """A causal LM loaded by xpuspec. Use :meth:`AutoModelForCausalLM.from_pretrained` to make one.

    Attributes:
        config: the transformers ``PretrainedConfig``.
        generation_config: defaults for :meth:`generate` (from ``generation_config.json``).
        device: ``torch.device`` that input and output tensors live on (``cpu`` for OpenVINO, as in optimum-intel).
        device_name: where the model runs, in xpuspec's spelling (``"cpu"``, ``"gpu.1"``, ``"npu"``, ``"xpu:0"``;
            ``"gpu.0,gpu.1"`` for pipeline stages).
        backend_name: entry-point name of the backend (``"openvino"``, ``"torch"``).
        low_bit: the :class:`LowBitConfig` applied, or ``None``.
        runner: the backend's :class:`xpuspec.runner.Runner`.
        last_generate_stats: :class:`xpuspec.generation.GenerationStats` of this thread's last ``generate`` call
            (each thread sees its own, as concurrent calls become rows of one batch).
        max_batch: the most rows the batched engine verifies in one step (concurrent calls and batch rows past it
            wait); read when the engine is first made.
        speculative_config: the :class:`SpeculativeConfig` given at load time, or ``None``.
        draft_model: the draft model of ``"self"``, ``"hybrid"`` or ``"draft"`` speculation, or ``None``.
        draft_memory_bytes: with a speculative config, the process memory (RSS) that speculation added at load: the
            draft model and any second compiled copy for 1-token steps (``None`` where RSS cannot be read, or no
            speculation). A draft model the policy left out of ``SpeculativeConfig.release_draft_after`` (4) requests in
            a row is released, and loaded again when a request drafts with it.
        format_choice: with ``load_in_low_bit="auto"``, the :class:`xpuspec.formats.FormatChoice` (every candidate's
            measured perplexity change and speed, and the one chosen); else ``None``.
    """

    def __init__(self, source: ModelSource, backend, device_name: str, runner, low_bit):
        self.source = source
        self._source_folder = Path(os.path.abspath(source.path))  # as at load: save_low_bit must not replace it
        self.name_or_path = source.name
        self.config = source.config
        try:
            self.generation_config = GenerationConfig.from_pretrained(source.path)
        except OSError:
            self.generation_config = GenerationConfig.from_model_config(self.config)
        self.backend = backend
        self.backend_name = backend.name
        self.device_name = device_name
        self.runner = runner
        self.low_bit = low_bit
        self._thread_stats = threading.local()  # last_generate_stats, per calling thread
        self.max_batch = DEFAULT_MAX_BATCH
        self.speculative_config: Optional[SpeculativeConfig] = None
        self.draft_model: Optional["XpuspecModelForCausalLM"] = None
        self.eagle3_head = None  # an EAGLE-3 head (speculative mode "eagle3")
        self.format_choice = None
        self.draft_memory_bytes: Optional[int] = None
        self._policies = PolicyBook(runner.traits.single_step_width)  # speculation across requests, per drafter
        self._costs = TargetCosts()  # what the runner's passes cost, once measured
        self._suffix_cache = None  # SuffixDecoding's outputs of earlier requests, made on first use
        self._lock = threading.RLock()  # held by the engine's thread while it steps with this model, and by model(...)
        self._loop_lock = threading.Lock()
        self._loop = None  # the engine's loop (xpuspec.engine.EngineLoop), made on first use
        self._prefix_caching = False

    @property
    def device_map(self):
        """One dict per pipeline stage: ``stage``, ``device``, ``layers`` (``[first, end)``), ``weight_bytes``
        (and, on OpenVINO, ``execution_devices``: where the compiled stage really runs). One entry when unsplit."""
        return self.runner.device_map

    @property
    def device(self) -> torch.device:
        return torch.device(self.device_name) if self.device_name.startswith("xpu") else torch.device("cpu")

    def can_generate(self) -> bool:
        return True

    def suffix_cache(self, spec: Optional[SpeculativeConfig] = None):
        """This model's :class:`~xpuspec.speculative.suffix_cache.SuffixCache` (the outputs of its earlier
        requests, for suffix decoding), made on first use; saved under ``spec.suffix_cache_dir`` when set."""
        from .speculative.suffix_cache import SuffixCache

        if self._suffix_cache is None:
            key = f"{self.name_or_path}:{self.low_bit.format if self.low_bit else 'fp32'}"
            cache_dir = spec.suffix_cache_dir if spec is not None else None
            self._suffix_cache = SuffixCache(key, cache_dir=cache_dir)
        return self._suffix_cache

    def _supports_logits_to_keep(self):
        """transformers' assisted generation asks its ``assistant_model`` this first: refuse there, clearly.

        Raises:
            TypeError: always; an xpuspec model drafts only for xpuspec targets.
        """
        raise TypeError(
            "an xpuspec model cannot be the assistant_model of a transformers model: transformers' assisted "
            "generation drives its assistant through torch KV caches that xpuspec's backends do not expose. Load the "
            "target with xpuspec too (xpuspec.AutoModelForCausalLM.from_pretrained) and pass the draft there.")

    def eval(self) -> "XpuspecModelForCausalLM":
        """Nothing to switch: the model only infers (for code written for torch modules). Returns ``self``."""
        return self

    def to(self, *args, **kwargs) -> "XpuspecModelForCausalLM":
        """``self`` where every argument names where the model already is (:attr:`device` or the device it was
        loaded on, e.g. ``model.to("cpu")``), for code written for torch modules.

        Raises:
            NotImplementedError: another device or a dtype; xpuspec places and formats a model when it loads it.
        """
        here = {str(self.device), self.device_name.lower(), f"{self.device.type}:{self.device.index or 0}"}
        for value in (*args, *(v for k, v in kwargs.items() if k not in ("non_blocking", "copy"))):
            if not (isinstance(value, (str, torch.device)) and str(value).lower() in here):
                raise NotImplementedError(
                    f"{type(self).__name__}.to({value!r}): xpuspec places a model when it loads it (it is on "
                    f"{self.device_name}); load it again with from_pretrained(..., device=..., load_in_low_bit=...).")
        return self

    @property
    def context_length(self) -> Optional[int]:
        """Tokens the model can hold, prompt and new tokens together (``None`` if unknown); see :meth:`generate`."""
        return self._context_length()

    def _context_length(self) -> Optional[int]:
        """Tokens the model can hold: ``max_position_embeddings``, or less where the runner's KV cache is smaller."""
        limits = [n for n in (getattr(self.config, "max_position_embeddings", None), self.runner.max_length) if n]
        return min(limits) if limits else None

    def generate(self, input_ids=None, attention_mask=None, generation_config=None, streamer=None,
                 assistant_model=None, prompt_lookup_num_tokens=None, num_assistant_tokens=None,
                 num_assistant_tokens_schedule=None, assistant_confidence_threshold=None,
                 speculative: Optional[bool] = None, tokenizer=None, response_format=None, **kwargs):
        """Generate like ``transformers.GenerationMixin.generate`` (greedy or sampling, one prompt or a batch).

        Args:
            input_ids: LongTensor ``[1, prompt_len]`` (or ``[prompt_len]``), or a batch ``[B, T]``.
            attention_mask: optional, of ``input_ids``' shape: ones, or a batch's left or right padding (zeros at one
                end of each row). A batch runs as rows of one engine (:mod:`xpuspec.engine`, the OpenVINO paged
                runner), each row with the output it has alone.
            generation_config: a ``GenerationConfig``; defaults to :attr:`generation_config`.
            streamer: a transformers streamer such as ``TextStreamer``.
            assistant_model: an xpuspec model that drafts for this one (any backend or device).
            prompt_lookup_num_tokens: draft this many tokens by n-gram prompt lookup (with
                ``assistant_model`` too: hybrid drafting).
            num_assistant_tokens, num_assistant_tokens_schedule, assistant_confidence_threshold:
                draft length k, ``"heuristic"`` or ``"constant"``, and the confidence stop.
            speculative: ``False`` decodes plainly even if the model was loaded with ``speculative=``.
            tokenizer: the model's tokenizer, which ``stop_strings`` need (transformers' argument).
            response_format: structured output, as in the OpenAI API: ``{"type": "json_schema", "json_schema":
                {"name": ..., "schema": {...}}}``, ``{"type": "json_object"}``, or vLLM's grammars as
                ``{"type": "grammar", "grammar": "<Lark>"}`` / ``{"type": "regex", "regex": "..."}``
                (:mod:`xpuspec.grammar`): every token, drafted or not, is masked by the grammar, so greedy output
                is the same with speculation on and off; EOS only where the output is complete.
            **kwargs: GenerationConfig fields: ``max_new_tokens``, ``min_new_tokens``, ``do_sample``,
                ``temperature``, ``top_k``, ``top_p``, ``repetition_penalty``, ``eos_token_id``,
                ``pad_token_id``, ``return_dict_in_generate``, ``output_scores``, ``output_logits``, ``stop_strings`` (the
                output ends with the token that completes one, as in transformers), ...

        Returns:
            LongTensor ``[1, prompt_len + new_tokens]`` (int64, CPU), or
            ``transformers.generation.GenerateDecoderOnlyOutput`` when ``return_dict_in_generate=True``. A batch
            gives ``[B, T + new]``, each row padded with ``pad_token_id`` after its end, scores ``[B, vocab]`` per
            step, and ``last_generate_stats.rows`` per row.

        If the prompt plus ``max_new_tokens`` passes the model's context, generation stops at the
        context (fewer new tokens) and one warning is logged.

        Thread-safe: concurrent calls on one model become rows of one batch on the OpenVINO paged runner (elsewhere
        they run one at a time), each with the output it would have alone.

        With the cost model on (the default), each round drafts the length that the target's measured verify costs
        and the measured acceptance favour, and a draft model that cannot pay stops for the rest of the request (a
        hybrid keeps its prompt lookup); after two such requests in a row, later ones leave it out, probing again
        after 1, 2, 4, ... (at most 16) requests (:mod:`xpuspec.speculative.policy`; ``last_generate_stats`` says so).

        Raises:
            InvalidInputError: empty prompt, ids that are not integers or lie outside the vocabulary,
                an ``attention_mask`` of another shape; in a batch, ragged lists, a mask with a hole, a row of zeros,
                or padding on both sides.
            PromptTooLongError: the prompt leaves no room in the context, or passes the NPU prompt window.
            ResponseFormatError: a ``response_format`` of an unknown type, a schema that is not valid or not
                supported, a grammar or regex that does not compile.
            GenerationConfigError: ``max_new_tokens < 1``, a ``max_length`` the prompt fills, ``do_sample`` with
                ``temperature <= 0``, a sampling value transformers refuses (``top_k=-1``).
            SpeculativeConfigError: a draft length, schedule or confidence threshold that is not valid, or
                ``speculative=True`` with nothing to draft with.
            NotImplementedError: beams, or an unimplemented generation option.
            KVBudgetError: a row whose KV blocks can never fit the runner's KV budget (``set_kv_budget``).
            ValueError: a streamer with a batch.
            TypeError: an unknown keyword argument, ``max_new_tokens`` not an integer, ``speculative`` not a bool,
                or an assistant_model that is not an xpuspec model.
            DraftMismatchError: the assistant's vocabulary differs from this model's.
        """
        from .decode import new_request
        from .engine import Job

        rows = prompt_rows(input_ids, attention_mask, self.runner.vocab_size)
        if streamer is not None and len(rows.prompts) > 1:
            raise ValueError("TextStreamer only supports batch size 1: a streamer takes one row of tokens "
                             f"(got a batch of {len(rows.prompts)}); stream one prompt per generate call.")
        spec_args = (prompt_lookup_num_tokens, num_assistant_tokens, num_assistant_tokens_schedule,
                     assistant_confidence_threshold)
        if assistant_model is not None and not isinstance(assistant_model, XpuspecModelForCausalLM):
            raise TypeError(
                f"assistant_model must be an xpuspec model, got {type(assistant_model).__name__}; "
                "load it with xpuspec.AutoModelForCausalLM.from_pretrained."
            )
        if assistant_model is not None and assistant_model.runner is self.runner:
            raise ValueError("assistant_model is this model itself; they would share one KV cache. "
                             "Load a separate copy (e.g. with load_in_low_bit='int4_sym') or use speculative='self'.")
        if speculative is not None and not isinstance(speculative, bool):
            raise TypeError(f"speculative must be True, False or None, got {speculative!r}.")
        if speculative and self.speculative_config is None and assistant_model is None and spec_args[0] is None:
            raise SpeculativeConfigError(
                "generate(speculative=True) on a model loaded without speculation has nothing to draft with: load it "
                "with from_pretrained(..., speculative=...), or pass assistant_model= or prompt_lookup_num_tokens=.")
        base = resolve_generation_config(self.generation_config, generation_config, kwargs)
        stop = stop_strings(base, tokenizer)
        grammar = self.grammar_for(response_format)
        context = self._context_length()
        configs = [row_config(base, len(prompt), context, self.runner.max_prompt_len, self.device_name)
                   for prompt in rows.prompts]

        def prepare(prompt, config, row_streamer):
            def make():  # in the engine's thread, holding the models' locks
                plan = plan_speculation(
                    self, None if speculative is False else self.speculative_config, speculative is not False,
                    assistant_model, *spec_args)
                plan, policy, setup_s, skipped = self._policy_for(plan, config)
                req = new_request(prompt, config, row_streamer, None if plan is None else plan.drafter, policy,
                                  stop, setup_s, None if grammar is None else grammar(eos_ids(config)))
                req.stats.draft_model_skipped = skipped
                return req
            return make

        models = tuple(m for m in (self, assistant_model, self.draft_model) if m is not None)
        jobs = [Job(prepare(p, c, streamer), models) for p, c in zip(rows.prompts, configs)]
        if streamer is not None:
            streamer.put(rows.ids.cpu())
        self._engine_loop().run(jobs)
        if streamer is not None:
            streamer.end()
        failed = next((j.error for j in jobs if j.error is not None), None)
        if failed is not None:
            raise failed
        results = [j.result for j in jobs]
        self.last_generate_stats = batch_stats([r[3] for r in results]) if len(jobs) > 1 else results[0][3]
        return pack_output(rows.ids, [r[:3] for r in results], base, self.runner.vocab_size)

    def grammar_for(self, response_format):
        """``eos -> GrammarMatcher`` for ``response_format`` (compiled now, so a bad one fails before decoding; the
        server calls it to refuse one before queueing), or ``None`` without one. The grammar compiler of the model's
        own tokenizer is made on first use (about a second) and caches compiled grammars.

        Raises:
            ResponseFormatError: as :meth:`generate`.
        """
        from .grammar import GrammarCompiler, grammar_of

        if grammar_of(response_format) is None:
            return None
        with self._loop_lock:
            compiler = getattr(self, "_grammar_compiler", None)
            if compiler is None:
                import transformers

                tokenizer = transformers.AutoTokenizer.from_pretrained(str(self._source_folder))
                compiler = GrammarCompiler(tokenizer, self.runner.vocab_size, eos_ids(self.generation_config))
                self._grammar_compiler = compiler
        compiler.compile(response_format)
        return lambda eos: compiler.matcher(response_format, eos)

    def _policy_for(self, plan, config, target_steps: bool = True):
        """``(plan, policy, setup_s, skipped)`` of one request: the policy of ``plan``'s drafter, the plan without
        its draft model where the policy skips it. ``target_steps``: prepare the target for mixed widths too (a
        request alone; the batched engine verifies through one compiled copy)."""
        policy, setup_s, skipped = None, 0.0, False
        if plan is not None:
            sample = bool(config.do_sample)
            book = self._policies.policy(plan.kind, plan.draft_runner, sample, plan.drafter.uses_model, plan.name)
            releasable = plan.draft_runner if isinstance(plan.draft_runner, ReleasableRunner) else None
            skipped = not book.starts_model(plan.schedule, releasable is None or releasable.probe_affordable())
            after = self.speculative_config.release_draft_after if self.speculative_config else 0
            if skipped and book.releases_model(after) and releasable is not None:
                freed = releasable.release()
                if freed:
                    log.info("%s released (%.1f MiB of weights): left out of %d requests in a row; loaded again when a "
                             "request drafts with it", plan.name, freed / 2**20, book.skipped)
            if skipped:  # a hybrid keeps its prompt lookup
                plan = plan.without_model()
                book = None if plan is None else self._policies.policy(plan.kind, None, sample, False, plan.name)
            if plan is not None:
                policy = book.begin(plan.schedule, self._costs.profile, plan.drafter.uses_model)
                for runner in plan.drafter.runners() or ([self.runner] if target_steps else []):
                    setup_s += runner.expect_mixed_widths()  # whose passes will alternate widths
        return plan, policy, setup_s, skipped

    # -- batches: rows of one engine (xpuspec.engine) ---------------------------------------------------------
    @property
    def last_generate_stats(self) -> Optional[GenerationStats]:
        return getattr(self._thread_stats, "value", None)

    @last_generate_stats.setter
    def last_generate_stats(self, stats: Optional[GenerationStats]) -> None:
        self._thread_stats.value = stats

    def can_batch(self, assistant_model=None) -> bool:
        """Whether this model, its draft model and ``assistant_model`` verify several sequences in one pass (the
        OpenVINO paged runner), so that batches and concurrent calls verify as rows of one pass; elsewhere the
        engine has one row, and they run one after another through it."""
        from .engine import batches

        return all(batches(m.runner) for m in (self, assistant_model, self.draft_model) if m is not None)

    @property
    def prefix_caching(self) -> bool:
        """Whether requests start on the cached KV blocks of earlier ones (:meth:`set_prefix_caching`)."""
        return self._prefix_caching

    def set_prefix_caching(self, on: bool = True) -> None:
        """Turn prefix caching on or off (vLLM's and openvino_genai's ``enable_prefix_caching``).

        On, a request starts on the KV blocks of the longest cached start of its prompt (the prompts and accepted
        outputs of earlier requests, :mod:`xpuspec.kv_blocks`) and prefills only the rest; the output does not
        change. The draft model caches its blocks the same way where its runner has a paged KV cache; one that sees
        only the context's last tokens (``SpeculativeConfig.draft_context_length``, on by default) starts each request
        at another token, so its blocks match only with ``draft_context_length=0``. Plain greedy
        requests then decode in xpuspec's engine, not the backend's native one (whose KV cache later requests could
        not reuse). Off empties the cache.

        Raises:
            ValueError: on, for a target whose runner has no paged KV cache (the torch backend, pipeline stages,
                the NPU).
        """
        if on and not hasattr(self.runner, "set_prefix_caching"):
            raise ValueError(f"prefix caching needs a paged KV cache, and {self.name_or_path} on {self.device_name} "
                             f"({self.backend_name} backend) has none: load it with backend='openvino' on one CPU or "
                             "GPU, or leave enable_prefix_caching off.")
        with self._lock:
            if hasattr(self.runner, "set_prefix_caching"):
                self.runner.set_prefix_caching(on)
            draft = self.draft_model
            if draft is not None:
                resident = not isinstance(draft.runner, ReleasableRunner) or draft.runner.resident
                if resident and hasattr(draft.runner, "set_prefix_caching"):
                    draft.runner.set_prefix_caching(on)  # a released draft takes the setting when it loads again
                elif on and resident:
                    log.info("the draft model %s keeps no prefix cache: its %s runner has no paged KV cache",
                             draft.name_or_path, draft.backend_name)
            self._prefix_caching = bool(on)

    def _engine_loop(self):
        """This model's :class:`xpuspec.engine.EngineLoop`, made (with its engine) on first use."""
        from .engine import Engine, EngineLoop, loop_for

        with self._loop_lock:
            if self._loop is None:
                self._loop = loop_for(self, lambda: EngineLoop(Engine(self.runner, self._costs, self.max_batch),
                                                                _lock_of))
            return self._loop

    def close(self) -> None:
        """Stop this model's engine thread (it stops by itself when the model is collected)."""
        with self._loop_lock:
            if self._loop is not None:
                self._loop.stop()
                self._loop = None

    def _prepare_speculation(self) -> None:
        """At load, what the first speculative request would otherwise spend its setup on: the second compiled copy
        for 1-token steps of the runners whose passes alternate widths (a hybrid's target too, for the requests
        that draft by its prompt lookup alone), and the target's cost profile (a sweep of pass widths after a short
        prefill; its timings, not its tokens, matter)."""
        plan = plan_speculation(self, self.speculative_config, True)
        for chosen in filter(None, (plan, plan.without_model())):  # expect_mixed_widths prepares a runner once
            for runner in chosen.drafter.runners() or [self.runner]:
                runner.expect_mixed_widths()
        if plan.schedule.cost_model and not self.runner.traits.lockstep:
            from .engine import profile_target

            token = self.generation_config.bos_token_id or 0
            token = token if isinstance(token, int) else 0
            self.runner.reset()
            self.runner.forward([token] * PROFILE_CONTEXT, logits_to_keep=1)
            profile_target(self._costs, self.runner, token, SWEEP_WIDTHS[-1], self.can_batch())
            self.runner.reset()

    def __call__(self, input_ids=None, attention_mask=None, labels=None, past_key_values=None,
                 use_cache=None, return_dict=None) -> CausalLMOutputWithPast:
        """One forward pass over the whole sequence, without past KV, like ``model(input_ids)``.

        Args:
            input_ids: LongTensor ``[1, seq_len]``.
            labels: optional LongTensor ``[1, seq_len]``; -100 positions are ignored. As in
                transformers, the loss is the mean next-token cross-entropy (labels shifted by one).

        Returns:
            ``CausalLMOutputWithPast`` with ``logits`` float32 ``[1, seq_len, vocab_size]`` on the CPU,
            and ``loss`` (scalar float32) when ``labels`` is given.

        Raises:
            InvalidInputError: as for :meth:`generate`.
            PromptTooLongError: more tokens than the model's context (or the NPU prompt window).
            NotImplementedError: batch > 1, padding, ``past_key_values`` given, or ``use_cache=True`` (no KV cache
                comes back: a loop that fed it back would compute its next token without the context).
        """
        if past_key_values is not None or use_cache:
            raise NotImplementedError("past_key_values and use_cache=True are not supported: model(...) computes the "
                                      "whole sequence and returns no KV cache; use generate() for decoding.")
        input_ids = check_input_ids(input_ids, attention_mask, self.runner.vocab_size)
        check_fits(input_ids.shape[1], self._context_length(), self.runner.max_prompt_len, self.device_name,
                   room_for_next=False)
        with self._lock:
            self.runner.reset()
            logits = self.runner.forward(input_ids[0].tolist())[None]
            self.runner.reset()
        loss = None
        if labels is not None:
            loss = torch.nn.functional.cross_entropy(
                logits[0, :-1], torch.as_tensor(labels).reshape(-1)[1:].to(torch.long), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits)

    forward = __call__

    def save_low_bit(self, save_directory, force: bool = False) -> Path:
        """Save the compressed model so :meth:`AutoModelForCausalLM.load_low_bit` restores it bit-identically.

        Raises:
            OutputExistsError: ``save_directory`` exists and is not empty, and ``force`` is false; or it is, or holds,
                the model's own folder, xpuspec's cache (or lies inside it) or the current folder (refused even with
                ``force``).
            NotImplementedError: the model runs on the torch backend, which writes no IR (nothing is written).
        """
        out = Path(os.path.abspath(Path(save_directory).expanduser()))
        refuse_replacing_anything_kept(out, self._source_folder)
        if out.exists() and any(out.iterdir()) and not force:
            raise OutputExistsError(f"{out} is not empty; pass force=True to replace it.")
        with atomic_folder(out, overwrite=True) as tmp:
            self.backend.save_low_bit(self.runner, tmp)
            meta = read_metadata(tmp)
            meta.update(source=self.name_or_path, low_bit=(self.low_bit.as_dict() if self.low_bit else {"format": "fp32"}))
            (tmp / METADATA_FILE).write_text(json.dumps(meta, indent=2))
        return out

    def __repr__(self) -> str:
        fmt = self.low_bit.format if self.low_bit else "source precision"
        return f"{type(self).__name__}({self.name_or_path!r}, device={self.device_name!r}, backend={self.backend_name!r}, {fmt})"


def _lock_of(model: XpuspecModelForCausalLM) -> threading.RLock:
    """The lock the engine holds while it computes with ``model``'s runner."""
    return model._lock


#: Tokens in the KV cache when the cost profile is measured at load.
PROFILE_CONTEXT = 32
