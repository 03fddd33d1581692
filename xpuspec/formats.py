"""``load_in_low_bit="auto"``: the fastest weight format whose measured quality loss stays within a bound.

For one model on one device, every format of :data:`CANDIDATES` is loaded and measured once:

- **quality**: sliding-window perplexity (:func:`xpuspec.perplexity.perplexity`) on :data:`PPL_TOKENS` tokens of
  the evaluation corpus (half HumanEval code, half Python documentation prose; :func:`xpuspec.perplexity.eval_texts`),
  as a relative change against fp32 (``ppl_delta``: 0.05 is +5%);
- **speed**: greedy decoding of :data:`SPEED_TOKENS` tokens after a code prompt, the best of :data:`SPEED_REPEATS`
  runs, in tokens per second end to end (the path ``generate`` takes).

The measurements are cached under ``<cache>/formats/``, keyed by the model folder's fingerprint, the device's
identity (:meth:`xpuspec.devices.Backend.identity`: backend and library version, device name, CPU flags) and the
compile properties, so they are taken once per model and machine type. The choice itself is made from them at
each load (:func:`choose`), so another bound needs no new measurement. A cache entry that cannot be read is
measured again, with one warning.
"""

import json
import logging
import math
import time
from dataclasses import asdict, dataclass
from typing import Callable, Optional, Sequence, Tuple

from .cache import cache_root, check_writable, digest, folder_fingerprint, write_text_atomic
from .errors import LowBitConfigError
from .lowbit import LowBitConfig
from .progress import minutes_text, phase

log = logging.getLogger("xpuspec")

AUTO = "auto"
#: Formats ``auto`` chooses among, each at its default settings (INT4: group 128, fitted to the model).
CANDIDATES = ("int4_asym", "int4_sym", "int8_asym", "int8_sym", "fp16", "fp32")
#: The reference of the perplexity change; it is always within any bound.
REFERENCE = "fp32"
#: Largest perplexity change against fp32 that ``auto`` accepts (0.05: +5%).
DEFAULT_PPL_BOUND = 0.05
#: A format whose measured perplexity change passes this gets one INFO line at load.
PPL_NOTE_THRESHOLD = 0.05
PPL_TOKENS, PPL_CONTEXT, PPL_STRIDE = 512, 256, 128
SPEED_TOKENS, SPEED_REPEATS = 24, 3
#: Bumped when the measurement changes, so that older cached measurements are not reused.
MEASURE_VERSION = 1


@dataclass(frozen=True)
class FormatMeasure:
    """One format measured on one model and device.

    Attributes:
        format: a :data:`CANDIDATES` name.
        perplexity: sliding-window perplexity on the corpus.
        ppl_delta: ``perplexity / perplexity(fp32) - 1`` (0.05 is +5%).
        tokens_per_s: greedy decoding speed, end to end.
        weight_mib: the compiled weights, MiB.
    """

    format: str
    perplexity: float
    ppl_delta: float
    tokens_per_s: float
    weight_mib: float


@dataclass(frozen=True)
class FormatChoice:
    """What ``auto`` chose: ``format`` (its :class:`FormatMeasure` is :attr:`chosen`), under ``bound``, from
    ``measures`` (every candidate)."""

    format: str
    bound: float
    measures: Tuple[FormatMeasure, ...]

    @property
    def chosen(self) -> FormatMeasure:
        return next(m for m in self.measures if m.format == self.format)


def choose(measures: Sequence[FormatMeasure], bound: float = DEFAULT_PPL_BOUND) -> FormatChoice:
    """The fastest of ``measures`` whose ``ppl_delta`` is at most ``bound`` (fp32, the reference, always is).

    Raises:
        ValueError: ``bound`` is negative or not a number, or no measure is within it.
    """
    if isinstance(bound, bool) or not isinstance(bound, (int, float)) or not bound >= 0:
        raise ValueError(f"The perplexity bound must be a number >= 0 (0.05: +5%), got {bound!r}.")
    within = [m for m in measures if m.format == REFERENCE or m.ppl_delta <= bound]
    if not within:
        raise ValueError(f"No format is within a perplexity change of {bound:+.1%}.")
    best = max(within, key=lambda m: m.tokens_per_s)
    return FormatChoice(best.format, float(bound), tuple(measures))


