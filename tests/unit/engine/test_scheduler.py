"""Engine scheduler rules on hand-made sequences (pure: a free-list allocator, no model)."""

from __future__ import annotations

from collections.abc import Sequence as Seq

from services.engine.scheduler import EngineScheduler, StepPlan
from services.engine.sequence import SeqStatus, Sequence
from shared.protocol import RequestPlan, SamplingParams


class FreeList:
    """The reference block allocator: a list of free ids."""

    def __init__(self, n: int) -> None:
        self.free_ids = list(range(n))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_ids)

    def allocate(self, n: int) -> list[int]:
        assert n <= len(self.free_ids)
        out, self.free_ids = self.free_ids[:n], self.free_ids[n:]
        return out

    def free(self, block_ids: Seq[int]) -> None:
        assert not set(block_ids) & set(self.free_ids), "double free"
        self.free_ids.extend(block_ids)


def seq(rid: str, n_prompt: int, max_tokens: int = 8) -> Sequence:
    plan = RequestPlan(
        request_id=rid,
        router_id="r",
        prompt_token_ids=list(range(n_prompt)),
        sampling=SamplingParams(max_tokens=max_tokens),
        deadline_unix_s=1e12,
    )
    return Sequence(plan=plan, arrived_at=0.0)


def sched(blocks: int = 16, budget: int = 64, max_seqs: int = 8) -> EngineScheduler:
    return EngineScheduler(
        FreeList(blocks), block_size=4, max_num_seqs=max_seqs, max_num_batched_tokens=budget
    )


def apply(plan: StepPlan) -> None:
    """Pretend the step ran: apply the plan like the engine core does."""
    for c in plan.prefill:
        c.seq.num_computed_tokens = c.start + c.num_tokens
        if c.sample:
            c.seq.output_token_ids.append(1)
    for d in plan.decode:
        d.num_computed_tokens += 1
        d.output_token_ids.append(1)


def run_prefill(s: EngineScheduler) -> None:
    apply(s.schedule())


def test_chunked_prefill_respects_budget_and_fifo() -> None:
    s = sched(budget=10)
    a, b = seq("a", 7), seq("b", 6)
    s.add(a)
    s.add(b)
    plan = s.schedule()
    assert [(c.seq.request_id, c.start, c.num_tokens, c.sample) for c in plan.prefill] == [
        ("a", 0, 7, True),
        ("b", 0, 3, False),
    ]
    assert len(a.block_ids) == 2 and len(b.block_ids) == 1
    apply(plan)
    plan = s.schedule()
    # a decodes; b continues its prefill from token 3
    assert [d.request_id for d in plan.decode] == ["a"]
    assert [(c.seq.request_id, c.start, c.num_tokens, c.sample) for c in plan.prefill] == [("b", 3, 3, True)]


def test_decode_grows_block_table_at_boundary() -> None:
    s = sched()
    a = seq("a", 4)
    s.add(a)
    run_prefill(s)  # 4 tokens computed, 1 sampled
    assert len(a.block_ids) == 1
    plan = s.schedule()
    assert plan.decode == [a] and len(a.block_ids) == 2  # position 4 needs a second block


def test_preempts_newest_when_out_of_blocks_and_recomputes_it() -> None:
    s = sched(blocks=4, budget=64)
    a, b = seq("a", 8), seq("b", 8)
    s.add(a)
    s.add(b)
    run_prefill(s)
    assert s.allocator.num_free_blocks == 0
    plan = s.schedule()  # both need a third block, none free: b (newest) is preempted for a
    assert plan.preempted == [b] and plan.decode == [a]
    assert b.status is SeqStatus.WAITING and b.block_ids == [] and b.num_computed_tokens == 0
    assert s.waiting[0] is b
    # b comes back recomputing prompt + output minus its last token, without sampling again
    s.finish(a, "length")
    plan = s.schedule()
    assert [(c.seq.request_id, c.start, c.num_tokens, c.sample) for c in plan.prefill] == [("b", 0, 8, False)]


def test_a_sequence_alone_in_a_full_cache_ends_instead_of_preempting_itself() -> None:
    s = sched(blocks=2, budget=64)
    a, b = seq("a", 7, max_tokens=100), seq("b", 4)
    s.add(a)
    run_prefill(s)
    plan = s.schedule()  # position 7 is the last place in the 2-block cache
    assert plan.decode == [a]
    apply(plan)
    s.add(b)  # b waits for a's blocks
    plan = s.schedule()  # position 8 needs a third block and nobody else holds one
    assert plan.full == [a] and plan.preempted == [] and plan.decode == [] and plan.prefill == []
    assert a.status is SeqStatus.RUNNING and a.num_preemptions == 0
    s.finish(a, "length")
    plan = s.schedule()
    assert [c.seq.request_id for c in plan.prefill] == ["b"]


