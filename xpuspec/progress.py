"""Verbosity and progress bars: one tqdm bar per long phase (pull, convert, measure the formats, compress, compile),
and the libraries' own output (NNCF's tables and bars, transformers' warnings and bars, optimum's export warnings,
OpenVINO's logs) kept out of sight unless asked for.

:func:`set_verbosity` sets the level the command line's ``-v`` gives:

- ``QUIET`` (0, the ``xpuspec`` command's default): each :func:`phase` shows one bar; inside it, records below
  WARNING of every logger (xpuspec's own included), Python warnings, transformers' progress bars, NNCF's log and
  whatever the libraries print to stdout and stderr (NNCF's rich bar and tables, other tqdm bars) are dropped;
  logging handlers made before keep the real stderr, so warnings and errors still show. A phase inside another shows no
  bar of its own: the outer bar stands for both.
- ``VERBOSE`` (1, ``-v``; the library's default): the bars, and everything the libraries print.

Errors always show.
"""

import contextlib
import functools
import logging
import os
import sys
import threading
import warnings
from typing import Callable, Iterator, Optional

QUIET, VERBOSE = 0, 1
_state = threading.local()
_verbosity = VERBOSE


def set_verbosity(level: int) -> None:
    """Set the process-wide verbosity (:data:`QUIET` or :data:`VERBOSE`; higher is :data:`VERBOSE`)."""
    global _verbosity
    if isinstance(level, bool) or not isinstance(level, int) or level < 0:
        raise ValueError(f"verbosity is an integer >= 0 (0: quiet, 1: verbose), got {level!r}")
    _verbosity = level


def verbosity() -> int:
    """The process-wide verbosity (:func:`set_verbosity`)."""
    return _verbosity


@functools.lru_cache(maxsize=None)
def _devnull():
    """The stand-in stdout of :func:`quiet_libraries`, open for the life of the process (a library may keep it)."""
    return open(os.devnull, "w")


class _Silent:
    """A stand-in for a bar inside another phase: takes the calls, shows nothing."""

    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, text: str = "", refresh: bool = True) -> None:
        pass


@contextlib.contextmanager
def quiet_libraries() -> Iterator[None]:
    """At :data:`QUIET`, drop the libraries' output inside the block (module doc); at :data:`VERBOSE`, nothing."""
    if _verbosity > QUIET:
        yield
        return
    from transformers.utils import logging as hf_logging

    nncf_logger = logging.getLogger("nncf")
    hf_level, hf_bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    nncf_level, disabled = nncf_logger.level, logging.root.manager.disable
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    nncf_logger.setLevel(logging.ERROR)
    logging.disable(logging.INFO)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(_devnull()), contextlib.redirect_stderr(_devnull()):
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(disabled)
        for handler in nncf_logger.handlers:  # NNCF imported inside the block: its handler took the stand-in stdout
            if isinstance(handler, logging.StreamHandler) and handler.stream is _devnull():
                handler.setStream(sys.stdout)
        nncf_logger.setLevel(nncf_level)
        hf_logging.set_verbosity(hf_level)
        if hf_bars:
            hf_logging.enable_progress_bar()


@contextlib.contextmanager
def phase(description: str, total: int = 1, unit: str = "step"):
    """A long phase: one tqdm bar on stderr of ``total`` steps (the caller calls ``update``), and at :data:`QUIET`
    the libraries' output dropped inside it (:func:`quiet_libraries`). Inside another phase: no bar (a stand-in
    that takes the same calls). Yields the bar."""
    from tqdm.auto import tqdm

    outer = getattr(_state, "depth", 0)
    _state.depth = outer + 1
    try:
        if outer:
            with quiet_libraries():
                yield _Silent()
            return
        with tqdm(total=total, desc=description, unit=unit, file=sys.stderr, leave=True,  # the real stderr
                  bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}{postfix}]"
                  ) as bar, quiet_libraries():
            yield bar
    finally:
        _state.depth = outer


def in_phase() -> bool:
    """Whether a :func:`phase` is running in this thread."""
    return getattr(_state, "depth", 0) > 0


def minutes_text(seconds: Optional[float]) -> str:
    """``seconds`` as a rough duration for a message: "about 40 s", "about 3 min"."""
    if seconds is None:
        return "a few minutes"
    if seconds < 90:
        return f"about {max(10, round(seconds, -1)):.0f} s"
    return f"about {round(seconds / 60):.0f} min"


def in_a_phase(describe: Callable[..., str]):
    """Decorator: the function runs as one :func:`phase` of one step, described by ``describe(*args, **kwargs)``."""
    def wrap(function):
        @functools.wraps(function)
        def run(*args, **kwargs):
            with phase(describe(*args, **kwargs)) as bar:
                result = function(*args, **kwargs)
                bar.update(1)
            return result
        return run
    return wrap
