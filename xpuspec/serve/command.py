"""``xpuspec serve``: its arguments, and the start of the server (model load, then uvicorn).

Importing this module is light (argparse only): the CLI builds its parser from :func:`add_arguments` without the
``[serve]`` extra installed, and :func:`run` says how to install it when it is missing.
"""

import argparse
import logging
import os
import signal
import socket
import sys
from dataclasses import replace

from ..batching import DEFAULT_MAX_BATCH  # requests decoded together when --max-batch is not given
from .admission import DEFAULT_MAX_BODY_MIB, DEFAULT_MAX_QUEUE

log = logging.getLogger("xpuspec.serve")

API_KEY_ENV = "XPUSPEC_API_KEY"
#: Seconds SIGTERM waits for running and queued requests before it cancels them.
DEFAULT_DRAIN_TIMEOUT_S = 60.0


def add_arguments(p: argparse.ArgumentParser, formats, default_format: str) -> None:
    p.add_argument("model", help="a built-in name, a Hugging Face folder or an OpenVINO IR folder")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model name clients give (default: MODEL as written)")
    p.add_argument("--low-bit", default=default_format, choices=tuple(formats) + ("none",),
                   help=f"weight format (default {default_format}; none keeps the source precision)")
    p.add_argument("--device", default=None, help="device (default $XPUSPEC_DEVICE, else auto)")
    p.add_argument("--backend", default=None, help="force a backend: openvino or torch")
    p.add_argument("--speculative", default=None, metavar="MODE",
                   help="self | layer_skip | prompt_lookup | hybrid | suffix | suffix_hybrid | draft (with --draft) | an EAGLE-3 head folder | a "
                        "draft model path or name (default: plain decoding; requests may still ask for "
                        "prompt_lookup_num_tokens)")
    p.add_argument("--suffix-cache", default="private", choices=("private", "shared"),
                   help="suffix modes: private (default) drafts from each request's own text; shared also from "
                        "earlier requests' outputs, which tells by timing whether one user's output resembles "
                        "another's: share only among users who trust each other")
    p.add_argument("--draft", default=None, metavar="M", help="the draft model of --speculative draft or hybrid")
    p.add_argument("--draft-low-bit", default=None, choices=tuple(f for f in formats if f != "auto"),
                   help="draft weight format (self: int4_sym; layer_skip: the target's)")
    p.add_argument("--draft-device", default=None, help="draft device (default $XPUSPEC_DRAFT_DEVICE, else the target's)")
    p.add_argument("--draft-release-after", type=int, default=None, metavar="N",
                   help="release a draft model the policy left out of N requests in a row, until one drafts with it "
                        "(default 4; 0 keeps it loaded)")
    p.add_argument("--max-batch", type=int, default=None, metavar="N",
                   help=f"requests decoded together by continuous batching (default {DEFAULT_MAX_BATCH}; 1: one at a "
                        "time); a backend that decodes one sequence (torch, pipeline stages) runs one at a time")
    p.add_argument("--kv-budget-mib", type=int, default=None, metavar="N",
                   help="KV-cache memory of the batched engine, in MiB (default: no limit); requests whose KV "
                        "blocks do not fit wait")
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="do not reuse the KV blocks of earlier requests' common prompt starts (default: reuse them, "
                        "where the backend keeps a paged KV cache)")
    p.add_argument("--max-queue", type=int, default=DEFAULT_MAX_QUEUE, metavar="N",
                   help=f"requests that may wait for a place to run; past that, HTTP 429 (default {DEFAULT_MAX_QUEUE})")
    p.add_argument("--api-key", default=os.environ.get(API_KEY_ENV), metavar="KEY",
                   help=f"require 'Authorization: Bearer KEY' on every request (default ${API_KEY_ENV})")
    p.add_argument("--max-body-mib", type=float, default=DEFAULT_MAX_BODY_MIB, metavar="N",
                   help=f"request bodies past N MiB get HTTP 413 before more is read (default {DEFAULT_MAX_BODY_MIB})")
    p.add_argument("--max-prompt-chars", type=int, default=None, metavar="N",
                   help="prompts past N characters get HTTP 400 before they are tokenized (default: the model's "
                        "context times its tokenizer's longest token, the most that can fit)")
    p.add_argument("--drain-timeout", type=float, default=DEFAULT_DRAIN_TIMEOUT_S, metavar="S",
                   help=f"on SIGTERM, seconds to finish running and queued requests (default {DEFAULT_DRAIN_TIMEOUT_S:g})")