Load = Callable[[LowBitConfig], object]


def measure_formats(load: Load, tokenizer, formats: Sequence[str] = CANDIDATES) -> Tuple[FormatMeasure, ...]:
    """Load each of ``formats`` with ``load`` (a ``LowBitConfig`` -> xpuspec model) and measure it (module doc).
    fp32 is measured first, as the reference, whether listed or not. One progress bar (:func:`xpuspec.progress.phase`)."""
    from .perplexity import eval_texts

    texts = eval_texts(tokenizer, None, PPL_TOKENS)
    prompt = texts["code"][:32][None]
    order = [REFERENCE] + [f for f in formats if f != REFERENCE]
    found, reference = [], None
    with phase(f"measure {len(order)} weight formats", total=len(order), unit="format") as bar:
        for name in order:
            bar.set_postfix_str(name)
            measure = _measure_one(load, name, texts, prompt, reference)
            bar.update(1)
            if measure is None:
                continue
            reference = measure.perplexity if reference is None else reference
            found.append(measure)
    return tuple(found)


def _measure_one(load: Load, name: str, texts, prompt, reference: Optional[float]) -> Optional[FormatMeasure]:
    """One format of :func:`measure_formats` (``reference``: fp32's perplexity, ``None`` while measuring fp32);
    ``None`` where the backend does not run it."""
    import gc

    import torch

    from .perplexity import perplexity

    try:
        model = load(LowBitConfig(name))
    except LowBitConfigError as exc:  # a format this backend does not run (the torch one has no INT)
        log.debug("auto format: %s skipped: %s", name, exc)
        return None
    try:
        nll = count = 0.0
        for ids in texts.values():
            n = len(ids) - 1
            nll, count = nll + n * math.log(perplexity(model, ids, PPL_CONTEXT, PPL_STRIDE)), count + n
        ppl = math.exp(nll / count)
        reference = ppl if reference is None else reference
        best = math.inf
        for _ in range(SPEED_REPEATS):
            start = time.perf_counter()
            with torch.no_grad():
                model.generate(prompt, max_new_tokens=SPEED_TOKENS, min_new_tokens=SPEED_TOKENS, do_sample=False)
            best = min(best, time.perf_counter() - start)
        measure = FormatMeasure(name, ppl, ppl / reference - 1, SPEED_TOKENS / best, model.runner.weight_bytes / 2**20)
        log.debug("auto format: %s perplexity %.3f (%+.2f%%), %.1f tokens/s", name, ppl, 100 * measure.ppl_delta,
                  measure.tokens_per_s)
        return measure
    finally:
        del model
        gc.collect()


#: Seconds :func:`measure_formats` takes per GB of fp32 weights on 2 cores, all six formats (NNCF compression, compile,
#: perplexity, speed), export to OpenVINO IR included: SmolLM2-135M (0.54 GB) took 56-61 s on 2 quiet cores with
#: NNCF's numpy path for small models (benchmarks/results/first-run.md). Only for the estimate said at the start.
MEASURE_S_PER_GB_2_CORES = 120.0


def estimate_seconds(folder) -> Optional[float]:
    """About how long :func:`measure_formats` takes for the Hugging Face model in ``folder``, from its weight
    files' size (:data:`MEASURE_S_PER_GB_2_CORES`) and the cores this process may use; ``None`` if unknown."""
    import os
    from pathlib import Path

    size = sum(p.stat().st_size for pattern in ("*.safetensors", "*.bin") for p in Path(folder).glob(pattern))
    if not size:
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 2)
    return MEASURE_S_PER_GB_2_CORES * size / 1e9 * 2 / max(2, min(cores, 8))


def measures_path(folder, identity: dict, compile_config: Optional[dict] = None):
    """The cache file of the measurements of the model in ``folder`` on the device ``identity`` describes."""
    key = digest(MEASURE_VERSION, folder_fingerprint(folder), identity, compile_config or {}, CANDIDATES,
                 (PPL_TOKENS, PPL_CONTEXT, PPL_STRIDE, SPEED_TOKENS, SPEED_REPEATS))
    return cache_root() / "formats" / f"{key}.json"


