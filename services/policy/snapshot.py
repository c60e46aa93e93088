"""What a placement decision reads and returns: engine, node and request snapshots, placements.

Pure data: no I/O, no asyncio, no torch, no bus. The live router builds a `ClusterSnapshot` from load reports
(`services/router/engines.py`), the simulator from its simulated engines (`loadgen/sim/cluster.py`); both hand
it to the one round function in `services/policy/round.py`.

Units: every load is in tokens (the paper balances on token counts because GPU, disk and network load all
track them). `len_r` is the full prompt length (hit + miss tokens); a node's read queue is the hit tokens
waiting to be read from its storage.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from shared.errors import KvpathError

ROLE_COLOCATED = "colocated"
ROLE_PREFILL = "prefill"
ROLE_DECODE = "decode"
ENGINE_ROLES = (ROLE_COLOCATED, ROLE_PREFILL, ROLE_DECODE)


class ReadSide(StrEnum):
    """Where a request's hit KV is read from storage: the PE's node (PE path) or the DE's node (DE path)."""

    PE = "pe"
    DE = "de"


def _require(ok: bool, what: str) -> None:
    if not ok:
        raise KvpathError(f"inconsistent scheduling snapshot: {what}")


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """One engine as its last load report (plus work sent since) describes it.

    `num_unfinished` is the paper's seq_e, `unfinished_tokens` its tok_e. `free_kv_tokens` is the free HBM of
    a DE in tokens (ignored for PEs: layerwise prefill holds one layer at a time). Engines of one node form
    one group; a group may span nodes (one EP/DP instance).
    """

    engine_id: str
    role: str
    node: int
    group: str
    num_unfinished: int
    unfinished_tokens: int
    free_kv_tokens: int = 0
    is_draining: bool = False

    def __post_init__(self) -> None:
        _require(self.role in ENGINE_ROLES, f"engine {self.engine_id} role {self.role!r}")
        _require(
            min(self.num_unfinished, self.unfinished_tokens, self.free_kv_tokens) >= 0,
            f"engine {self.engine_id} has a negative load field",
        )


@dataclass(frozen=True, slots=True)
class NodeSnapshot:
    """One node's storage side: pending reads (tokens) and whether its storage service answers."""

    node: int
    read_queue_tokens: int
    is_storage_alive: bool = True

    def __post_init__(self) -> None:
        _require(self.read_queue_tokens >= 0, f"node {self.node} read_queue_tokens {self.read_queue_tokens}")


@dataclass(frozen=True, slots=True)
class PendingRequest:
    """A queued request: `prompt_tokens` = len_r, `hit_tokens` stored prefix, `hbm_need_tokens` = prompt +
    expected generation (the DE HBM it will occupy; brief 5.3 [INF])."""

    request_id: str
    prompt_tokens: int
    hit_tokens: int
    hbm_need_tokens: int

    def __post_init__(self) -> None:
        _require(
            0 <= self.hit_tokens <= self.prompt_tokens <= self.hbm_need_tokens,
            f"request {self.request_id}: need 0 <= hit_tokens={self.hit_tokens} <= "
            f"prompt_tokens={self.prompt_tokens} <= hbm_need_tokens={self.hbm_need_tokens}",
        )


@dataclass(frozen=True, slots=True)
class ClusterSnapshot:
    """Everything a placement decision reads: engines, nodes and the global FIFO queue (head first)."""

    engines: tuple[EngineSnapshot, ...]
    nodes: tuple[NodeSnapshot, ...]
    queue: tuple[PendingRequest, ...]

    def __post_init__(self) -> None:
        engine_ids = [e.engine_id for e in self.engines]
        _require(len(set(engine_ids)) == len(engine_ids), "duplicate engine ids")
        node_ids = {n.node for n in self.nodes}
        _require(len(node_ids) == len(self.nodes), "duplicate node ids")
        missing = sorted({e.node for e in self.engines} - node_ids)
        _require(not missing, f"engines on nodes without a node snapshot: {missing}")
        request_ids = [r.request_id for r in self.queue]
        _require(len(set(request_ids)) == len(request_ids), "duplicate request ids in the queue")

    def with_role(self, role: str) -> tuple[EngineSnapshot, ...]:
        return tuple(e for e in self.engines if e.role == role)


@dataclass(frozen=True, slots=True)
class Placement:
    """One placed request. `read_side` None means no storage read: either nothing hit, or neither side's
    storage is alive, and the PE computes the whole prompt. Otherwise `read_tokens` hit tokens are read on
    `read_node`."""

    request_id: str
    pe_id: str
    de_id: str
    read_side: ReadSide | None
    read_node: int | None
    read_tokens: int


@dataclass(frozen=True, slots=True)
class RoundRobinState:
    """Cursor of the `dualpath-rr` policy, passed in and returned: the next PE / DE index (over engines sorted
    by id) and the side the next read goes to."""

    pe_cursor: int = 0
    de_cursor: int = 0
    next_side: ReadSide = ReadSide.PE


@dataclass(frozen=True, slots=True)
class PlacementRound:
    """What one scheduling round decided, in FIFO order, and the round-robin state for the next round."""

    placements: tuple[Placement, ...]
    rr_state: RoundRobinState = field(default_factory=RoundRobinState)
