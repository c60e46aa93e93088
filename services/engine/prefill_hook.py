"""The layer hook of one PE prefill step: load the prefix layer by layer, stream computed layers to the DEs,
and the PE's per-request record it works on (`PeRecord`, kept in `seq.kv_state` by the prefill connector).

While tracing is on, each request of the batch gets a `kv.transfer` span (PE -> DE) from the start of the
forward to its last layer's writes being done, with the bytes sent.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gpu.runner import LayerHook, PrefillSeq
from services.engine import metrics
from services.engine.peers import PeerPool
from services.engine.receive_area import Extent, ReceiveArea
from services.engine.scheduler import PrefillChunk
from services.engine.tiered_prefix import PrefixRead, TieredPrefix
from shared import telemetry
from shared.blocks import BlockLayout, blocks_for, full_blocks_view, layer_view
from shared.errors import KvpathError, ProtocolError, TransportError
from shared.protocol import decode
from shared.protocol.tasks import HitStreamFailed, PrefillTask


@dataclass(slots=True)
class PeRecord:
    """The prefill connector's part of one request (`seq.kv_state`)."""

    task: PrefillTask
    staging: int  # offset of this request's Full Blocks in the staging buffer (-1: none: freed, or in line)
    staging_bytes: int = 0  # what it needs there
    num_loaded_blocks: int = 0
    prefix: PrefixRead | None = None  # PE path: storage on this node (read side `pe`), or the pool first
    pull: Extent | None = None  # DE path: where the DE streams the prefix
    num_pulled_layers: int = 0  # layer notices consumed: the DE writes nothing more once all are
    error: KvpathError | None = None
    num_pool_blocks: int = 0  # leading blocks the pool holds (read from it, or written to it)
    pool_commits: list[Awaitable[None]] = field(default_factory=list)

    @property
    def de_id(self) -> str:
        return self.task.de_buffer.engine_id


@dataclass(slots=True)
class PeParts:
    """What a PE's layer hooks work with: the cache, the block layout, the receive area, the peers, and the
    staging buffer KV leaves from."""

    kv: Any
    prefix: TieredPrefix  # the PE path's loads: the pool (read side `pool`), storage below it
    layout: BlockLayout
    area: ReceiveArea
    peers: PeerPool
    staging: np.ndarray
    timeout_s: float

    @property
    def block_size(self) -> int:
        return self.layout.block_size

    @property
    def num_layers(self) -> int:
        return self.layout.num_layers

    def staged(self, record: PeRecord, n_blocks: int) -> np.ndarray:
        return full_blocks_view(self.staging, record.staging, n_blocks, self.layout)