def test_hit_tokens_are_loaded_not_budgeted() -> None:
    s = sched(budget=4)
    a = seq("a", 14)
    a.num_hit_tokens = 12
    s.add(a)
    plan = s.schedule()
    [c] = plan.prefill
    assert (c.start, c.num_tokens, c.load_tokens, c.sample) == (12, 2, 12, True)
    assert len(a.block_ids) == 4


def test_head_of_line_waits_when_cache_is_full() -> None:
    s = sched(blocks=3, budget=64)
    a, b = seq("a", 8), seq("b", 4)
    s.add(a)
    run_prefill(s)
    s.add(b)
    plan = s.schedule()
    # a's decode takes the last block; b gets nothing this step and stays first in line
    assert plan.decode == [a] and plan.prefill == [] and s.waiting[0] is b


def test_finish_frees_blocks_everywhere() -> None:
    s = sched()
    a, b = seq("a", 5), seq("b", 5)
    s.add(a)
    s.add(b)
    s.schedule()
    s.finish(a, "abort")
    s.finish(b, "abort")
    assert s.allocator.num_free_blocks == 16 and not s.has_work()
    c = seq("c", 3)  # still preparing: finishing it must not touch the queues
    s.finish(c, "abort")
    assert c.status is SeqStatus.FINISHED


def test_planner_decides_the_prefill_batch_and_keeps_fifo() -> None:
    calls = []

    def planner(work: list[tuple[str, int, int]]) -> list[tuple[str, int]]:
        calls.append(work)
        return [(work[0][0], work[0][2]), (work[1][0], 3)]  # first whole, second chunked

    s = EngineScheduler(
        FreeList(16), block_size=4, max_num_seqs=8, max_num_batched_tokens=64, prefill_planner=planner
    )
    a, b, c = seq("a", 6), seq("b", 9), seq("c", 5)
    b.num_hit_tokens = 4  # b's first four tokens are loaded, not computed
    for x in (a, b, c):
        s.add(x)
    plan = s.schedule()
    assert calls == [[("a", 0, 6), ("b", 4, 5), ("c", 0, 5)]]
    assert [(p.seq.request_id, p.start, p.num_tokens, p.load_tokens, p.sample) for p in plan.prefill] == [
        ("a", 0, 6, 0, True),
        ("b", 4, 3, 4, False),
    ]
    assert list(s.waiting) == [c] and s.running == [a, b]


def test_quota_planner_learns_the_profile_and_chunks_to_the_quota() -> None:
    from services.policy.batching import AttentionShape, BatchingLimits, attention_flops
    from services.policy.quota import REFIT_EVERY, QuotaPlanner

    shape = AttentionShape(num_q_heads=4, head_dim=16)
    quota = QuotaPlanner(shape, BatchingLimits(compute_quota_s=0.01, max_num_batched_tokens=4096))
    s_per_flop = 1e-9  # "measured": 1 GFLOP/s, no fixed cost
    for n in range(1, REFIT_EVERY + 1):
        pairs = [(0, 100 * n)]
        quota.observe(pairs, attention_flops(0, 100 * n, shape) * s_per_flop)
    assert abs(quota.profile.s_per_flop - s_per_flop) / s_per_flop < 1e-6
    [(_, chunk)] = quota.plan([("r", 0, 4000)])
    # the largest chunk whose predicted time fits 10 ms, by the fitted model
    assert (
        attention_flops(0, chunk, shape) * s_per_flop
        <= 0.01
        < attention_flops(0, chunk + 1, shape) * s_per_flop
    )


def holding(s: EngineScheduler, rid: str, n_prompt: int, n_blocks: int) -> Sequence:
    """A sequence queued with `n_blocks` blocks it took when it arrived (a session's resident KV: all its
    tokens but the last prompt one computed)."""
    x = seq(rid, n_prompt)
    x.block_ids = s.allocator.allocate(n_blocks)
    x.num_computed_tokens = n_prompt - 1
    return x


def test_sequences_waiting_with_blocks_give_them_back_when_nothing_else_can_run() -> None:
    s = sched(blocks=6, budget=64)
    head = seq("head", 17)
    head.num_hit_tokens = 16  # a loaded prefix: its 5 blocks are needed at once
    s.add(head)
    w1, w2 = holding(s, "w1", 6, 2), holding(s, "w2", 4, 1)
    s.add(w1)
    s.add(w2)
    assert s.allocator.num_free_blocks == 3  # short of the head's 5, and nothing runs to free any
    plan = s.schedule()
    # the last in line gives its blocks back first, until the head fits; w1 and w2 start over behind it
    assert plan.preempted == [w1, w2] and plan.num_taken_back == 2
    assert [(c.seq.request_id, c.load_tokens) for c in plan.prefill] == [("head", 16)]
    assert list(s.waiting) == [w1, w2] and s.running == [head]
    assert all(w.block_ids == [] and w.num_computed_tokens == 0 and w.num_preemptions == 1 for w in (w1, w2))
    apply(plan)
    s.finish(head, "stop")
    plan = s.schedule()
    assert [(c.seq.request_id, c.start, c.num_tokens) for c in plan.prefill] == [("w1", 0, 6), ("w2", 0, 4)]


