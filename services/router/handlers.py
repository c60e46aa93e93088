"""Bus handlers of the router (thin: decode, hand to the core). Hot path: token batches."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from nats.aio.msg import Msg

from services.router.core import RouterCore
from shared import telemetry
from shared.errors import ProtocolError
from shared.protocol import LoadReport, TokenBatch, decode

log = logging.getLogger(__name__)


def token_batch_handler(core: RouterCore) -> Callable[[Msg], Awaitable[None]]:
    async def on_tokens(msg: Msg) -> None:
        try:
            batch = decode(msg.data, TokenBatch)
        except ProtocolError as exc:
            telemetry.BUS_ERRORS.labels("malformed").inc()
            log.warning("malformed token batch subject=%s: %s", msg.subject, exc.message)
            return
        core.on_token_batch(batch)

    return on_tokens


def load_report_handler(core: RouterCore) -> Callable[[Msg], Awaitable[None]]:
    async def on_load(msg: Msg) -> None:
        try:
            report = decode(msg.data, LoadReport)
        except ProtocolError as exc:
            telemetry.BUS_ERRORS.labels("malformed").inc()
            log.warning("malformed load report subject=%s: %s", msg.subject, exc.message)
            return
        core.on_load_report(report)

    return on_load
