"""``xpuspec bench``: runs the systems side by side on the same weights, prompts and machine.

Order of a run:

1. Prompts are chosen (:mod:`.prompts`) and tokenized once with the target's tokenizer; every
   system gets the same token ids.
2. Reference: for each weight family in use, its plain greedy output (with top-2 margins) on every
   prompt: transformers fp32 for ``hf*`` systems, xpuspec plain on the target IR for the OpenVINO
   systems. Loading xpuspec there also yields the IR folder every OpenVINO system then runs.
3. Timed runs, each system in its own worker process (:mod:`.worker`), warmed up with one untimed
   call. ``--interleave prompt`` (default) keeps every worker loaded and runs A B C, A B C ... per
   prompt, so drift hits all alike; ``--interleave repeat`` loads one system at a time, fresh each
   repeat (A B C per repeat; for models too large to hold every system in memory at once).
4. The report (:mod:`.report`): table, JSON, plot.
"""

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
from dataclasses import asdict, dataclass, field, replace
from importlib import metadata
from pathlib import Path
from typing import Dict, List, Optional

from ..lowbit import FORMATS
from . import prompts as prompt_sets
from .batch import BATCH_PROMPTS_HELP
from .load import CompetingLoad, load_average
from .memory import check_loaded, memory_mib
from .systems import DEFAULT_KV_CACHE_PRECISION, REFERENCE, SYSTEMS, Setup, parse_systems
from .worker import Worker, WorkerError

DEFAULT_MODEL = "smollm2-135m-instruct"
INTERLEAVE = ("prompt", "repeat")
#: Distributions whose versions a report records.
PACKAGES = ("torch", "transformers", "optimum-intel", "openvino", "openvino-genai", "openvino-tokenizers", "nncf", "numpy")


