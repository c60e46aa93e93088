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
from shared.protocol import COMPUTE_RATE, PROMPT_RATE, KvFormat, LoadReport

FMT = KvFormat(fingerprint="placement-order", block_size=64, bytes_per_token=4096)
PREFILL_TOKENS_PER_S = 1000.0  # with beta_s 1: a PE over 1,000 unfinished tokens takes nothing
COMPUTE_TOKENS_PER_S = 200.0  # a short-first PE runs 200 tokens of its shorter prefills within beta_s


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

    def pe(self, unfinished_tokens: int, order: str = "", left: tuple[int, ...] = ()) -> None:
        """The PE reports (what the router noted as sent to it is then in its report): its unfinished
        tokens, and under `order` short-first each prefill's tokens left (`left`)."""
        self._report(
            "p0", "prefill", 0, unfinished_tokens=unfinished_tokens,
            free_kv_blocks=4000, total_kv_blocks=4000,
            prefill_order=order, prefill_left_tokens=list(left), num_prefills=len(left),
            rates={PROMPT_RATE: PREFILL_TOKENS_PER_S, COMPUTE_RATE: COMPUTE_TOKENS_PER_S},
        )  # fmt: skip

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


@pytest.mark.parametrize("order", ["short-first", "fcfs"])
async def test_past_beta_a_short_first_pe_takes_what_it_would_run_within_beta(order: str) -> None:
    """The PE holds a cold prompt (2,900 tokens left: over beta). Ordering its queue shortest first, it
    runs a 56-token warm turn after nothing, so the router sends it at once; then what it was sent counts
    until its next report, and a prefill whose shorter work passes 200 tokens (beta_s of its compute)
    waits, as the next cold prompt does. A FCFS PE gets nothing past beta."""
    c = Cluster("short-first")
    c.pe(unfinished_tokens=5000, order=order, left=(2900,))
    c.add("cold", 3000)
    c.add("warm", 3000, hit=2944)
    c.add("warm2", 3000, hit=2850)  # 150 to compute
    c.add("warm3", 3000, hit=2820)  # 180: 56 + 150 would run before it
    if order == "fcfs":
        assert c.queue.round() == 0
        return
    assert c.queue.round() == 2
    assert [rid for rid, w in c.queue.queue.items() if w.future.done()] == ["warm", "warm2"]
    assert c.queue.queue["cold"].postponed_tokens == 206 and c.queue.queue["warm3"].postponed_tokens == 0
    assert c.queue.round() == 0  # no report since: still 56 + 150 ahead of warm3
    for rid in ("warm", "warm2"):
        c.queue.taken("p0", rid, accepted=True)  # the PE acked both tasks (the dispatch tells the queue)
        c.queue.queue.pop(rid)
    # the first report after the acks may predate them: what was sent still counts (twice, if it lists them)
    c.pe(unfinished_tokens=5000, order=order, left=(56, 150, 2900))
    assert c.queue.round() == 0
    c.pe(unfinished_tokens=5000, order=order, left=(150, 2900))  # the warm turn is done, warm2 is not
    assert c.queue.round() == 1 and c.queue.queue["warm3"].future.done()


async def test_a_task_the_pe_refused_no_longer_counts_ahead() -> None:
    c = Cluster("short-first")
    c.pe(unfinished_tokens=5000, order="short-first", left=(2900,))
    c.add("warm", 3000, hit=2700)  # 300 to compute, with nothing shorter ahead of it
    assert c.queue.round() == 1
    c.queue.queue.pop("warm")
    c.add("warm2", 3000, hit=2600)
    assert c.queue.round() == 0  # 400: the 300 sent would run before it
    c.queue.taken("p0", "warm", accepted=False)  # the DE or the PE refused it: it never ran there
    assert c.queue.round() == 1


def test_the_order_needs_a_policy_with_a_placement_queue() -> None:
    RouterConfig(policy="dualpath", prefill_order="short-first").validate()
    with pytest.raises(ConfigError, match="prefill_order"):
        RouterConfig(policy="colocated", prefill_order="short-first").validate()
    with pytest.raises(ConfigError, match="prefill_order"):
        RouterConfig(policy="dualpath", prefill_order="slo").validate()