def _check(args) -> None:
    """Refuse arguments that cannot work, before the model loads.

    Raises:
        ValueError: the reason, and what to do instead.
    """
    if args.max_batch is not None and args.max_batch < 1:
        raise ValueError(f"--max-batch must be at least 1, got {args.max_batch}.")
    if args.kv_budget_mib is not None and args.kv_budget_mib < 1:
        raise ValueError(f"--kv-budget-mib must be at least 1, got {args.kv_budget_mib}.")
    if args.speculative == "draft" and args.draft is None:
        raise ValueError("--speculative draft needs --draft MODEL (a draft model path or name).")
    if args.draft is not None and args.speculative not in (None, "draft", "hybrid", "suffix_hybrid"):
        raise ValueError(f"--draft goes with --speculative draft, hybrid or suffix_hybrid, not {args.speculative}.")
    if args.suffix_cache == "shared" and args.speculative not in ("suffix", "suffix_hybrid"):
        raise ValueError("--suffix-cache shared goes with --speculative suffix or suffix_hybrid.")
    if args.max_queue < 0:
        raise ValueError(f"--max-queue must be 0 or more, got {args.max_queue}.")
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must lie in 1..65535, got {args.port}.")
    if args.max_body_mib <= 0:
        raise ValueError(f"--max-body-mib must be above 0, got {args.max_body_mib:g}.")
    if args.max_prompt_chars is not None and args.max_prompt_chars < 1:
        raise ValueError(f"--max-prompt-chars must be at least 1, got {args.max_prompt_chars}.")
    if args.drain_timeout <= 0:
        raise ValueError(f"--drain-timeout must be above 0 seconds, got {args.drain_timeout}.")
    with socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((args.host, args.port))
        except OSError as exc:
            raise OSError(f"cannot listen on {args.host}:{args.port}: {exc.strerror}; pick another --port or "
                          "--host.") from None


def _speculative(args):
    """The :class:`SpeculativeConfig` of ``--speculative`` and ``--draft`` (``None``: plain decoding; checked by
    :func:`_check`).

    Raises:
        SpeculativeConfigError: an unknown mode.
    """
    from ..speculative.config import resolve_speculative

    options = dict(draft_low_bit=args.draft_low_bit, draft_device=args.draft_device,
                   release_draft_after=args.draft_release_after)
    if args.draft is not None and args.speculative not in ("hybrid", "suffix_hybrid"):  # draft, or --draft alone
        return resolve_speculative(args.draft, **options)
    if args.speculative in ("suffix", "suffix_hybrid"):  # no request drafts from another's unless shared
        options["share_across_requests"] = args.suffix_cache == "shared"
    spec = resolve_speculative(args.speculative, **options)
    return spec if args.draft is None else replace(spec, draft=args.draft)


def _exit_after_drain(signum, frame):
    """SIGTERM's handler outside uvicorn's run: uvicorn drains the requests on SIGTERM, then raises the signal again
    for its previous handler; this one ends the process with status 0 (and stops a model load at once)."""
    raise SystemExit(0)


def _exit_now(signum, frame):
    """SIGTERM's handler once the server has run: uvicorn has drained the requests and raises the signal again for
    its previous handler; this one flushes the logs and ends the process with status 0 at once. Python's own
    teardown would free the models object by object, which took 30 s of the 35 s between SIGTERM and exit with
    --drain-timeout 2 on a loaded 2-core machine (the process holds no file half-written: the cache writes to temp
    names, then renames, and its locks go with the process)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(0)


def run(args) -> int:
    """Load the model and serve it until SIGTERM or Ctrl-C. Returns the exit status (0 after a drain)."""
    _check(args)
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn
    except ImportError as exc:
        raise ImportError(f"xpuspec serve needs the serve extra ({exc.name} is missing): "
                          "pip install 'xpuspec[serve]'") from None

    from ..loading import AutoModelForCausalLM, AutoTokenizer
    from .app import create_app
    from .drain import GRACE_S, DrainingServer
    from .backend import BatchedBackend, SerialBackend

    spec = _speculative(args)
    signal.signal(signal.SIGTERM, _exit_after_drain)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, device=args.device, backend=args.backend,
                                                 load_in_low_bit=None if args.low_bit == "none" else args.low_bit,
                                                 speculative=spec)
    if args.kv_budget_mib is not None:
        if not hasattr(model.runner, "set_kv_budget"):
            raise ValueError(f"--kv-budget-mib: the {model.backend_name} backend keeps no KV block pool; leave it out, "
                             "or serve with --backend openvino.")
        model.runner.set_kv_budget(args.kv_budget_mib * 2**20)
    if not args.no_prefix_cache:
        try:
            model.set_prefix_caching(True)
        except ValueError as exc:
            log.warning("prefix caching is off: %s", exc)
    max_batch = DEFAULT_MAX_BATCH if args.max_batch is None else args.max_batch
    if args.max_batch is not None and max_batch > 1 and not model.can_batch():
        log.warning("--max-batch %d: the %s backend decodes one sequence at a time; requests run one by one "
                    "(serve with --backend openvino for continuous batching)", max_batch, model.backend_name)
    backend = BatchedBackend(model, max_batch) if max_batch > 1 and model.can_batch() else SerialBackend(model)
    backend.warm_up()
    name = args.served_model_name or args.model
    app = create_app(backend, tokenizer, name, api_key=args.api_key, max_queue=args.max_queue,
                     max_body_bytes=int(args.max_body_mib * 2**20),
                     max_prompt_chars=-1 if args.max_prompt_chars is None else args.max_prompt_chars)
    log.info("serving %s on http://%s:%d/v1 (%s engine: %s)", name, args.host, args.port, backend.engine,
             backend.note)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level.lower(),
                            timeout_graceful_shutdown=args.drain_timeout + GRACE_S, access_log=False)
    signal.signal(signal.SIGTERM, _exit_now)
    DrainingServer(config, app.state.server.drain, args.drain_timeout).run()
    return 0
