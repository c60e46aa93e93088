"""Linux futexes on words of a shared mapping, and the one fence the sleep protocol needs.

Sleep protocol (no lost wake-ups, no syscall on the busy path):
    sleeper: v = load(word); store(sleeping flag); fence(); re-check for work; futex_wait(word, v, timeout)
    waker:   publish work; fence(); if load(sleeping flag): store(word, word + 1); futex_wake(word)
Either the sleeper's re-check sees the work, or the waker sees the flag; in the second case the wait either
has not begun (the word no longer equals v, so FUTEX_WAIT returns at once) or is woken. A busy waker whose
peer is awake touches neither the word nor the kernel. The waits are the
shared (not PRIVATE) futex operations because the word is in memory that several processes map.

x86-64 only: its TSO model keeps stores in program order and loads in program order, so "payload, then
sequence number" needs no fence; only the store->load order of the protocol above does. Python has no mfence,
but any locked instruction is a full barrier on x86-64, and acquiring and releasing a `threading.Lock` is two
of them (sem_trywait / sem_post: lock cmpxchg / lock xadd), for ~80 ns.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import threading

from shared.errors import TransportError

_SYS_FUTEX = 202  # x86-64 syscall number
_FUTEX_WAIT = 0
_FUTEX_WAKE = 1
_WAKE_ALL = 0x7FFFFFFF


def check_architecture() -> None:
    """Refuse to run where "stores are seen in program order" does not hold without fences."""
    machine = platform.machine().lower()
    if machine not in ("x86_64", "amd64") or not hasattr(os, "sched_getaffinity"):
        raise TransportError(
            f"shared.cxl needs Linux on x86-64 (TSO memory order, futexes); this is {platform.system()} "
            f"on {machine}: other architectures need explicit fences, which this transport does not issue"
        )


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long
_fence_lock = threading.Lock()


def fence() -> None:
    """A full memory barrier (store->load order) for the sleep protocol; see the module docstring."""
    _fence_lock.acquire()
    _fence_lock.release()


def futex_wait(address: int, expected: int, timeout_s: float) -> bool:
    """Sleep while the u32 at `address` equals `expected`, at most `timeout_s`.

    True when woken or when the word already differed (the caller re-checks its condition either way);
    False on timeout. Releases the GIL while asleep (ctypes does for CDLL calls).
    """
    timeout_s = max(0.0, timeout_s)
    whole_s = int(timeout_s)
    spec = _Timespec(whole_s, int((timeout_s - whole_s) * 1e9))
    rc = _syscall(
        ctypes.c_long(_SYS_FUTEX),
        ctypes.c_void_p(address),
        ctypes.c_int(_FUTEX_WAIT),
        ctypes.c_uint32(expected & 0xFFFFFFFF),
        ctypes.byref(spec),
        None,
        ctypes.c_int(0),
    )
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err == errno.ETIMEDOUT:
        return False
    if err in (errno.EAGAIN, errno.EINTR):
        return True
    raise OSError(err, f"futex wait failed: {os.strerror(err)}")


def futex_wake(address: int, count: int = _WAKE_ALL) -> int:
    """Wake up to `count` sleepers on the u32 at `address`; returns how many woke."""
    rc = _syscall(
        ctypes.c_long(_SYS_FUTEX),
        ctypes.c_void_p(address),
        ctypes.c_int(_FUTEX_WAKE),
        ctypes.c_int(count),
        None,
        None,
        ctypes.c_int(0),
    )
    if rc < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"futex wake failed: {os.strerror(err)}")
    return int(rc)
