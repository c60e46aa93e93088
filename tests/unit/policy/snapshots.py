"""Builders for hand-made scheduling snapshots (short names keep the rule tests readable)."""

from __future__ import annotations

from services.policy.snapshot import (
    ROLE_DECODE,
    ROLE_PREFILL,
    ClusterSnapshot,
    EngineSnapshot,
    NodeSnapshot,
    PendingRequest,
)
from services.policy.thresholds import Thresholds

BIG_HBM = 10**9


def pe(engine_id: str, node: int, tok: int, *, seq: int = 0, is_draining: bool = False) -> EngineSnapshot:
    return EngineSnapshot(engine_id, ROLE_PREFILL, node, f"p{node}", seq, tok, 0, is_draining)


def de(
    engine_id: str,
    node: int,
    tok: int,
    *,
    free: int = BIG_HBM,
    seq: int = 0,
    group: str | None = None,
    is_draining: bool = False,
) -> EngineSnapshot:
    return EngineSnapshot(engine_id, ROLE_DECODE, node, group or f"d{node}", seq, tok, free, is_draining)


def node(number: int, read_q: int = 0, *, is_alive: bool = True) -> NodeSnapshot:
    return NodeSnapshot(number, read_q, is_alive)


def req(request_id: str, length: int, *, hit: int = 0, hbm: int | None = None) -> PendingRequest:
    return PendingRequest(request_id, length, hit, length if hbm is None else hbm)


def snap(
    engines: list[EngineSnapshot], nodes: list[NodeSnapshot], queue: list[PendingRequest]
) -> ClusterSnapshot:
    return ClusterSnapshot(tuple(engines), tuple(nodes), tuple(queue))


def limits(alpha: float = 100, beta: float = 1000, z: float = 1.05) -> Thresholds:
    return Thresholds(alpha_tokens=alpha, beta_tokens=beta, z_factor=z)