def cached_measures(path, warn: bool = True) -> Optional[Tuple[FormatMeasure, ...]]:
    """The measurements cached at ``path`` (those of the candidates the backend runs); ``None`` where there are none or they cannot be read (one warning)."""
    try:
        text = path.read_text()
    except OSError:
        return None
    try:
        found = tuple(FormatMeasure(**row) for row in json.loads(text)["measures"])
        if REFERENCE not in {m.format for m in found} or not {m.format for m in found} <= set(CANDIDATES):
            raise ValueError("the reference or an unknown format")
        return found
    except (ValueError, TypeError, KeyError) as exc:
        if warn:
            log.warning("the cached format measurements %s cannot be read (%s); measuring again", path, exc)
        return None


def auto_format(folder, identity: dict, load: Load, tokenizer_factory: Callable[[], object],
                compile_config: Optional[dict] = None, bound: float = DEFAULT_PPL_BOUND) -> FormatChoice:
    """The format ``auto`` gives the model in ``folder`` on the device ``identity`` describes, measured once
    (:func:`measure_formats`, which takes minutes for a 1B model) and then read from the cache; one INFO line."""
    path = measures_path(folder, identity, compile_config)
    measures = cached_measures(path)
    if measures is None:
        what = "load_in_low_bit='auto' (measuring the formats once on this device)"
        check_writable(path.parent, what)  # before minutes of measuring, not after
        log.info("load_in_low_bit='auto': the first load on this device measures %d weight formats once (%s; %s); "
                 "later loads read the measurements from %s", len(CANDIDATES), minutes_text(estimate_seconds(folder)),
                 ", ".join(CANDIDATES), path.parent)
        measures = measure_formats(load, tokenizer_factory())
        write_text_atomic(path, json.dumps({"identity": identity, "measures": [asdict(m) for m in measures]},
                                           indent=1), what)
    choice = choose(measures, bound)
    fastest = max(measures, key=lambda m: m.tokens_per_s)
    chosen = choice.chosen
    log.info("load_in_low_bit='auto' chose %s: perplexity %+.1f%% vs fp32 (bound %+.0f%%), %.1f tokens/s%s", chosen.format,
             100 * chosen.ppl_delta, 100 * bound, chosen.tokens_per_s,
             "" if fastest is chosen else f"; the fastest, {fastest.format} ({fastest.tokens_per_s:.1f} tokens/s), "
             f"is {100 * fastest.ppl_delta:+.1f}%")
    log.info("the compressed weights and the measurements are cached in %s (XPUSPEC_CACHE moves the cache)",
             cache_root())
    return choice


def note_quality(folder, identity: dict, fmt: str, compile_config: Optional[dict] = None) -> Optional[FormatMeasure]:
    """Where ``fmt`` was measured on this model and device (by an earlier ``auto``) and its perplexity change passes
    :data:`PPL_NOTE_THRESHOLD`, log one INFO line saying so; where a 4-bit format was never measured there, one INFO
    line saying that. Returns the measure, or ``None``. Never measures."""
    measures = cached_measures(measures_path(folder, identity, compile_config), warn=False) or ()
    found = next((m for m in measures if m.format == fmt), None)
    if found is None and fmt.startswith("int4"):
        log.info("%s on this model and device: its perplexity change is not measured yet; 4-bit weights may lose "
                 "much more than %+.0f%% (load_in_low_bit='auto' measures the formats once and keeps within it; "
                 "`xpuspec eval` compares them)", fmt, 100 * DEFAULT_PPL_BOUND)
    if found is not None and found.ppl_delta > PPL_NOTE_THRESHOLD:
        log.info("%s on this model and device: perplexity %+.1f%% vs fp32 (measured; load_in_low_bit='auto' keeps "
                 "within %+.0f%%)", fmt, 100 * found.ppl_delta, 100 * DEFAULT_PPL_BOUND)
    return found