def test_waiting_blocks_stay_while_a_running_sequence_will_free_its_own() -> None:
    s = sched(blocks=6, budget=64)
    a = seq("a", 4, max_tokens=4)
    s.add(a)
    run_prefill(s)  # a decodes in its one block
    head = seq("head", 17)
    head.num_hit_tokens = 16
    s.add(head)
    w = holding(s, "w", 6, 2)
    s.add(w)
    plan = s.schedule()  # a decodes: the head waits for a's blocks, w keeps its own
    assert plan.decode == [a] and plan.preempted == [] and plan.prefill == []
    assert len(w.block_ids) == 2 and w.num_preemptions == 0


def test_partly_prefilled_sequences_stuck_in_a_full_cache_preempt_the_newest() -> None:
    s = sched(blocks=4, budget=64)
    a, b = seq("a", 12), seq("b", 12)
    for x in (a, b):  # both half prefilled, the cache full: neither can take its next chunk
        x.block_ids = s.allocator.allocate(2)
        x.num_computed_tokens = 8
        x.status = SeqStatus.RUNNING
        s.running.append(x)
    plan = s.schedule()
    assert plan.preempted == [b] and plan.num_taken_back == 0 and plan.is_empty and b.block_ids == []
    assert s.waiting[0] is b
    plan = s.schedule()  # a's chunk first; b starts over in the block left
    assert [(c.seq.request_id, c.start, c.num_tokens) for c in plan.prefill] == [("a", 8, 4), ("b", 0, 4)]


def test_a_decode_short_of_a_block_takes_it_from_a_queued_sequence_not_its_own_end() -> None:
    s = sched(blocks=4, budget=64)
    a = seq("a", 7, max_tokens=100)
    s.add(a)
    run_prefill(s)
    apply(s.schedule())  # position 7: a's two blocks are full
    w = holding(s, "w", 6, 2)  # a session's turn took the other two when it arrived
    s.add(w)
    plan = s.schedule()  # before: a counted as alone in a full cache and ended at `length`
    assert plan.decode == [a] and plan.full == [] and plan.preempted == [w] and plan.num_taken_back == 1
    assert len(a.block_ids) == 3 and w.block_ids == [] and list(s.waiting) == [w]


def test_a_lone_decode_waits_for_blocks_a_preparing_sequence_holds_instead_of_ending() -> None:
    seqs: dict[str, Sequence] = {}
    s = EngineScheduler(FreeList(4), block_size=4, max_num_seqs=8, max_num_batched_tokens=9, engine_seqs=seqs)
    a = seq("a", 7, max_tokens=100)
    seqs["a"] = a
    s.add(a)
    run_prefill(s)
    apply(s.schedule())  # position 7: a's two blocks are full
    r = holding(s, "r", 6, 2)  # a remote session turn: its resident KV held while its prefill engine works
    seqs["r"] = r  # PREPARING, not queued yet
    plan = s.schedule()
    assert plan.is_empty and plan.full == [] and s.running == [a]  # before: a ended at `length` here
    s.add(r)  # its prefill engine is done: queued, it gives its blocks back to the running decode
    plan = s.schedule()
    assert plan.decode == [a] and plan.preempted == [r] and r.block_ids == []
    for x in (a, r):
        s.finish(x, "stop")
    b = seq("b", 7, max_tokens=100)
    s.add(b)
    run_prefill(s)
    apply(s.schedule())
    s.allocator.allocate(2)  # nobody's: held for good (a pinned chunk); b is alone in what is left
    assert s.schedule().full == [b]


def test_a_queued_routed_prefix_is_not_taken_back_its_places_take_no_memory() -> None:
    class WithNullBlock(FreeList):
        null_block_or_none = 99  # the block every routed prefix's places point at (gpu.kv_cache)

    s = EngineScheduler(WithNullBlock(6), block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    head = seq("head", 25)
    head.num_hit_tokens = 24  # 7 blocks at once: more than the whole free cache
    s.add(head)
    routed = seq("routed", 9)
    routed.block_ids, routed.num_hit_tokens = [99, 99], 8  # its first 8 tokens attend on the holder
    s.add(routed)
    plan = s.schedule()
    assert plan.preempted == [] and routed.block_ids == [99, 99] and routed.num_preemptions == 0
