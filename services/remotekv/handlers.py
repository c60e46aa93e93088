"""Bus handlers of the remote KV store: check ranges (the bus checked the schema), call the slot table, reply.

PUT, COMMIT and EXIST are metadata only (µs, run inline). A GET pins the longest committed prefix of its keys,
writes those super blocks into the engine's region (`ChunkWriter`, one op) and answers once the bytes are
there; the pins keep eviction from reusing the slots while they are read.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from services.remotekv import metrics
from services.remotekv.chunk_writer import ChunkWriter
from services.remotekv.config import RemoteKvConfig
from services.remotekv.slot_table import SlotTable
from shared import logs
from shared.bus import MsgContext
from shared.errors import InvalidRequestError, KvpathError
from shared.protocol.kv import (
    RemoteKvCommit,
    RemoteKvCommitReply,
    RemoteKvExist,
    RemoteKvExistReply,
    RemoteKvGet,
    RemoteKvGetReply,
    RemoteKvInfo,
    RemoteKvInfoRequest,
    RemoteKvPut,
    RemoteKvPutReply,
)

log = logging.getLogger(__name__)

_U64_MAX = (1 << 64) - 1


@dataclass(slots=True)
class StoreIdentity:
    """What the store announces of itself in info replies."""

    store_id: str
    epoch: int
    region: str
    endpoint: dict[str, Any]


class RemoteKvHandlers:
    """Takes the slot table (the core), the region's bytes, the GET writer, the limits, and a callback for
    load changes."""

    def __init__(
        self,
        table: SlotTable,
        region: np.ndarray,
        writer: ChunkWriter,
        identity: StoreIdentity,
        config: RemoteKvConfig,
        on_load_change: Callable[[], None],
    ) -> None:
        self.table = table
        self.region = region
        self.writer = writer
        self.identity = identity
        self.config = config
        self.on_load_change = on_load_change
        self.num_gets_in_flight = 0
        self.is_idle = asyncio.Event()  # no GET writing out (drain waits for it)
        self.is_idle.set()

    # ------------------------------------------------------------------------------------------ ops

    async def info(self, msg: RemoteKvInfoRequest, ctx: MsgContext) -> RemoteKvInfo:
        t, ident = self.table, self.identity
        metrics.REQUESTS.labels("info", "ok").inc()
        return RemoteKvInfo(
            store_id=ident.store_id,
            epoch=ident.epoch,
            region=ident.region,
            endpoint=ident.endpoint,
            chunk_tokens=self.config.chunk_tokens,
            capacity_bytes=t.capacity_bytes,
            chunk_bytes=t.chunk_bytes,
            fingerprint=t.fingerprint,
            used_bytes=t.used_bytes,
            num_chunks=t.num_committed,
        )

    async def put(self, msg: RemoteKvPut, ctx: MsgContext) -> RemoteKvPutReply:
        with _op("put", msg.request_id):
            self._check_keys(msg.keys)
            self._check_format(msg.fingerprint, msg.chunk_tokens, msg.chunk_bytes)
            self._check_timeout(msg.timeout_s)
            self.table.adopt(msg.fingerprint, msg.chunk_bytes)
            result = self.table.reserve(msg.keys, now_s=time.monotonic(), ttl_s=msg.timeout_s)
        for outcome in ("ok", "exists", "full"):
            metrics.CHUNKS.labels("put", outcome).inc(result.outcomes.count(outcome))
        metrics.EVICTIONS.inc(len(result.evicted_keys))
        self.on_load_change()
        return RemoteKvPutReply(
            epoch=self.identity.epoch, put_id=result.put_id, offsets=result.offsets, outcomes=result.outcomes
        )

    async def commit(self, msg: RemoteKvCommit, ctx: MsgContext) -> RemoteKvCommitReply:
        with _op("commit"):
            self._check_keys(msg.keys)
            if msg.put_id < 0:
                raise InvalidRequestError(f"put_id must be >= 0, got {msg.put_id}", param="put_id")
            if msg.checksums and len(msg.checksums) != len(msg.keys):
                raise InvalidRequestError(
                    f"{len(msg.checksums)} checksums for {len(msg.keys)} keys", param="checksums"
                )
            if msg.checksums and (min(msg.checksums) < 0 or max(msg.checksums) > _U64_MAX):
                raise InvalidRequestError("checksums are unsigned 64-bit", param="checksums")
            committed, released = self.table.commit(msg.put_id, msg.keys, msg.checksums)
        metrics.CHUNKS.labels("commit", "committed").inc(committed)
        metrics.CHUNKS.labels("commit", "released").inc(released)
        metrics.COMMITTED_BYTES.inc(committed * self.table.chunk_bytes)
        self.on_load_change()
        return RemoteKvCommitReply(num_committed=committed, num_released=released)

    async def exist(self, msg: RemoteKvExist, ctx: MsgContext) -> RemoteKvExistReply:
        with _op("exist"):
            self._check_keys(msg.keys)
            exists = self.table.exists(msg.keys)
        prefix = exists.index(False) if False in exists else len(exists)
        return RemoteKvExistReply(epoch=self.identity.epoch, exists=exists, num_prefix_chunks=prefix)

    async def get(self, msg: RemoteKvGet, ctx: MsgContext) -> RemoteKvGetReply:
        with _op("get", msg.request_id):
            self._check_get(msg)
            if not self.table.holds_format(msg.fingerprint, msg.chunk_bytes):
                metrics.CHUNKS.labels("get", "miss").inc(len(msg.keys))
                reason = "foreign" if self.table.chunk_bytes else "missing"
                exists = [False] * len(msg.keys)
                return RemoteKvGetReply(
                    epoch=self.identity.epoch, num_hit_chunks=0, miss_reason=reason, exists=exists
                )
            exists = self.table.exists(msg.keys)
            offsets = self.table.pin_prefix(msg.keys)
            checksums = self.table.checksums(msg.keys[: len(offsets)])
            self.num_gets_in_flight += 1
            self.is_idle.clear()
            try:
                await self._write_out(msg, offsets)
            finally:
                self.num_gets_in_flight -= 1
                if not self.num_gets_in_flight:
                    self.is_idle.set()
                self.table.unpin(msg.keys[: len(offsets)])
        hit = len(offsets)
        metrics.CHUNKS.labels("get", "hit").inc(hit)
        metrics.CHUNKS.labels("get", "miss").inc(len(msg.keys) - hit)
        return RemoteKvGetReply(
            epoch=self.identity.epoch,
            num_hit_chunks=hit,
            miss_reason="" if hit == len(msg.keys) else "missing",
            exists=exists,
            checksums=checksums,
        )

    async def _write_out(self, msg: RemoteKvGet, offsets: list[int]) -> None:
        if not offsets:
            return
        size = self.table.chunk_bytes
        pieces = [(msg.target.offsets[i], self.region[off : off + size]) for i, off in enumerate(offsets)]
        await self.writer.write(msg.target, pieces, timeout_s=msg.timeout_s)
        metrics.READ_BYTES.inc(len(offsets) * size)

    # ------------------------------------------------------------------------------------ checks

    def _check_keys(self, keys: list[int]) -> None:
        limit = self.config.max_keys_per_request
        if len(keys) > limit:
            raise InvalidRequestError(f"at most {limit} keys per request, got {len(keys)}", param="keys")
        if keys and (min(keys) < 0 or max(keys) > _U64_MAX):
            raise InvalidRequestError("keys are unsigned 64-bit block hashes", param="keys")

    def _check_format(self, fingerprint: str, chunk_tokens: int, chunk_bytes: int) -> None:
        if not fingerprint:
            raise InvalidRequestError("fingerprint must not be empty", param="fingerprint")
        if chunk_tokens != self.config.chunk_tokens:
            raise InvalidRequestError(
                f"this store holds super blocks of {self.config.chunk_tokens} tokens, got {chunk_tokens}",
                param="chunk_tokens",
            )
        if not 0 < chunk_bytes <= self.table.capacity_bytes:
            raise InvalidRequestError(
                f"chunk_bytes must be in 1..{self.table.capacity_bytes}, got {chunk_bytes}",
                param="chunk_bytes",
            )

    def _check_timeout(self, timeout_s: float) -> None:
        if not 0 < timeout_s <= self.config.max_timeout_s:
            raise InvalidRequestError(
                f"timeout_s must be in (0, {self.config.max_timeout_s}], got {timeout_s}", param="timeout_s"
            )

    def _check_get(self, msg: RemoteKvGet) -> None:
        self._check_keys(msg.keys)
        self._check_format(msg.fingerprint, msg.chunk_tokens, msg.chunk_bytes)
        self._check_timeout(msg.timeout_s)
        offsets = msg.target.offsets
        if len(offsets) != len(msg.keys):
            raise InvalidRequestError(
                f"target names {len(offsets)} offsets for {len(msg.keys)} keys", param="offsets"
            )
        if offsets and min(offsets) < 0:
            raise InvalidRequestError("target offsets must be >= 0", param="offsets")


@contextlib.contextmanager
def _op(op: str, request_id: str = "") -> Iterator[None]:
    """Count one request by outcome (ok, or the error code), time it, bind its request id for logs."""
    started = time.perf_counter()
    outcome = "internal_error"
    try:
        with logs.request_context(request_id):
            yield
        outcome = "ok"
    except KvpathError as exc:
        outcome = exc.code
        log.info("remotekv %s refused: %s", op, exc.message)
        raise
    except asyncio.CancelledError:
        outcome = "cancelled"
        raise
    finally:
        metrics.REQUESTS.labels(op, outcome).inc()
        metrics.REQUEST_SECONDS.labels(op).observe(time.perf_counter() - started)
