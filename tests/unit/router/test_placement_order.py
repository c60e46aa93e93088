"""DualPath's placement queue offered shortest compute first (`--prefill-order short-first`): the router's
own `PlacementQueue` over a real `EngineTable` fed load reports (no processes), one PE whose beta admits one
request per round, so the order of the offer decides which request goes first."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.policy.snapshot import PendingRequest
from services.router.config import RouterConfig
from services.router.disaggregated import PlacementQueue, SchedulerParams
from services.router.engines import EngineTable
from shared.errors import ConfigError
from shared.protocol import KvFormat, LoadReport

FMT = KvFormat(fingerprint="placement-order", block_size=64, bytes_per_token=4096)
PREFILL_TOKENS_PER_S = 1000.0  # with beta_s 1: a PE over 1,000 unfinished tokens takes nothing


class Cluster:
    """One PE, one DE and their nodes' storage services, as their load reports describe them."""

    def __init__(self, prefill_order: str) -> None:
        self.engines = EngineTable(silence_timeout_s=60.0)
        self.seq = 0
        params = SchedulerParams(
            "dualpath", alpha_s=1.0, beta_s=1.0, z_factor=1.05, prefill_order=prefill_order
        )
        self.queue = PlacementQueue(self.engines, params)
        for node in (0, 1):
            self._report(
                f"s{node}", "storage", node, read_queue_tokens=0, rates={"read_bandwidth_bytes_per_s": 1e9}
            )
        self._report("d0", "decode", 1, unfinished_tokens=0, free_kv_blocks=4000, total_kv_blocks=4000)
        self.pe(unfinished_tokens=0)

    def _report(self, sid: str, role: str, node: int, **fields: object) -> None:
        self.seq += 1
        if role != "storage":
            fields.update(kv_format=FMT, num_running=0)
            fields.setdefault("rates", {"prefill_tokens_per_s": PREFILL_TOKENS_PER_S})
        report = LoadReport(service_id=sid, role=role, node=node, seq=self.seq, sent_at=0.0, **fields)  # type: ignore[arg-type]
        self.engines.update(report, time.monotonic())

    def pe(self, unfinished_tokens: int) -> None:
        """The PE reports (what the router noted as sent to it is then in its report)."""
        self._report(
            "p0", "prefill", 0, unfinished_tokens=unfinished_tokens, free_kv_blocks=4000, total_kv_blocks=4000
        )

    def add(self, request_id: str, prompt: int, hit: int = 0) -> asyncio.Future:
        return self.queue.enqueue(PendingRequest(request_id, prompt, hit, prompt + 16))

    def placed_next(self) -> set[str]:
        """The PE falls idle; one round; the ids it placed."""
        self.pe(unfinished_tokens=0)
        before = {rid for rid, w in self.queue.queue.items() if w.future.done()}
        self.queue.round()
        done = {rid for rid, w in self.queue.queue.items() if w.future.done()}
        for rid in done:
            self.queue.queue.pop(rid)
        return done - before


async def test_first_come_first_served_holds_the_warm_turn_behind_the_cold_prompt() -> None:
    c = Cluster("fcfs")
    c.pe(unfinished_tokens=5000)  # busy: the two wait
    c.add("cold", 3000)
    c.add("warm", 3000, hit=2944)  # the same length, 56 tokens to compute
    assert c.queue.round() == 0
    assert c.placed_next() == {"cold"}
    assert c.placed_next() == {"warm"}


async def test_short_first_places_the_warm_turn_ahead_and_counts_what_it_passed() -> None:
    c = Cluster("short-first")
    c.pe(unfinished_tokens=5000)
    c.add("cold", 3000)
    c.add("warm", 3000, hit=2944)
    assert c.queue.round() == 0
    assert c.queue.queue["cold"].postponed_tokens == 0  # nothing placed: nothing passed
    assert c.placed_next() == {"warm"}
    assert c.queue.queue["cold"].postponed_tokens == 56
    assert c.placed_next() == {"cold"}


async def test_no_request_is_passed_for_more_than_its_own_compute() -> None:
    c = Cluster("short-first")
    c.pe(unfinished_tokens=5000)
    c.add("cold", 1200, hit=900)  # 300 to compute: shorter ones may pass it for 300 tokens of theirs
    for i in range(3):
        c.add(f"warm{i}", 2000, hit=1900)
    assert [c.placed_next() for _ in range(3)] == [{"warm0"}, {"warm1"}, {"warm2"}]
    assert c.queue.queue["cold"].postponed_tokens == 300
    c.add("warm3", 2000, hit=1900)  # arrives later and is shorter, but the cold prompt is closed
    assert c.placed_next() == {"cold"}
    assert c.placed_next() == {"warm3"}


def test_the_order_needs_a_policy_with_a_placement_queue() -> None:
    RouterConfig(policy="dualpath", prefill_order="short-first").validate()
    with pytest.raises(ConfigError, match="prefill_order"):
        RouterConfig(policy="colocated", prefill_order="short-first").validate()
    with pytest.raises(ConfigError, match="prefill_order"):
        RouterConfig(policy="dualpath", prefill_order="slo").validate()
