"""dgr.node.backend_thread: one thread, calls in order, an exception raised at the caller, no abandoned call."""

from __future__ import annotations

import threading
import time

import pytest
import trio

from dgr.errors import CallerError, Reason
from dgr.node.backend_thread import BackendThread


async def test_calls_run_in_one_thread_in_order_and_raise_at_the_caller() -> None:
    seen: list[tuple[int, int]] = []
    with BackendThread() as thread:
        for k in range(5):
            assert await thread.run_sync(lambda k=k: seen.append((k, threading.get_ident())) or k * k) == k * k

        def refuse() -> None:
            raise CallerError(Reason.UNKNOWN_SESSION, "no such session")

        with pytest.raises(CallerError) as raised:
            await thread.run_sync(refuse)
        assert raised.value.reason is Reason.UNKNOWN_SESSION
    assert [k for k, _ in seen] == list(range(5))
    assert {t for _, t in seen} == {thread.ident} and thread.ident != threading.get_ident()


async def test_a_cancelled_caller_waits_for_its_call_to_end() -> None:
    """A backend call is never cut off: the cancel lands once the call has returned."""
    ended: list[float] = []

    def slow() -> None:
        time.sleep(0.05)
        ended.append(time.perf_counter())

    with BackendThread() as thread:
        with trio.move_on_after(0.005) as scope:
            await thread.run_sync(slow)
            assert ended, "the caller went on only once the call had ended"
            await trio.lowlevel.checkpoint()  # where the cancel lands
            pytest.fail("the cancel was lost")
        assert scope.cancelled_caught
        assert await thread.run_sync(lambda: "still serving") == "still serving"


async def test_a_caller_cancelled_before_the_call_makes_none() -> None:
    ran: list[int] = []
    with BackendThread() as thread:
        with trio.CancelScope() as scope:
            scope.cancel()
            await thread.run_sync(lambda: ran.append(1))
        assert await thread.run_sync(lambda: len(ran)) == 0


async def test_the_loop_goes_on_only_once_the_thread_has_taken_the_call() -> None:
    """Both threads need the GIL, and a thread woken while the loop runs Python waits for it: so the loop
    blocks until the thread has taken the call, and the first task it runs after the hand-off finds it
    taken. (A generous `start_wait_s`: the default gives up after 2 ms, which a loaded machine can pass.)"""
    release = threading.Event()
    seen: list[int] = []

    def call() -> None:
        release.wait(5)  # without the GIL, as llama.cpp computes

    with BackendThread(start_wait_s=5.0) as thread:
        calling = trio.Event()

        async def hand_off() -> None:
            calling.set()  # wakes `look`, which runs at this task's first yield: inside run_sync
            await thread.run_sync(call)

        async def look() -> None:
            await calling.wait()
            seen.append(thread.queued)
            release.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(look)
            nursery.start_soon(hand_off)
    assert seen == [0]
