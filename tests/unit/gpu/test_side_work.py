"""A forward blocked on a reply runs the calls posted for its thread meanwhile, each exactly once."""

from __future__ import annotations

import concurrent.futures
import threading

import pytest

from gpu.side_work import SideWork


def test_a_blocked_wait_runs_posted_calls_and_returns_the_reply() -> None:
    side = SideWork()
    reply: concurrent.futures.Future[str] = concurrent.futures.Future()
    ran: list[str] = []

    def holder_call() -> str:  # the other engine's reply comes only once this call ran (a circular wait)
        ran.append(threading.current_thread().name)
        reply.set_result("partials")
        return "answered"

    job = side.post(holder_call)
    assert side.wait(reply, timeout_s=5) == "partials"
    assert job.future.result(0) == "answered" and ran == [threading.current_thread().name]
    side.run(job)  # the thread's own turn comes later: the call is not run twice
    assert len(ran) == 1 and side.num_run_waiting == 1


def test_the_threads_own_turn_runs_a_call_no_wait_took() -> None:
    side = SideWork()
    job = side.post(lambda: 1 / 0)
    side.run(job)
    with pytest.raises(ZeroDivisionError):
        job.future.result(0)
    never: concurrent.futures.Future[None] = concurrent.futures.Future()
    with pytest.raises(TimeoutError):  # nothing posted, no reply: the wait ends at its deadline
        side.wait(never, timeout_s=0.05)


def test_a_reply_set_from_another_thread_wakes_the_wait() -> None:
    side = SideWork()
    reply: concurrent.futures.Future[int] = concurrent.futures.Future()
    threading.Timer(0.05, reply.set_result, (7,)).start()
    assert side.wait(reply, timeout_s=5) == 7 and side.num_run_waiting == 0
