"""Streams of a stored or resident prefix into a prefill engine's receive area, for the prefix-pull protocol
(`PullHits`): DualPath's DE read path (`decode_connector.py`) and a session engine's kept history
(`session_remote.py`).

The prefix goes layer by layer, each layer's notice with its last write; the PE waits for layer l's notice
before layer l computes. A stream that fails notices every layer it did not send as failed
(`HitStreamFailed`), so the PE stops waiting at once and recomputes the prefix.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from services.engine import metrics
from services.engine.connector_context import ConnectorContext
from services.engine.receive_area import tag
from shared import telemetry
from shared.blocks import BlockLayout
from shared.errors import KvpathError
from shared.protocol import encode
from shared.protocol.tasks import BufferRef, HitStreamFailed
from shared.transport import Peer

log = logging.getLogger(__name__)

# writes one layer of the prefix: (the PE's peer, layer, the layer's offset in the PE's extent)
WriteLayer = Callable[[Peer, int, int], Awaitable[None]]


class PeStreams:
    def __init__(self, ctx: ConnectorContext, layout: BlockLayout) -> None:
        self.peers = ctx.peers
        self.num_layers = ctx.num_layers
        self.timeout_s = ctx.transfer_timeout_s
        self.layout = layout

    async def send(
        self,
        request_id: str,
        pe: BufferRef,
        num_blocks: int,
        write_layer: WriteLayer,
        *,
        path: str,
        what: str,
    ) -> None:
        """Stream `num_blocks` blocks into `pe`, `write_layer` per layer (it sends the layer's notice with
        its last write), in a `kv.transfer` span while tracing is on. `path` labels the transfer metric
        (`de_to_pe`, `hbm_to_pe`), `what` the log line. A failure is handled here, never raised."""
        if not telemetry.tracing_enabled():
            return await self._send(pe, num_blocks, write_layer, path, what)
        attributes = {
            "request_id": request_id,
            "path": path,
            "peer": pe.engine_id,
            "num_blocks": num_blocks,
            "bytes": num_blocks * self.layout.full_block_bytes,
        }
        with telemetry.span("kv.transfer", attributes=attributes):
            return await self._send(pe, num_blocks, write_layer, path, what)

    async def _send(self, pe: BufferRef, n: int, write_layer: WriteLayer, path: str, what: str) -> None:
        layer = 0
        try:
            peer = await self.peers.get(pe, timeout_s=self.timeout_s)
            for layer in range(self.num_layers):
                await write_layer(peer, layer, pe.offset + layer * self.layout.layer_block_bytes)
            metrics.TRANSFER_BYTES.labels(path).inc(n * self.layout.full_block_bytes)
        except KvpathError as exc:
            log.warning("%s stream to %s failed at layer %d: %s", what, pe.engine_id, layer, exc.message)
            telemetry.set_current_error(f"failed at layer {layer}: {exc.message}")
            await self._fail(pe, layer, exc.message)

    async def _fail(self, pe: BufferRef, from_layer: int, reason: str) -> None:
        meta = encode(HitStreamFailed(error=reason))
        try:
            peer = await self.peers.get(pe, timeout_s=self.timeout_s)
            for layer in range(from_layer, self.num_layers):
                await peer.notify(pe.region, tag(pe.slot, layer), meta, timeout_s=self.timeout_s)
        except KvpathError:
            pass  # the PE is gone or its waits time out