@dataclass
class BenchSettings:
    """What a run measures (the CLI's options).

    Attributes:
        model, draft: target and optional draft model (built-in name or folder).
        low_bit, draft_low_bit: weight formats of the target IR and of the draft IR.
        systems: system names (see :data:`xpuspec.bench.systems.SYSTEMS`).
        baseline: the system every ratio divides by.
        prompts: the ``--prompts`` spec (see :func:`xpuspec.bench.prompts.parse_prompt_spec`).
        max_new_tokens: tokens generated per call (exactly: EOS is suppressed until then).
        repeats: passes over the prompts.
        interleave: ``"prompt"`` or ``"repeat"``.
        kv_cache_precision: OpenVINO CPU KV cache precision for every OpenVINO system (``None``: each tool's default).
        num_assistant_tokens: draft length k for every speculative system (``None``: each tool's default).
        cost_model: xpuspec's speculation cost model.
        draft_vocab_size: tokens the LM head of xpuspec's draft models scores (``SpeculativeConfig.draft_vocab_size``;
            ``None``: xpuspec's default, 0: the whole vocabulary).
        draft_context_length: context tokens xpuspec's draft models prefill
            (``SpeculativeConfig.draft_context_length``; ``None``: xpuspec's default, 0: the whole context).
        bandwidth: read bandwidth in bytes/s to use instead of measuring it.
        tie_tolerance: top-2 logit margin under which an output divergence counts as a tie.
        competing_load: busy-loop processes run beside the measured systems (:mod:`xpuspec.bench.load`; 0: none).
        head: the EAGLE-3 head folder ``xpuspec-spec:eagle3`` drafts with (``None``: that system cannot run).
        chat: each prompt is a user turn rendered with the target's chat template (as the server renders a chat),
            instead of raw text.
    """

    model: str = DEFAULT_MODEL
    draft: Optional[str] = None
    low_bit: str = "int8_asym"
    draft_low_bit: str = "int4_sym"
    systems: List[str] = field(default_factory=list)
    baseline: Optional[str] = None
    prompts: str = "4"
    max_new_tokens: int = 64
    repeats: int = 3
    interleave: str = "prompt"
    kv_cache_precision: Optional[str] = DEFAULT_KV_CACHE_PRECISION
    num_assistant_tokens: Optional[int] = None
    cost_model: bool = True
    draft_vocab_size: Optional[int] = None
    draft_context_length: Optional[int] = None
    bandwidth: Optional[float] = None
    tie_tolerance: float = 1e-3
    competing_load: int = 0
    head: Optional[str] = None
    chat: bool = False

    def check(self) -> None:
        """Raises ValueError on a bad combination, naming the option."""
        if not self.systems:
            self.systems = parse_systems(None, self.draft is not None, self.head is not None)
        if self.baseline is None:
            self.baseline = "genai" if "genai" in self.systems else self.systems[0]
        if self.baseline not in self.systems:
            raise ValueError(f"--baseline {self.baseline} is not among the systems run: {', '.join(self.systems)}.")
        if self.max_new_tokens < 2:
            raise ValueError("--max-new-tokens must be at least 2 (decode speed excludes the first token).")
        if self.repeats < 1:
            raise ValueError("--repeats must be at least 1.")
        for flag, value, whole in (("--draft-vocab-size", self.draft_vocab_size, "vocabulary"),
                                   ("--draft-context-length", self.draft_context_length, "context")):
            if value is not None and value < 0:
                raise ValueError(f"{flag} must be >= 0 (0: the whole {whole}), not {value}.")
        if self.interleave not in INTERLEAVE:
            raise ValueError(f"--interleave takes {' or '.join(INTERLEAVE)}, not {self.interleave!r}.")
        for flag, name in (("--low-bit", self.low_bit), ("--draft-low-bit", self.draft_low_bit)):
            if name not in FORMATS:
                raise ValueError(f"{flag} takes one of {', '.join(FORMATS)}, not {name!r}.")
        if self.num_assistant_tokens is not None and self.num_assistant_tokens < 1:
            raise ValueError(f"--num-assistant-tokens must be at least 1, not {self.num_assistant_tokens}.")
        if not isinstance(self.competing_load, int) or self.competing_load < 0:
            raise ValueError(f"--competing-load takes a number of busy processes >= 0, not {self.competing_load!r}.")
        if self.bandwidth is not None and not self.bandwidth > 0:
            raise ValueError(f"--bandwidth must be a positive number of GB/s, not {self.bandwidth / 1e9:g}.")
        if self.head is not None:
            from ..errors import ModelSourceError
            from ..speculative.eagle3 import read_head

            try:
                read_head(self.head)
            except ModelSourceError as exc:
                raise ValueError(f"--head {self.head}: {exc}") from None


def _versions() -> dict:
    out = {}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    from .. import __version__

    out["xpuspec"] = __version__
    out["xpuspec_commit"] = _git_commit()
    return out


def _git_commit() -> Optional[str]:
    import subprocess

    root = Path(__file__).resolve().parents[2]
    try:
        done = subprocess.run(["git", "-C", str(root), "describe", "--always", "--dirty"], capture_output=True,
                              text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() or None


def failure(exc: Exception) -> dict:
    """How a failed system is recorded: ``error``, the last line of its traceback (the exception), and
    ``traceback``, the end of the traceback or log."""
    text = str(exc)
    lines = [line for line in text.splitlines() if line.strip()]
    return {"error": lines[-1].strip() if lines else type(exc).__name__, "traceback": text[-3000:]}


def _machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
        flags = next((l for l in Path("/proc/cpuinfo").read_text().splitlines() if l.startswith("flags")), "")
    except OSError:
        flags = ""
    isa = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_tile") if f" {f}" in flags]
    memory = memory_mib()
    return {"cpu": cpu, "cores": os.cpu_count(), "isa": isa, "platform": platform.platform(),
            "python": platform.python_version(), "memory_mib": None if memory is None else round(memory[1])}


class _Progress:
    """tqdm bar over every generate call of the run (reference and timed)."""

    def __init__(self, total: int, enabled: bool):
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total, unit="call", disable=not enabled, file=sys.stderr, dynamic_ncols=True)

    def step(self, what: str) -> None:
        self.bar.set_description(what)
        self.bar.update(1)

    def note(self, what: str) -> None:
        self.bar.set_description(what)


