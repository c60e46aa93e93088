"""A request that finds no engine waits, for a while, for one to come back.

An engine that restarts (`kvpath up`'s supervision, a Kubernetes pod, a rolling update of the only replica
of a role) is out for as long as its model takes to load. A request that finds no engine then would get a
503 at once, and a stream migrating off the engine would end with its loss. While an engine that is out now
was heard within `RouterConfig.engine_return_wait_s`, the request instead waits for an engine to report
(a new one, a restarted one, one back from silence) and is dispatched again, within its deadline; past
that window it is the 503 it was. With no engine ever heard, nothing waits.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping

from services.router import metrics
from services.router.dispatch import TIMER_SLACK_S, Dispatch, fresh_plan
from services.router.streams import StreamTable
from shared.errors import NoEngineAvailableError
from shared.protocol import RequestPlan

log = logging.getLogger(__name__)


async def dispatch_or_wait(
    dispatch: Dispatch, plan: RequestPlan, deadline: float, streams: StreamTable, locality: Mapping[str, int]
) -> dict[str, float]:
    """`dispatch.dispatch(...)`; a `NoEngineAvailableError` while an engine may come back waits for one to
    report and dispatches again (each time from the plan as it was: a dispatch rewrites its KV part)."""
    first = fresh_plan(plan)
    waited = False
    while True:
        try:
            return await dispatch.dispatch(plan, deadline, streams, locality)
        except NoEngineAvailableError:
            now = time.monotonic()
            left = min(dispatch.engines.return_window(now), deadline - TIMER_SLACK_S - now)
            if left <= 0:
                raise
            if not waited:
                waited = True
                metrics.ENGINE_RETURN_WAITS.inc()
                log.info(
                    "no engine for request_id=%s: waiting up to %.1f s for one to return",
                    plan.request_id,
                    left,
                )
            if not await dispatch.engines.engine_returned(left):
                raise
        plan = fresh_plan(first)
