"""Requests the engines still run for this router that it does not know: aborted.

A router restarted under its id (`kvpath up` restarts a dead one; a Kubernetes pod keeps its name) receives
the token deltas of the requests its previous process sent out. Their clients went with that process, yet
the engines would decode each to its `max_tokens`, holding KV and batch slots the new process's requests
need. A delta that no stream open or recently closed here takes, and that does not finish its request, names
such an orphan; the router aborts it, again if it is still heard of `REPEAT_S` later.
"""

from __future__ import annotations

import logging

from services.router import metrics
from services.router.dispatch import publish_abort
from shared.bus import Bus

log = logging.getLogger(__name__)

REPEAT_S = 5.0  # an orphan still heard of this long after its abort is aborted again (an abort NATS lost)
MAX_KEPT = 4096  # aborted ids remembered; past this, those older than REPEAT_S are forgotten


class OrphanAborts:
    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self._aborted_at: dict[str, float] = {}  # request id -> when it was last aborted (monotonic)

    async def abort(self, request_ids: set[str], now: float) -> int:
        """Abort the requests not aborted within REPEAT_S; return how many aborts went out."""
        due = [rid for rid in request_ids if now - self._aborted_at.get(rid, -REPEAT_S) >= REPEAT_S]
        for request_id in due:
            self._aborted_at[request_id] = now
            await publish_abort(self.bus, request_id, "its router does not know it (restarted, or closed it)")
        if len(self._aborted_at) > MAX_KEPT:
            self._aborted_at = {rid: at for rid, at in self._aborted_at.items() if now - at < REPEAT_S}
        if due:
            metrics.ORPHANS_ABORTED.inc(len(due))
            log.info("aborted requests engines run for this router, unknown here: %s", " ".join(due[:8]))
        return len(due)
