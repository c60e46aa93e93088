"""Futexes on a shared mapping: a sleeper wakes on FUTEX_WAKE, returns at once when the word moved, and
times out otherwise."""

from __future__ import annotations

import ctypes
import mmap
import threading
import time
from pathlib import Path

import pytest

from shared.cxl.futex import check_architecture, fence, futex_wait, futex_wake


@pytest.fixture
def shared_page() -> tuple[mmap.mmap, int]:
    page = mmap.mmap(-1, 4096)  # MAP_SHARED | MAP_ANONYMOUS: the non-private futex ops apply
    anchor = ctypes.c_char.from_buffer(page)
    address = ctypes.addressof(anchor)
    del anchor
    return page, address


def _asleep_in_futex(native_id: int) -> bool:
    """Whether the thread is blocked in the kernel's futex wait (not just about to call it)."""
    task = Path(f"/proc/self/task/{native_id}")
    state = (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
    return state == "S" and "futex" in (task / "wchan").read_text()


def test_a_sleeper_wakes_on_wake(shared_page: tuple[mmap.mmap, int]) -> None:
    _, address = shared_page
    results: list[bool] = []
    sleeper = threading.Thread(target=lambda: results.append(futex_wait(address + 64, 0, 10.0)))
    started = time.monotonic()
    sleeper.start()
    assert sleeper.native_id is not None
    deadline = time.monotonic() + 5
    while not _asleep_in_futex(sleeper.native_id):
        assert time.monotonic() < deadline, "the sleeper never blocked"
    assert futex_wake(address + 64) == 1  # the word is unchanged: only the wake can end the sleep
    sleeper.join(5)
    assert results == [True] and time.monotonic() - started < 5


def test_a_moved_word_returns_at_once_and_a_quiet_one_times_out(shared_page: tuple[mmap.mmap, int]) -> None:
    page, address = shared_page
    memoryview(page).cast("I")[128 // 4] = 7
    started = time.monotonic()
    assert futex_wait(address + 128, 6, 5.0) is True  # not the value we expected: no sleep
    assert time.monotonic() - started < 1
    started = time.monotonic()
    assert futex_wait(address + 128, 7, 0.05) is False
    assert 0.04 < time.monotonic() - started < 2
    assert futex_wake(address + 128) == 0
    fence()  # callable anywhere, no effect but ordering
    check_architecture()
