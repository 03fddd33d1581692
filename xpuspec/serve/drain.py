"""SIGTERM's drain: running and queued requests get ``--drain-timeout`` seconds to finish, then are cancelled.

uvicorn stops accepting connections on SIGTERM and waits for the open ones; :class:`DrainingServer` first starts a
:class:`Drain`. During the drain a new request gets a 503. At the deadline every request still open is aborted
(:meth:`.session.RequestRun.abort`): its generation is cancelled in the model (its ``on_tokens`` returns ``False``,
which ends it at its next token), a streaming client gets an error event and ``data: [DONE]``, a waiting one a 503,
and the connections close, so that uvicorn never has to cancel a task (which logged a ``CancelledError`` traceback
per stream, while the worker threads went on generating to ``max_tokens``).
"""

import asyncio
import logging
from typing import Optional, Set

import uvicorn

from .protocol import APIError

log = logging.getLogger("xpuspec.serve")

#: Seconds uvicorn waits past the drain deadline for the aborted requests' connections before it cancels them.
GRACE_S = 2.0


def shutting_down(what: str) -> APIError:
    """The 503 of a request the drain ended, or refused (``what``: the situation, for the message)."""
    return APIError(503, f"The server is shutting down: {what}. Retry with another server, or after it restarts.",
                    type="server_error", code="server_shutting_down")


class Drain:
    """The requests in flight (:class:`.session.RequestRun`), and the drain that ends them. Used on the event loop."""

    def __init__(self):
        self.runs: Set = set()
        self.draining = False
        self._timer: Optional[asyncio.TimerHandle] = None

    def begin(self, timeout_s: float) -> None:
        """Refuse new requests from now, and abort those still open after ``timeout_s`` seconds."""
        if self.draining:
            return
        self.draining = True
        log.info("draining %d requests (at most %g s)", len(self.runs), timeout_s)
        self._timer = asyncio.get_running_loop().call_later(timeout_s, self.abort_all)

    def abort_all(self) -> None:
        """Abort every request still open: cancelled in the model, its client told (a 503 or an error event)."""
        runs = list(self.runs)
        if runs:
            log.warning("drain timeout: cancelling %d open requests", len(runs))
        for run in runs:
            run.abort(shutting_down("its drain timeout passed before this request finished"))

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()


class DrainingServer(uvicorn.Server):
    """uvicorn's server, whose SIGTERM (and Ctrl-C) shutdown first starts ``drain`` with ``timeout_s``; uvicorn's
    own graceful timeout (``config.timeout_graceful_shutdown``) should be ``timeout_s + GRACE_S``, a backstop."""

    def __init__(self, config: uvicorn.Config, drain: Drain, timeout_s: float):
        super().__init__(config)
        self.drain, self.timeout_s = drain, timeout_s

    async def shutdown(self, sockets=None) -> None:
        self.drain.begin(self.timeout_s)
        await super().shutdown(sockets=sockets)
