"""The server's admission queue (xpuspec.serve.admission): places pass on in arrival order, and a wait cancelled
while a place frees up neither takes the place nor breaks the release that frees it."""

import asyncio

import pytest

from xpuspec.serve.admission import Admission, QueueFull


def run(coroutine):
    return asyncio.run(coroutine)


def test_places_pass_on_in_arrival_order_and_a_full_queue_is_refused():
    async def scenario():
        admission = Admission(max_running=1, max_waiting=2)
        first = admission.reserve()
        await admission.start(first)
        waiting = [admission.reserve(), admission.reserve()]
        with pytest.raises(QueueFull):
            admission.reserve()
        tasks = [asyncio.ensure_future(admission.start(t)) for t in waiting]
        await asyncio.sleep(0)
        admission.release(first, seconds=3.0)
        await tasks[0]
        assert [t.state for t in waiting] == ["running", "waiting"] and not tasks[1].done()
        admission.release(waiting[0])
        await tasks[1]
        admission.release(waiting[1])
        return admission

    admission = run(scenario())
    assert (admission.running, admission.waiting) == (0, 0)


def test_a_wait_cancelled_just_before_a_place_frees_leaves_the_place_to_the_next():
    """The drain cancels a waiting request, and a running one ends before the cancelled wait's handler runs (CI saw
    this as an InvalidStateError traceback in the server's log): the place goes to the request behind it."""
    async def scenario():
        admission = Admission(max_running=1, max_waiting=4)
        running = admission.reserve()
        await admission.start(running)
        cancelled, behind = admission.reserve(), admission.reserve()
        first_wait = asyncio.ensure_future(admission.start(cancelled))
        second_wait = asyncio.ensure_future(admission.start(behind))
        await asyncio.sleep(0)
        first_wait.cancel()  # its handler runs on the loop's next turn
        admission.release(running)  # before that turn
        with pytest.raises(asyncio.CancelledError):
            await first_wait
        await second_wait
        assert (cancelled.state, behind.state) == ("released", "running")
        assert (admission.running, admission.waiting) == (1, 0)
        admission.release(behind)
        return admission

    admission = run(scenario())
    assert (admission.running, admission.waiting) == (0, 0)
