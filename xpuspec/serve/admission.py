"""Admission: a bounded queue in front of the backend's running places, first come first served.

A request takes a :class:`Ticket` when it arrives (:meth:`Admission.reserve`, which refuses it with
:class:`QueueFull` when every running place and queue place is taken), waits for a running place
(:meth:`Admission.start`), and gives its place back when the backend has finished with it (:meth:`Admission.release`;
a ticket released twice, or before it started, counts once). Used from the event loop's thread only.
"""

import asyncio
import math
from collections import deque
from typing import Deque, Optional

#: Requests that may wait for a running place by default; past that, 429.
DEFAULT_MAX_QUEUE = 64
#: Request bodies past this many MiB get a 413 by default (``--max-body-mib``; :class:`.app.BodyLimit`).
DEFAULT_MAX_BODY_MIB = 8


class QueueFull(Exception):
    """Every running and queue place is taken. ``retry_after``: whole seconds after which a place is likely free."""

    def __init__(self, retry_after: int):
        super().__init__(f"the queue is full; retry after {retry_after} s")
        self.retry_after = retry_after


class Ticket:
    """One request's place: waiting, then running, then released."""

    __slots__ = ("state", "grant")

    def __init__(self):
        self.state = "waiting"
        self.grant: Optional[asyncio.Future] = None


class Admission:
    """Args:
        max_running: requests the backend runs at once.
        max_waiting: requests that may wait for a running place; past that, :class:`QueueFull`.
    """

    #: Weight of the newest request's seconds in the running mean behind ``Retry-After``.
    SMOOTHING = 0.2

    def __init__(self, max_running: int, max_waiting: int):
        if max_running < 1 or max_waiting < 0:
            raise ValueError(f"max_running must be at least 1 and max_waiting at least 0, got {max_running}, "
                             f"{max_waiting}.")
        self.max_running, self.max_waiting = max_running, max_waiting
        self.running = 0
        self.waiting = 0
        self._queue: Deque[Ticket] = deque()
        self.mean_request_s = 1.0  # seconds a request held its running place, smoothed

    def reserve(self) -> Ticket:
        """A ticket in the queue. Raises :class:`QueueFull` when the queue is full."""
        if self.running + self.waiting >= self.max_running + self.max_waiting:
            raise QueueFull(self.retry_after())
        self.waiting += 1
        return Ticket()

    def retry_after(self) -> int:
        """Whole seconds until the queue has likely moved by one place (the mean request time, per running place)."""
        return max(1, math.ceil(self.mean_request_s * (self.waiting + 1) / self.max_running))

    async def start(self, ticket: Ticket) -> None:
        """Wait for a running place, in arrival order. A cancelled wait gives the ticket's place back."""
        if ticket.state != "waiting":
            raise ValueError(f"a {ticket.state} ticket cannot start")
        if self.running < self.max_running and not self._queue:
            self._run(ticket)
            return
        ticket.grant = asyncio.get_running_loop().create_future()
        self._queue.append(ticket)
        try:
            await ticket.grant
        except asyncio.CancelledError:
            if ticket in self._queue:  # a release after the cancel skipped it (below), or none came yet
                self._queue.remove(ticket)
            self.release(ticket)  # granted as it was cancelled: the place passes on
            raise

    def _run(self, ticket: Ticket) -> None:
        self.waiting -= 1
        self.running += 1
        ticket.state = "running"

    def release(self, ticket: Ticket, seconds: Optional[float] = None) -> None:
        """Give the ticket's place back (``seconds``: how long it ran, for ``Retry-After``) and start the next."""
        if ticket.state == "released":
            return
        if ticket.state == "waiting":
            self.waiting -= 1
        else:
            self.running -= 1
            if seconds is not None:
                self.mean_request_s += self.SMOOTHING * (seconds - self.mean_request_s)
        ticket.state = "released"
        while self._queue and self.running < self.max_running:
            nxt = self._queue.popleft()
            if nxt.grant.cancelled():  # its wait was cancelled, and its handler (in start) has not run yet
                continue
            self._run(nxt)
            nxt.grant.set_result(None)