class PrefillHook(LayerHook):
    def __init__(self, conn: PeParts, chunks: Seq[PrefillChunk]) -> None:
        self.conn = conn
        self.items: list[tuple[PrefillChunk, PeRecord]] = [(c, c.seq.kv_state) for c in chunks]
        self.writes: list[tuple[PeRecord, asyncio.Task[int]]] = []
        self.started = time.monotonic()
        self.spans = [_transfer_span(c, r) for c, r in self.items] if telemetry.tracing_enabled() else None

    async def before_layer(self, layer: int, seqs: Seq[PrefillSeq]) -> None:
        for chunk, record in self.items:
            n = chunk.load_tokens // self.conn.block_size
            if not n or record.error is not None:
                continue
            ids = chunk.seq.block_ids[:n]
            if record.prefix is not None:
                if record.task.is_layerwise:
                    self.conn.prefix.import_into(ids, record.prefix, layer)
                elif layer == 0:  # Basic: the whole prefix before compute
                    self.conn.prefix.import_into(ids, record.prefix, None)
            elif record.pull is not None:
                await self._import_pulled(record, ids, layer)

    async def _import_pulled(self, record: PeRecord, ids: list[int], layer: int) -> None:
        assert record.pull is not None
        try:
            meta = await self.conn.area.wait(
                record.pull, layer, timeout_s=self.conn.timeout_s, peer_id=record.de_id
            )
        except KvpathError as exc:
            record.error = exc
            return
        record.num_pulled_layers = layer + 1  # this notice is consumed, whatever it says
        if meta:  # a layer notice carries metadata only when the DE's stream failed
            try:
                reason = decode(meta, HitStreamFailed).error
            except ProtocolError as exc:
                reason = f"malformed notice: {exc.message}"
            record.error = TransportError(f"prefix stream from {record.de_id} failed: {reason}")
            return
        blocks = self.conn.area.blocks(record.pull, 0, len(ids))
        self.conn.kv.import_layer(ids, layer, layer_view(blocks, layer))

    async def after_layer(self, layer: int, seqs: Seq[PrefillSeq]) -> None:
        last = layer == self.conn.num_layers - 1
        for chunk, record in self.items:
            if record.error is None and (record.task.is_layerwise or last):
                self.writes.append((record, asyncio.create_task(self._send(chunk, record, layer))))
        if last:
            sent: dict[int, int] = {}
            for record, write in self.writes:
                try:
                    nbytes = await write
                except KvpathError as exc:
                    record.error = record.error or exc
                else:
                    sent[id(record)] = sent.get(id(record), 0) + nbytes
            metrics.TRANSFER_BYTES.labels("pe_to_de").inc(sum(sent.values()))
            metrics.PREFILL_LAYERS.observe((time.monotonic() - self.started) / self.conn.num_layers)
            if self.spans is not None:
                self._end_spans(sent)

    def _end_spans(self, sent: dict[int, int]) -> None:
        assert self.spans is not None
        for (_, record), span in zip(self.items, self.spans, strict=True):
            error = f"{record.error.code}: {record.error.message}" if record.error is not None else ""
            telemetry.end_span(span, error=error, attributes={"bytes": sent.get(id(record), 0)})

    async def _send(self, chunk: PrefillChunk, record: PeRecord, layer: int) -> int:
        """Layer `layer` (or, for Basic, every layer) of the blocks this chunk touched -> DE buffer."""
        conn, de, bs = self.conn, record.task.de_buffer, self.conn.block_size
        if chunk.load_tokens:  # first chunk: the DE already holds the hits on the DE path
            first = chunk.load_tokens // bs if chunk.seq.plan.kv.read_side in ("de", "hbm") else 0
        else:
            first = chunk.start // bs
        first = max(first, de.num_kept_blocks)  # a session's resident blocks stay where they are (AMPD)
        end = blocks_for(chunk.start + chunk.num_tokens, bs)
        if end <= first:
            return 0
        ids = chunk.seq.block_ids[first:end]
        staged = conn.staged(record, end)[first:end]
        layers = [layer] if record.task.is_layerwise else range(conn.num_layers)
        pieces = []
        for lyr in layers:
            conn.kv.export_layer(ids, lyr, layer_view(staged, lyr))
            base = de.offset + lyr * conn.layout.layer_block_bytes
            pieces += [
                (base + (first + i) * conn.layout.full_block_bytes, staged[i, lyr])
                for i in range(end - first)
            ]
        peer = await conn.peers.get(de, timeout_s=conn.timeout_s)
        await peer.write_many(de.region, pieces, timeout_s=conn.timeout_s)
        return len(pieces) * conn.layout.layer_block_bytes


def _transfer_span(chunk: PrefillChunk, record: PeRecord) -> object:
    trace = chunk.seq.trace
    attributes = {
        "request_id": chunk.seq.request_id,
        "path": "pe_to_de",
        "peer": record.de_id,
        "is_layerwise": record.task.is_layerwise,
        "start_token": chunk.start,
        "num_tokens": chunk.num_tokens,
    }
    return telemetry.start_span("kv.transfer", parent=trace.parent if trace else None, attributes=attributes)
