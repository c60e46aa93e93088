"""Requests whose router is gone for good: aborted.

A router that dies and does not come back under its id (a Kubernetes pod rescheduled under a new name, a
replica lost) leaves its requests on the engines with no client to read them, and nothing aborts them: each
decodes to its `max_tokens`, holding KV and a batch slot. (A router back under its id aborts them itself,
`services/router/orphans.py`.) Every `registry_ttl_s` the engine looks up each router its requests stream
to in the registry, whose entries the nats-server expires `registry_ttl_s` after their last heartbeat (its
clock, not the engine's: no skew between hosts matters). A router missing at MISSES_TO_ABORT looks in a row
has its requests aborted; a look that fails (the bus is down) proves nothing either way.
"""

from __future__ import annotations

import asyncio
import logging

import nats.js.errors

from services.engine import metrics
from services.engine.core import EngineCore
from shared.bus import Registry
from shared.protocol import ServiceInfo

log = logging.getLogger(__name__)

MISSES_TO_ABORT = 3  # a registry recreated by a restarted nats-server is refilled within one heartbeat


class RouterWatch:
    def __init__(self, registry: Registry[ServiceInfo], core: EngineCore, period_s: float) -> None:
        self.registry = registry
        self.core = core
        self.period_s = period_s
        self._misses: dict[str, int] = {}  # router id -> looks in a row that did not find it

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.period_s)
            await self.check()

    async def check(self) -> int:
        """Look up the routers of the engine's requests; abort those of a router gone; return how many."""
        routers = {seq.plan.router_id for seq in self.core.seqs.values()}
        self._misses = {r: n for r, n in self._misses.items() if r in routers}
        aborted = 0
        for router_id in sorted(routers):
            present = await self._present(router_id)
            if present is None:
                continue
            if present:
                self._misses.pop(router_id, None)
                continue
            self._misses[router_id] = self._misses.get(router_id, 0) + 1
            if self._misses[router_id] >= MISSES_TO_ABORT:
                aborted += self._abort(router_id)
        return aborted

    async def _present(self, router_id: str) -> bool | None:
        """Whether the registry lists the router (None: the registry did not answer)."""
        try:
            entry = await asyncio.wait_for(self.registry.kv.get(router_id), self.period_s)
        except nats.js.errors.KeyNotFoundError:  # expired, deleted (a clean stop), or never there
            return False
        except Exception:
            return None
        return bool(entry.value)

    def _abort(self, router_id: str) -> int:
        ids = [rid for rid, seq in self.core.seqs.items() if seq.plan.router_id == router_id]
        for request_id in ids:
            self.core.abort(request_id, "its router is gone")
        if ids:
            metrics.ROUTER_GONE_ABORTS.inc(len(ids))
            log.warning("router %s is gone (not in the registry): aborted %d requests", router_id, len(ids))
        return len(ids)
