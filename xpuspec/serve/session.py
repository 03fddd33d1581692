"""One request on its way from the event loop through the backend's worker thread and back.

:class:`RequestRun` waits for a running place (:mod:`.admission`), runs :meth:`.backend.SerialBackend.run` on a
worker thread, turns the new tokens into text there (:class:`xpuspec.detokenize.IncrementalDetokenizer`) and cuts it
at the request's stop strings (:class:`xpuspec.stopping.StopStringMatcher`), so that generation ends at the very token
that completes one. The text goes back to the event loop as :class:`Text` events, and the end as :class:`Done` or
:class:`Failed`. The event loop never waits on the model: it only awaits these events.
"""

import asyncio
import threading
import time
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import AsyncIterator, Callable, List, Optional, Sequence, Union

from ..detokenize import IncrementalDetokenizer
from ..stopping import StopStringMatcher
from .admission import Admission, Ticket
from .backend import Finished, GenerationParams
from .metrics import ServerMetrics
from .protocol import finish_reason


@dataclass(frozen=True)
class Text:
    """Text of new tokens, safe to send (never part of a stop string)."""

    text: str


@dataclass(frozen=True)
class Done:
    """The request ended. ``finish_reason``: OpenAI's (``stop``, ``length``)."""

    finished: Finished
    finish_reason: str


@dataclass(frozen=True)
class Failed:
    """The backend raised ``error``."""

    error: BaseException


Event = Union[Text, Done, Failed]


class RequestRun:
    """One request's run.

    Args:
        backend: the serving backend (:class:`.backend.SerialBackend`).
        executor: worker threads, as many as the backend's ``max_running``.
        admission, ticket: the request's place in the queue (taken by :meth:`Admission.reserve`).
        metrics: counted into when the request ends (also when its client has gone).
        tokenizer: decodes the new tokens.
        prompt_ids, params, stop: the request.
        arrival: ``time.perf_counter()`` when it arrived (time to first token counts from there).
        on_close: called once when the run is closed (the server's registry of open runs forgets it).
    """

    def __init__(self, backend, executor: Executor, admission: Admission, ticket: Ticket, metrics: ServerMetrics,
                 tokenizer, prompt_ids: Sequence[int], params: GenerationParams, stop: Sequence[str],
                 arrival: float, on_close: Optional[Callable[["RequestRun"], None]] = None):
        self.backend, self.executor, self.admission, self.ticket = backend, executor, admission, ticket
        self.metrics = metrics
        self.prompt_ids, self.params = list(prompt_ids), params
        self._detokenizer = IncrementalDetokenizer(tokenizer)
        self._matcher = StopStringMatcher(stop)
        self.arrival = arrival
        self.cancelled = threading.Event()  # read by the worker thread: the client has gone
        self._gone = asyncio.Event()  # the same, for the event loop
        self._events: asyncio.Queue = asyncio.Queue()
        self._loop = asyncio.get_running_loop()
        self._last_token: Optional[float] = None
        self._started = False
        self._run_s: Optional[float] = None
        self._aborted: Optional[BaseException] = None
        self._on_close = on_close

    # -- event loop side
    def cancel(self) -> None:
        """The client has gone: stop waiting, or end generation at the next token."""
        self.cancelled.set()
        self._gone.set()

    def abort(self, error: BaseException) -> None:
        """End the run with ``error`` (the server shuts down): its generation is cancelled at the next token, and
        :meth:`events` gives the text already made, then ``Failed(error)`` (also while it waits for a place)."""
        if self._aborted is not None:
            return
        self._aborted = error
        self.cancel()
        self._events.put_nowait(Failed(error))

    def close(self) -> None:
        """Release everything this run holds, whatever state it is in (idempotent)."""
        self.cancel()
        if not self._started:
            self.admission.release(self.ticket)
        if self._on_close is not None:
            on_close, self._on_close = self._on_close, None
            on_close(self)

    async def events(self) -> AsyncIterator[Event]:
        """Text as it comes, then :class:`Done` or :class:`Failed`. Ends early, without either, if the run is
        cancelled while it waits for a running place (with ``Failed`` if it was aborted)."""
        if not await self._wait_for_place():
            if self._aborted is not None:
                yield Failed(self._aborted)
            return
        self._started = True
        future = self._loop.run_in_executor(self.executor, self._work)
        future.add_done_callback(lambda _: self.admission.release(self.ticket, self._run_s))
        while True:
            event = await self._events.get()
            while isinstance(event, Text) and not self._events.empty():  # send what has piled up as one chunk
                following = self._events.get_nowait()
                if not isinstance(following, Text):
                    yield event
                    event = following
                    break
                event = Text(event.text + following.text)
            yield event
            if not isinstance(event, Text):
                return

    async def _wait_for_place(self) -> bool:
        start = asyncio.ensure_future(self.admission.start(self.ticket))
        gone = asyncio.ensure_future(self._gone.wait())
        try:
            await asyncio.wait({start, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not start.done():
                start.cancel()  # its handler gives the place back
                await asyncio.gather(start, return_exceptions=True)
        if self.ticket.state != "running":
            return False
        if self.cancelled.is_set():  # cancelled as its place came: give it to the next request
            self.admission.release(self.ticket)
            return False
        return True

    def _send(self, event: Event) -> None:
        self._loop.call_soon_threadsafe(self._events.put_nowait, event)

    # -- worker thread side
    def _on_tokens(self, ids: List[int]) -> bool:
        now = time.perf_counter()
        if self._last_token is None:
            self.metrics.first_token(now - self.arrival)
        else:
            self.metrics.between_tokens(now - self._last_token)
        self._last_token = now
        if self.cancelled.is_set():
            return False
        check = self._matcher.feed(self._detokenizer.add(ids))
        if check.text:
            self._send(Text(check.text))
        return not check.stopped

    def _work(self) -> None:
        t0 = time.perf_counter()
        try:
            finished = self.backend.run(self.prompt_ids, self.params, self._on_tokens)
            if not self._matcher.stopped:  # the end of the text: held back until now
                tail = self._matcher.feed(self._detokenizer.flush()).text + self._matcher.flush()
                if tail:
                    self._send(Text(tail))
            reason = finish_reason(finished, self._matcher.stopped)
            self.metrics.finished(finished, "abort" if self.cancelled.is_set() else reason)
            self._send(Done(finished, reason))
        except Exception as exc:  # noqa: BLE001 - one request's failure goes to its client, the server stays up
            self._send(Failed(exc))
        finally:
            self._run_s = time.perf_counter() - t0