def _source_folders(settings: BenchSettings) -> dict:
    from ..sources import resolve_source

    out = {}
    for key, name in (("hf_path", settings.model), ("draft_hf_path", settings.draft)):
        if name is not None:
            source = resolve_source(name)
            out[key] = str(source.path) if source.kind == "hf" else None
            if key == "hf_path" and settings.head is not None:
                _check_head_fits(settings.head, source.config)
    return out


def _check_head_fits(head: str, config) -> None:
    """Refuse an EAGLE-3 head that does not fit the target before any system starts.

    Raises:
        ValueError: naming ``--head`` and each mismatch.
    """
    from ..errors import DraftMismatchError
    from ..speculative.eagle3 import check_head_for

    try:
        check_head_for(head, config)
    except DraftMismatchError as exc:
        raise ValueError(f"--head {head}: {exc}") from None


def run(settings: BenchSettings, progress: bool = True, log_dir: Optional[Path] = None,
        command: Optional[str] = None, prompts: Optional[Dict[str, List[str]]] = None) -> dict:
    """Run the benchmark and return the report (see ``schema.json``; :func:`xpuspec.bench.report.summarize` has filled
    in ``summary``).

    Args:
        settings: what to measure.
        progress: show a progress bar on stderr.
        log_dir: where the workers' logs go (default: a new temporary folder).
        command: the command line, recorded in the report.
        prompts: ``{set name: texts}`` to use instead of ``settings.prompts`` (tests use short stand-ins).

    A system that fails to load, to warm up or in a timed call is left out and the run goes on: its record in
    ``systems`` holds ``error`` and ``traceback`` instead of figures, and its samples are dropped.

    Raises:
        ValueError: bad settings or prompts.
        WorkerError: the IR reference (xpuspec plain, which gives every OpenVINO system its IR) failed to load or run
            (the message carries its traceback).
        BenchMemoryError: the systems loaded side by side (``--interleave prompt``) leave the machine short of
            memory (:mod:`xpuspec.bench.memory`).
    """
    from ..loading import AutoTokenizer
    from . import report, roofline

    settings.check()
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="xpuspec-bench-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    chosen = prompts or prompt_sets.select(prompt_sets.parse_prompt_spec(settings.prompts))
    tokenizer = AutoTokenizer.from_pretrained(settings.model)
    items = [(name, i, prompt_sets.token_ids(tokenizer, text, settings.chat))
             for name, texts in chosen.items() for i, text in enumerate(texts)]
    families = {SYSTEMS[n].family for n in settings.systems}
    total = len(items) * (len(families) + settings.repeats * len(settings.systems))
    bar = _Progress(total, progress)

    bar.note("measuring read bandwidth")
    measured = settings.bandwidth is None
    bandwidth = roofline.read_bandwidth() if measured else settings.bandwidth

    setup = Setup(model=settings.model, ir="", low_bit=settings.low_bit, draft=settings.draft,
                  draft_low_bit=settings.draft_low_bit, kv_cache_precision=settings.kv_cache_precision,
                  num_assistant_tokens=settings.num_assistant_tokens, cost_model=settings.cost_model,
                  draft_vocab_size=settings.draft_vocab_size, draft_context_length=settings.draft_context_length,
                  head=settings.head, **{"hf_path": None, **_source_folders(settings)})
    shared = settings.interleave == "prompt"
    references, outputs, systems_info = {}, [], {}
    load_start = load_average()

    def spawn(name: str, label: str = "") -> Worker:
        return Worker(name, setup, log_dir / f"{label}{name.replace(':', '-')}.log")

    def fail(name: str, exc: WorkerError, w: Optional[Worker] = None) -> None:
        """Record that ``name`` failed (loading, warming up or in a timed call): its error goes into the report, its
        samples are dropped, and the run goes on with the other systems."""
        if w is not None:
            w.close()
        workers.pop(name, None)
        systems_info[name] = {"family": SYSTEMS[name].family, "speculative": SYSTEMS[name].speculative,
                              **failure(exc)}
        outputs[:] = [(record, tokens) for record, tokens in outputs if record["system"] != name]
        print(f"xpuspec bench: {name} failed, the run goes on without it: {systems_info[name]['error']}",
              file=sys.stderr)

    def warm(name: str, w: Worker) -> Optional[Worker]:
        bar.note(f"loading {name}")
        try:
            w.call("generate", items[0][2], settings.max_new_tokens)  # warm-up, untimed
        except WorkerError as exc:
            fail(name, exc, w)
            return None
        systems_info.setdefault(name, {"family": SYSTEMS[name].family, "speculative": SYSTEMS[name].speculative,
                                       **w.info, "peak_rss_bytes": 0})
        return w

    def finish(name: str, w: Worker) -> None:
        info = systems_info[name]
        info["peak_rss_bytes"] = max(info["peak_rss_bytes"], w.call("peak_rss_bytes"))
        w.close()

    def measure(name: str, w: Worker, repeat: int, set_name: str, i: int, ids: List[int]) -> None:
        memory, load = memory_mib(), load_average()
        try:
            sample = w.call("generate", ids, settings.max_new_tokens)
        except WorkerError as exc:
            fail(name, exc, w)
            return
        record = report.sample_record(name, repeat, set_name, i, len(ids), sample)
        outputs.append(({**record, "memory_available_mib": None if memory is None else round(memory[0]),
                         "load_average": load}, sample.tokens))
        bar.step(f"r{repeat + 1} {name}")

    def running(name: str) -> bool:
        return "error" not in systems_info.get(name, {})

    # Reference systems load first: they give the plain greedy outputs, and xpuspec the IR folder. Every worker of
    # a wave loads at once; in --interleave prompt a reference system that is also measured keeps its worker.
    first = {REFERENCE[f]: spawn(REFERENCE[f], "reference-") for f in sorted(families)}
    draft_ir = None  # the IR xpuspec loads for the draft model (or the target) at the draft's format
    if "genai-spec" in settings.systems:
        draft_ir = Worker("xpuspec", replace(setup, model=settings.draft or settings.model, low_bit=settings.draft_low_bit),
                          log_dir / "draft-ir.log")
    workers = {}
    load = CompetingLoad(settings.competing_load)
    try:
        for family in sorted(families):
            name = REFERENCE[family]
            bar.note(f"reference: loading {name}")
            w = first.pop(name)
            workers[name] = w
            try:
                if family == "ir":
                    setup = replace(setup, ir=w.info["settings"]["ir"])
                for set_name, i, ids in items:
                    references[family, set_name, i] = w.call("reference", ids, settings.max_new_tokens)
                    bar.step(f"reference {name}")
            except WorkerError as exc:  # without its reference no system of the family can be audited
                if family == "ir":  # nor run: the OpenVINO systems run the IR this one gives
                    raise
                for other in settings.systems:
                    if SYSTEMS[other].family == family:
                        fail(other, exc)
                workers.pop(name, None)
                w.close()
                continue
            if not (shared and name in settings.systems):
                workers.pop(name).close()
        if draft_ir is not None:
            with draft_ir:
                setup = replace(setup, draft_ir=draft_ir.info["settings"]["ir"])
        load.start()  # beside the measured systems, from their loading on
        if shared:  # one after another, so that memory running short stops the run before it measures
            for name in filter(running, settings.systems):
                w = warm(name, workers.get(name) or spawn(name))
                if w is not None:
                    workers[name] = w
                    check_loaded(list(workers), memory_mib())
            for repeat in range(settings.repeats):
                for set_name, i, ids in items:
                    for name in filter(running, settings.systems):
                        measure(name, workers[name], repeat, set_name, i, ids)
        else:
            for repeat in range(settings.repeats):
                for name in filter(running, settings.systems):
                    w = warm(name, spawn(name))
                    if w is None:
                        continue
                    workers[name] = w
                    for set_name, i, ids in items:
                        if running(name):
                            measure(name, w, repeat, set_name, i, ids)
                    if running(name):
                        finish(name, workers.pop(name))
        for name in list(workers):
            finish(name, workers.pop(name))
    finally:
        load.stop()
        for w in [*first.values(), *workers.values()] + ([draft_ir] if draft_ir is not None else []):
            w.close()
    bar.bar.close()
    samples = [report.with_audit(record, tokens, references[SYSTEMS[record["system"]].family, record["set"],
                                                           record["prompt"]], settings.tie_tolerance)
               for record, tokens in outputs]

    result = {
        "schema_version": report.SCHEMA_VERSION,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command,
        "settings": asdict(settings),
        "machine": _machine(),
        "versions": _versions(),
        "prompts": prompt_sets.fingerprint(chosen),
        "roofline": {"bandwidth_bytes_per_s": bandwidth, "measured": measured,
                     "method": "best of 7 float32 sums over 512 MiB, one thread per core" if measured else "given"},
        "setup": asdict(setup),
        "systems": systems_info,
        "samples": samples,
        "competing_load": load.record(),
        "load_average": {"start": load_start, "end": load_average()},
    }
    result["summary"] = report.summarize(result)
    return result


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``xpuspec bench`` options."""
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"target model (default {DEFAULT_MODEL})")
    p.add_argument("--draft", default=None, help="draft model for hf-assisted, genai-spec and xpuspec-spec:draft/hybrid "
                                                  "(default: OpenVINO drafts are a low-bit copy of the target)")
    p.add_argument("--head", default=None, metavar="FOLDER",
                   help="EAGLE-3 head (Speculators format, e.g. from `xpuspec train-draft`) for xpuspec-spec:eagle3")
    p.add_argument("--low-bit", default="int8_asym", help="target IR weight format (default int8_asym)")
    p.add_argument("--draft-low-bit", default="int4_sym", help="draft IR weight format (default int4_sym)")
    p.add_argument("--systems", default=None,
                   help=f"comma-separated, from: {', '.join(SYSTEMS)} (default: all that can run)")
    p.add_argument("--baseline", default=None, help="system the ratios divide by (default genai, else the first)")
    p.add_argument("--prompts", default="4", help="sets code,prose,edit; set:N; or N per set (default 4)")
    p.add_argument("--chat", action="store_true",
                   help="each prompt as a user turn in the model's chat template, as the server renders a chat "
                        "(default: raw text)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--interleave", default="prompt", choices=INTERLEAVE,
                   help="prompt: all systems loaded, A B C per prompt (default); repeat: one system loaded at a time")
    p.add_argument("--kv-cache-precision", default=DEFAULT_KV_CACHE_PRECISION,
                   choices=("f32", "f16", "u8", "default"),
                   help="OpenVINO CPU KV cache precision for every OpenVINO system (default f32: exact; "
                        "'default' leaves each tool's own)")
    p.add_argument("--num-assistant-tokens", type=int, default=None,
                   help="draft length k for every speculative system (default: each tool's own)")
    p.add_argument("--no-cost-model", action="store_true", help="turn xpuspec's speculation cost model off")
    p.add_argument("--draft-vocab-size", type=int, default=None, metavar="N",
                   help="xpuspec's draft models score only the N most frequent tokens (0: the whole vocabulary; "
                        "default: xpuspec's own, 32768 for vocabularies of 65536 or more)")
    p.add_argument("--draft-context-length", type=int, default=None, metavar="N",
                   help="xpuspec's draft models prefill only the last N context tokens (0: the whole context; "
                        "default: xpuspec's own, 64)")
    p.add_argument("--bandwidth", type=float, default=None, metavar="GB/S",
                   help="read bandwidth in GB/s for the roofline, instead of measuring it")
    p.add_argument("--json", default=None, metavar="FILE", help="write the report as JSON")
    p.add_argument("--plot", default=None, metavar="PNG", help="draw tokens/s and acceptance against speed-up")
    p.add_argument("--compare", nargs=2, default=None, metavar=("A.json", "B.json"),
                   help="compare two reports instead of running")
    p.add_argument("--competing-load", type=int, default=0, metavar="N",
                   help="run N busy-loop processes, one per core, beside the measured systems (default 0)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--batch-size", default=None, metavar="B,B,...",
                   help="run the batched bench instead: xpuspec's engine beside openvino_genai's continuous batching "
                        "at these batch sizes, e.g. 1,4,8 (--systems then names batched systems)")
    p.add_argument("--rounds", type=int, default=1, help="with --batch-size: run the systems in turn this many times")
    p.add_argument("--batch-prompts", default=None, metavar="SETS", help="with --batch-size: " + BATCH_PROMPTS_HELP)


def check_output_file(option: str, path: Optional[str]) -> Optional[Path]:
    """``path`` (given as ``option``) expanded, or ``None``; checked before a run, so that a bad path does not
    throw the run away at its end.

    Raises:
        ValueError: the path is a folder, or lies in a folder that does not exist or cannot be written.
    """
    if path is None:
        return None
    path = Path(path).expanduser()
    if path.is_dir() or not path.resolve().parent.is_dir():
        raise ValueError(f"{option} {path}: a folder, or in a folder that does not exist; name a file in an "
                         "existing folder.")
    if not os.access(path.resolve().parent, os.W_OK):
        raise ValueError(f"{option} {path}: its folder cannot be written; name a file in a folder you can write.")
    return path


def _batched(args: argparse.Namespace) -> int:
    """``xpuspec bench --batch-size``: the batched bench (:mod:`xpuspec.bench.batch`) on the shared options."""
    from . import batch

    if args.plot or args.competing_load or args.chat:
        raise ValueError("--plot, --competing-load and --chat do not apply with --batch-size; leave them out.")
    json_path = check_output_file("--json", args.json)
    results = batch.sweep(args)  # checks the batch sizes, systems and rounds before it runs anything
    print(batch.table(results))
    if json_path is not None:
        json_path.write_text(json.dumps(results, indent=2))
    return 0 if results else 1


def main(args: argparse.Namespace) -> int:
    """Run ``xpuspec bench`` from parsed arguments: print the table, write JSON and plot if asked."""
    from . import report

    if args.compare:
        a, b = (report.load(path) for path in args.compare)
        print(report.compare(a, b))
        return 0
    if args.batch_size is not None:
        return _batched(args)
    if args.batch_prompts is not None:
        raise ValueError("--batch-prompts chooses the rows of the batched bench: add --batch-size, or give the "
                         "single-request bench its prompts with --prompts.")
    settings = BenchSettings(
        model=args.model, draft=args.draft, low_bit=args.low_bit.lower(), draft_low_bit=args.draft_low_bit.lower(),
        systems=parse_systems(args.systems, args.draft is not None, args.head is not None), baseline=args.baseline,
        prompts=args.prompts, head=args.head, chat=args.chat,
        max_new_tokens=args.max_new_tokens, repeats=args.repeats, interleave=args.interleave,
        kv_cache_precision=None if args.kv_cache_precision == "default" else args.kv_cache_precision,
        num_assistant_tokens=args.num_assistant_tokens, cost_model=not args.no_cost_model,
        draft_vocab_size=args.draft_vocab_size, draft_context_length=args.draft_context_length,
        bandwidth=None if args.bandwidth is None else args.bandwidth * 1e9, competing_load=args.competing_load)
    json_path, plot_path = check_output_file("--json", args.json), check_output_file("--plot", args.plot)
    result = run(settings, progress=not args.no_progress, command=" ".join(["xpuspec"] + sys.argv[1:]))
    print(report.markdown(result))  # before the check, so that a report the schema refuses still shows its figures
    report.validate(result)
    if json_path is not None:
        json_path.write_text(json.dumps(result, indent=1))
    if plot_path is not None:
        report.plot(result, plot_path)
    broken = report.failed(result)
    if broken:  # the others' figures are printed and written; the exit status says that the run is not whole
        print(f"error: {len(broken)} system(s) failed and are left out of the figures: "
              + "; ".join(f"{name}: {error}" for name, error in broken.items()), file=sys.stderr)
        return 1
    return 0
