"""The pool's request handler: every op round-trips through its byte encoding; bad requests are answered."""

from __future__ import annotations

import numpy as np

from services.cxlpool.block_table import NO_SLOT, BlockTable
from services.cxlpool.core import PoolCore
from shared.cxl import pool_ops as ops
from shared.cxl.pool_ops import Op, PoolStatus
from shared.protocol import decode
from shared.protocol.kv import PoolInfo

INFO = PoolInfo(
    pool_id="p",
    epoch=1,
    fingerprint="fp",
    block_size=64,
    slot_bytes=1024,
    num_slots=8,
    num_devices=2,
    interleave_bytes=2048,
    device_paths=["/dev/shm/a", "/dev/shm/b"],
)


def core() -> tuple[PoolCore, list[int]]:
    wakes: list[int] = []
    pool = PoolCore(
        BlockTable(8), INFO, default_lease_ms=1000, on_change=lambda: wakes.append(1), clock_ns=lambda: 0
    )
    return pool, wakes


def ok(pool: PoolCore, owner: str, op: Op, payload: bytes) -> bytes:
    status, reply = pool.handle(owner, op, payload)
    assert status == PoolStatus.OK, reply
    return reply


def test_write_then_read_through_the_byte_protocol() -> None:
    pool, wakes = core()
    hashes, parents = [11, 12, 13], [5, 11, 12]
    slots = ops.decode_slots(ok(pool, "w", Op.ALLOC, ops.encode_alloc(hashes, parents, lease_ms=0)))
    assert sorted(slots) == [0, 1, 2]
    commit = ops.encode_commit(hashes[:2], [101, 102])
    assert ops.decode_generations(ok(pool, "w", Op.COMMIT, commit)) == [1, 2]
    assert ops.decode_generations(ok(pool, "w", Op.COMMIT, commit)) == [0, 0]  # committed once
    change = pool.take_changes()
    assert [(c.stored, c.parents) for c in change] == [((11, 12), (5, 11))] and wakes
    reply = ops.decode_lookup_reply(
        ok(pool, "r", Op.LOOKUP, ops.encode_lookup(hashes, pin=True, lease_ms=500))
    )
    assert reply.slots == slots[:2] and reply.checksums == [101, 102] and reply.generations == [1, 2]
    assert reply.lease_id > 0
    assert ok(pool, "other", Op.UNPIN, ops.encode_lease(reply.lease_id)) == b"\x00"  # not its lease
    assert ok(pool, "r", Op.UNPIN, ops.encode_lease(reply.lease_id)) == b"\x01"
    again = ops.decode_slots(ok(pool, "w2", Op.ALLOC, ops.encode_alloc(hashes, parents, lease_ms=0)))
    assert again == [NO_SLOT, NO_SLOT, NO_SLOT]
    assert ops.decode_count(ok(pool, "w", Op.FREE, ops.encode_hashes([13]))) == 1
    assert decode(ok(pool, "x", Op.INFO, b""), PoolInfo) == INFO


def test_bad_requests_are_answered_and_the_pool_keeps_serving() -> None:
    pool, _ = core()
    good = ops.encode_lookup([1, 2], pin=False, lease_ms=0)
    for op, payload in [
        (Op.LOOKUP, good[:-3]),  # truncated
        (Op.LOOKUP, good + b"\x00"),  # trailing bytes
        (Op.ALLOC, ops.encode_alloc([1], [2], lease_ms=0)[:-8]),
        (Op.COMMIT, b"\x01"),
        (Op.UNPIN, b"\x00" * 3),
        (Op.LOOKUP, ops.encode_lookup(np.arange(ops.MAX_HASHES + 1), pin=False, lease_ms=0)),
        (Op.LOOKUP, ops.encode_lookup([1], pin=True, lease_ms=10**9)),  # a lease beyond the limit
    ]:
        status, reply = pool.handle("c", op, payload)
        assert status == PoolStatus.BAD_REQUEST and reply, (op, payload[:16])
    status, reply = pool.handle("c", 99, b"")
    assert status == PoolStatus.UNKNOWN_OP and b"99" in reply
    assert ops.decode_lookup_reply(ok(pool, "c", Op.LOOKUP, good)).slots == []


def test_a_dead_clients_leases_and_allocations_are_released() -> None:
    pool, _ = core()
    ok(pool, "w", Op.ALLOC, ops.encode_alloc([1, 2], [0, 1], lease_ms=0))
    ok(pool, "w", Op.COMMIT, ops.encode_commit([1], [9]))
    ok(pool, "dead", Op.LOOKUP, ops.encode_lookup([1], pin=True, lease_ms=0))
    ok(pool, "dead", Op.ALLOC, ops.encode_alloc([3], [0], lease_ms=0))
    pool.release_owner("dead")
    stats = pool.table.snapshot_stats()
    assert (stats.num_pinned, stats.num_allocated, stats.num_committed) == (0, 1, 1)  # "w" still writes 2


def test_the_largest_lookup_and_its_reply_fit_the_default_rpc_slot() -> None:
    from services.cxlpool.config import PoolConfig

    n = ops.MAX_HASHES
    reply = ops.encode_lookup_reply(1, list(range(n)), [2**64 - 1] * n, [2**63] * n)
    request = ops.encode_lookup(list(range(n)), pin=True, lease_ms=1)
    assert max(len(reply), len(request)) <= PoolConfig().rpc_payload_bytes
    assert ops.decode_lookup_reply(reply).generations == [2**63] * n
