"""Completion notices on the receiver side: who waits for which (region, tag), what arrived early, and
which peers are gone (sync bookkeeping; the receiver's async `wait` wraps it with a deadline).

Rules:
- a notice is keyed by (region name, tag); at most one is held and at most one waiter exists per key;
  a second notice for a held key is refused (tags are reused only after the notice was consumed);
- notices nobody waits for yet are held, at most `max_pending`; beyond that senders get OverloadedError;
- a waiter that names the peer expected to write fails as soon as that peer has no live connection;
- an op that was cut off mid-transfer fails its own (region, tag) even for waiters that named no peer;
- unregistering a region fails its waiters and drops what it held.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass, field

from shared.errors import KvpathError, OverloadedError, TransportError

Key = tuple[str, int]
_MAX_REMEMBERED_PEERS = 1024


@dataclass(slots=True, frozen=True)
class Notice:
    """Completion notice: bytes of the notifying op are visible in `region` when the receiver sees it."""

    region: str
    tag: int
    meta: bytes = b""
    peer_id: str = ""  # sender_id of the connection that posted it
    nbytes: int = 0  # payload bytes of the op that carried the notice (0 for a bare notify)


@dataclass(slots=True)
class _Waiter:
    future: asyncio.Future[Notice]
    peer_id: str | None


@dataclass(slots=True)
class NoticeBoard:
    max_pending: int
    _pending: dict[Key, Notice] = field(default_factory=dict)
    _failed: OrderedDict[Key, KvpathError] = field(default_factory=OrderedDict)
    _waiters: dict[Key, _Waiter] = field(default_factory=dict)

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    @property
    def num_waiters(self) -> int:
        return len(self._waiters)

    def post(self, notice: Notice) -> None:
        """Hand the notice to its waiter or hold it; raise (to the sender) when it cannot be held."""
        key = (notice.region, notice.tag)
        waiter = self._waiters.pop(key, None)
        if waiter is not None and not waiter.future.done():
            waiter.future.set_result(notice)
            return
        if key in self._pending:
            raise TransportError(
                f"notice (region {notice.region!r}, tag {notice.tag}) is already pending: "
                "a tag may be reused only after its notice was consumed",
                param="tag",
            )
        if len(self._pending) >= self.max_pending:
            raise OverloadedError(f"receiver holds {len(self._pending)} unconsumed notices; retry later")
        self._failed.pop(key, None)
        self._pending[key] = notice

    def take(self, region: str, tag: int) -> Notice | None:
        """The held notice for the key (consumed), None if none; raise a recorded failure instead."""
        key = (region, tag)
        failure = self._failed.pop(key, None)
        if failure is not None:
            raise failure
        return self._pending.pop(key, None)

    def restore(self, notice: Notice) -> None:
        """Put back a notice taken by a waiter that was cancelled before it could return it."""
        self._pending.setdefault((notice.region, notice.tag), notice)

    def add_waiter(self, region: str, tag: int, peer_id: str | None) -> asyncio.Future[Notice]:
        key = (region, tag)
        if key in self._waiters:
            raise TransportError(
                f"someone already waits for notice (region {region!r}, tag {tag})", param="tag"
            )
        future: asyncio.Future[Notice] = asyncio.get_running_loop().create_future()
        self._waiters[key] = _Waiter(future, peer_id)
        return future

    def remove_waiter(self, region: str, tag: int, future: asyncio.Future[Notice]) -> None:
        waiter = self._waiters.get((region, tag))
        if waiter is not None and waiter.future is future:
            del self._waiters[(region, tag)]

    def fail_peer(self, peer_id: str, error: KvpathError) -> int:
        """Fail every waiter that named `peer_id`; returns how many."""
        keys = [k for k, w in self._waiters.items() if w.peer_id == peer_id]
        for key in keys:
            self._fail_waiter(key, error)
        return len(keys)

    def fail_key(self, region: str, tag: int, error: KvpathError) -> None:
        """The op that would have posted this key broke: fail its waiter, or remember for a later wait."""
        key = (region, tag)
        if key in self._waiters:
            self._fail_waiter(key, error)
            return
        if key in self._pending:
            return
        self._failed[key] = error
        while len(self._failed) > self.max_pending:
            self._failed.popitem(last=False)

    def fail_region(self, region: str, error: KvpathError) -> None:
        for key in [k for k in self._waiters if k[0] == region]:
            self._fail_waiter(key, error)
        self.discard(region)

    def fail_all(self, error: KvpathError) -> None:
        for key in list(self._waiters):
            self._fail_waiter(key, error)
        self._pending.clear()
        self._failed.clear()

    def discard(self, region: str, tags: list[int] | None = None) -> int:
        """Drop held notices (and failures) of a region, or of some of its tags; returns notices dropped."""
        keys = [k for k in self._pending if k[0] == region and (tags is None or k[1] in tags)]
        for key in keys:
            del self._pending[key]
        for key in [k for k in self._failed if k[0] == region and (tags is None or k[1] in tags)]:
            del self._failed[key]
        return len(keys)

    def _fail_waiter(self, key: Key, error: KvpathError) -> None:
        waiter = self._waiters.pop(key)
        if not waiter.future.done():
            waiter.future.set_exception(error)


@dataclass(slots=True)
class PeerTable:
    """Live control connections per sender id, and why the last one of a gone peer ended."""

    _live: dict[str, int] = field(default_factory=dict)
    _gone: OrderedDict[str, str] = field(default_factory=OrderedDict)
    _rejoin: dict[str, asyncio.Event] = field(default_factory=dict)  # waits for a gone peer to connect again

    def connected(self, peer_id: str) -> None:
        self._live[peer_id] = self._live.get(peer_id, 0) + 1
        self._gone.pop(peer_id, None)
        rejoined = self._rejoin.pop(peer_id, None)
        if rejoined is not None:
            rejoined.set()

    async def rejoined(self, peer_id: str, timeout_s: float) -> bool:
        """Whether a gone peer connects again within `timeout_s` (a new process under the same id, e.g. a
        restarted engine, connects when it first sends)."""
        if peer_id in self._live:
            return True
        event = self._rejoin.setdefault(peer_id, asyncio.Event())
        try:
            await asyncio.wait_for(event.wait(), timeout_s)
        except TimeoutError:
            return peer_id in self._live
        return True

    def disconnected(self, peer_id: str, reason: str) -> bool:
        """Count one connection down; True when the peer has none left."""
        count = self._live.get(peer_id, 0) - 1
        if count > 0:
            self._live[peer_id] = count
            return False
        self._live.pop(peer_id, None)
        self._gone[peer_id] = reason
        while len(self._gone) > _MAX_REMEMBERED_PEERS:
            self._gone.popitem(last=False)
        return True

    def gone_reason(self, peer_id: str) -> str | None:
        """Why the peer's last connection ended, if it had one and has none now."""
        return self._gone.get(peer_id)

    def live(self) -> list[str]:
        return sorted(self._live)
