"""The router's load table, updated in place between placement rounds (`load_sync.py`), equals one built from
scratch out of the same reports (`LoadTable.of(*cluster_snapshot())`) and decides the same placements, after
any sequence of load reports, notes of placed work, joins, leaves, moves, refusals and silences."""

from __future__ import annotations

import random
from typing import Any

import pytest

from services.policy.load_table import LoadTable
from services.policy.round import RoundState, place_table_round
from services.policy.snapshot import ROLE_DECODE, ROLE_PREFILL, PendingRequest
from services.policy.thresholds import Thresholds
from services.router.engines import ROLE_STORAGE, EngineTable
from shared.protocol import KvFormat, LoadReport
from tests.reference_placement import POLICIES

FMT = KvFormat(fingerprint="tiny;dtype=float32;block_size=64", block_size=64, bytes_per_token=4096)
OTHER = KvFormat(fingerprint="tiny;dtype=bfloat16;block_size=64", block_size=64, bytes_per_token=2048)
TIMEOUT_S = 10.0


def canonical(table: LoadTable) -> dict[str, Any]:
    """What a round can read from a table, independent of the order of its rows."""
    ids = table.engine_ids
    return {
        "engines": {e.engine_id: e for e in table.engines()},
        "nodes": {n.node: n for n in table.node_snapshots()},
        "groups": {group: sorted(ids[row] for row in rows) for group, rows in table.decode_groups.items()},
        "group_tokens": dict(table.decode_group_tokens),
        "pe_by_tokens": sorted(
            (table.unfinished_tokens[r], ids[r]) for r in table.prefill_rows_at_most(1e18)
        ),
        "has_live": (table.has_live(ROLE_PREFILL), table.has_live(ROLE_DECODE)),
        "rings": [[ids[r] for r in table.rows_by_id(role)] for role in (ROLE_PREFILL, ROLE_DECODE)],
        "decode_room": [table.has_decode_room(kv) for kv in (0, 1000, 10_000, 100_000)],
    }


class Cluster:
    """Services reporting to an `EngineTable`, driven at random."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.engines = EngineTable(silence_timeout_s=TIMEOUT_S)
        self.now = 1000.0
        self.seq: dict[str, int] = {}
        self.where: dict[str, tuple[str, int]] = {}  # service -> (role, node) it reports as
        for n in range(8):
            self.join(f"p{n}", ROLE_PREFILL, n % 3)
            self.join(f"d{n}", ROLE_DECODE, 3 + n % 3)
        for node in range(6):
            self.join(f"s{node}", ROLE_STORAGE, node)

    def join(self, sid: str, role: str, node: int) -> None:
        self.where[sid] = (role, node)
        self.report(sid)

    def report(self, sid: str, *, kv_format: KvFormat = FMT, age_s: float = 0.0) -> None:
        role, node = self.where[sid]
        self.seq[sid] = self.seq.get(sid, 0) + 1
        r = self.rng
        fields: dict[str, Any] = {"rates": {}}
        if role == ROLE_STORAGE:
            fields["read_queue_tokens"] = r.randrange(0, 5000)
            fields["rates"]["read_bandwidth_bytes_per_s"] = r.choice([0.0, 1e9, 2e9])
        else:
            fields.update(num_running=r.randrange(0, 4), unfinished_tokens=r.randrange(0, 9000))
            fields.update(free_kv_blocks=r.randrange(0, 300), kv_format=kv_format)
            fields["rates"]["prefill_tokens_per_s"] = r.choice([0.0, 5000.0, 8000.0])
        report = LoadReport(
            service_id=sid, role=role, node=node, seq=self.seq[sid], sent_at=0.0,
            is_draining=r.random() < 0.15, **fields,
        )  # fmt: skip
        self.engines.update(report, self.now - age_s)

    def step(self) -> None:
        """One random change between two rounds."""
        r, sid = self.rng, self.rng.choice(sorted(self.where))
        kind = r.choices(["report", "note", "join", "leave", "move", "refused", "silent", "time"],
                         weights=[40, 30, 4, 3, 2, 1, 2, 3])[0]  # fmt: skip
        if kind == "report":
            self.report(sid)
        elif kind == "note":
            r.choice([
                lambda: self.engines.note_assigned(sid, r.randrange(1, 900), kv_tokens=r.randrange(0, 900)),
                lambda: self.engines.note_unassigned(sid, r.randrange(1, 900)),
                lambda: self.engines.note_kv_reserved(sid, r.randrange(1, 900)),
            ])()  # fmt: skip
        elif kind == "join":
            role = r.choice([ROLE_PREFILL, ROLE_DECODE, ROLE_STORAGE])
            self.join(f"{role[0]}{len(self.seq)}", role, r.randrange(0, 9))
        elif kind == "leave":
            self.engines.remove(sid)
            del self.where[sid]
        elif kind == "move":
            role, node = self.where[sid]
            self.where[sid] = (
                r.choice([ROLE_PREFILL, ROLE_DECODE]) if role != ROLE_STORAGE else role,
                node + 1,
            )
            self.report(sid)
        elif kind == "refused" and self.where[sid][0] != ROLE_STORAGE:
            self.report(sid, kv_format=OTHER)
        elif kind == "silent":
            self.report(sid, age_s=r.choice([TIMEOUT_S + 1, TIMEOUT_S - 1]))  # silent now, or soon
        elif kind == "time":
            self.now += r.choice([0.5, 2.0])


def rates(engines: EngineTable, now: float) -> tuple[list[float], list[float]]:
    live = engines.live(now)
    reads = [
        st.report.rates.get("read_bandwidth_bytes_per_s", 0.0) for st in live if st.report.role == "storage"
    ]
    prefills = [
        st.report.rates.get("prefill_tokens_per_s", 0.0) for st in live if st.report.role == "prefill"
    ]
    return sorted(reads), sorted(prefills)


@pytest.mark.parametrize("seed", range(6))
def test_the_updated_table_equals_a_fresh_one_and_decides_the_same(seed: int) -> None:
    cluster = Cluster(seed)
    engines, rng = cluster.engines, cluster.rng
    thresholds = Thresholds(alpha_tokens=3000, beta_tokens=12_000, z_factor=1.05)
    num_rebuilds = num_placed = 0
    for round_no in range(300):
        for _ in range(rng.randrange(0, 6)):
            cluster.step()
        before = engines._sync.table
        table = engines.load_table(64, cluster.now)
        num_rebuilds += table is not before
        fresh = LoadTable.of(*engines.cluster_snapshot(64, cluster.now))
        assert canonical(table) == canonical(fresh)
        assert tuple(map(sorted, engines.rates())) == rates(engines, cluster.now)
        queue = [
            PendingRequest(f"r{round_no}.{i}", length, min(length, rng.randrange(0, 4000)), length + 500)
            for i, length in enumerate(rng.randrange(100, 6000) for _ in range(rng.randrange(1, 6)))
        ]
        for policy in POLICIES:
            got = place_table_round(policy, table, queue, thresholds, RoundState())
            assert got == place_table_round(policy, fresh, queue, thresholds, RoundState())
        for placement in got.placements:  # what the router notes after a round (`PlacementQueue._note`)
            engines.note_assigned(placement.pe_id, 500)
            engines.note_assigned(placement.de_id, 500, kv_tokens=700)
            storage = engines.storage_of(placement.read_node) if placement.read_node is not None else None
            if storage is not None:
                engines.note_assigned(storage, placement.read_tokens)
            num_placed += 1
    assert num_placed > 50 and 10 < num_rebuilds < 200
