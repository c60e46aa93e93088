"""Bus handlers of an engine (thin: the bus decodes and validates, the core decides, the handler answers).

Task handlers run with the request id bound for logs and the router's trace context current, so the tasks
they start (prefix fetch, DE-side read) log and trace as part of the request.

A task's ack may be lost (a nats-server restart, an engine stalled past the router's ack timeout); a router
that sees this engine report again sends the same task once more (`Dispatch.send_task`). The engine keeps
the acks of the last tasks it took and answers such a repeat with the same ack, without running it twice.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable

from services.engine.core import EngineCore
from shared import logs, telemetry
from shared.bus import MsgContext
from shared.errors import InvalidRequestError
from shared.protocol import Abort, TaskAck, TokenBatch, TokenResend
from shared.protocol.tasks import PullHits, PullHitsReply, Task

log = logging.getLogger(__name__)

TAKEN_ACKS = 4096  # the acks of the last this many tasks taken are kept for repeats


class EngineHandlers:
    def __init__(self, core: EngineCore, on_admitted: Callable[[], None]) -> None:
        self.core = core
        self.on_admitted = on_admitted  # the engine's load changed: report it now
        self._taken: OrderedDict[str, tuple[str, TaskAck]] = OrderedDict()  # request id -> (task kind, ack)

    async def task(self, task: Task, ctx: MsgContext) -> TaskAck:
        taken = self._taken.get(task.request_id)
        if taken is not None and taken[0] == task.KIND:
            log.info("task taken already request_id=%s: its ack was lost, acked again", task.request_id)
            return taken[1]
        parent = ctx.trace_parent
        with logs.request_context(task.request_id), telemetry.attached(parent):
            ack = self.core.submit(task, trace_parent=parent)
            prompt_tokens = task.plan.num_prompt_tokens
            if ack.accepted:
                log.debug("task accepted request_id=%s prompt_tokens=%d", task.request_id, prompt_tokens)
            else:
                log.debug("task refused request_id=%s code=%s", task.request_id, ack.code)
        if ack.accepted:
            self._taken[task.request_id] = (task.KIND, ack)
            if len(self._taken) > TAKEN_ACKS:
                self._taken.popitem(last=False)
            self.on_admitted()
        return ack

    async def pull(self, msg: PullHits, ctx: MsgContext) -> PullHitsReply:
        with logs.request_context(msg.request_id), telemetry.span("kv.pull", parent=ctx.trace_parent) as span:
            if span is not None:
                span.set_attribute("request_id", msg.request_id)
            seq = self.core.seqs.get(msg.request_id)
            if seq is None:
                raise InvalidRequestError(f"no request {msg.request_id} on this engine", param="request_id")
            return await self.core.connector.serve_pull(seq, msg)

    async def abort(self, msg: Abort, ctx: MsgContext) -> None:
        self.core.abort(msg.request_id, msg.reason or "abort")

    async def resend(self, msg: TokenResend, ctx: MsgContext) -> TokenBatch:
        """The deltas of a request the router is missing (a token batch NATS lost), as they were sent."""
        deltas = self.core.outbox.resend(msg.request_id, msg.from_seq)
        return TokenBatch(engine_id=self.core.outbox.engine_id, step=self.core.step_count, deltas=deltas)
