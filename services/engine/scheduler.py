"""Continuous-batching scheduler of one engine (pure: sequences and a block allocator in, a plan out).

Each step: every running sequence past its prefill decodes one token; prefill chunks of partially
prefilled and then waiting sequences fill a token budget (chunked prefill). When the cache runs out of
blocks, queued sequences that hold blocks give them back first (a session's turn takes its resident KV when
it arrives, and waits with it), the last in line first; then the newest running sequence is preempted (its
blocks freed; it is recomputed later from prompt + output so far, or its stored blocks read back). A
sequence alone in a full cache is not preempted (it would only come back to the same cache): the cache is
its whole context, and it ends at `length`; alone but beside blocks that sequences still preparing hold,
it waits for them. When nothing can run because the cache holds what the next sequence needs, the blocks
are taken back the same way (`_is_stuck`): sequences holding blocks while they wait for one another would
otherwise wait for their deadlines.
Stored prefix KV (hits) is loaded during a sequence's first chunk: those tokens cost blocks, not budget.
The n choices of one request share their prompt's blocks (`fork`, reference-counted); a choice about to
write into a block it shares gets a private copy first (copy-on-write: `StepPlan.copies`, done before the
step's forward), so only the partly filled last prompt block is ever copied, n - 1 times at most.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Protocol

from services.engine.sequence import SeqStatus, Sequence
from services.policy.short_first import WaitingPrefill, closed, num_passing
from shared.blocks import blocks_for

# Decides the next prefill batch: (request id, cached tokens, remaining tokens) in FIFO order in,
# (request id, tokens to compute now) out. None: a plain token budget (max_num_batched_tokens).
PrefillPlanner = Callable[[list[tuple[str, int, int]]], list[tuple[str, int]]]
# Reorders the waiting queue from index `start` on so that waiting[start] is the next prefill to admit (AMPD's
# Algorithm 2: services/engine/slo_order.py). None: first come, first served.
PrefillOrder = Callable[[deque[Sequence], int], None]


class BlockAllocator(Protocol):
    @property
    def num_free_blocks(self) -> int: ...

    def allocate(self, n: int) -> list[int]: ...

    def free(self, block_ids: Seq[int]) -> None: ...


class SharingAllocator(BlockAllocator, Protocol):
    """An allocator whose blocks may have several owners (gpu.kv_cache.PagedKVCache): what `fork` needs."""

    def share(self, block_ids: Seq[int]) -> None: ...

    def ref_count(self, block_id: int) -> int: ...


@dataclass(slots=True)
class PrefillChunk:
    seq: Sequence
    start: int  # first token computed in this chunk (= tokens already in cache or loaded now)
    num_tokens: int
    load_tokens: int = 0  # stored-prefix tokens [0, load_tokens) loaded layer by layer during this chunk
    sample: bool = True  # the chunk completes the prefill and a new token is sampled


@dataclass(slots=True)
class StepPlan:
    prefill: list[PrefillChunk] = field(default_factory=list)
    decode: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    full: list[Sequence] = field(default_factory=list)  # alone and the cache is full: it ends at `length`
    copies: list[tuple[int, int]] = field(default_factory=list)  # (source, destination) block, before compute
    num_taken_back: int = 0  # the first of `preempted` that were queued, not running (`_take_back_queued`)

    @property
    def is_empty(self) -> bool:
        return not self.prefill and not self.decode


class EngineScheduler:
    def __init__(
        self,
        allocator: BlockAllocator,
        *,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        prefill_planner: PrefillPlanner | None = None,
        prefill_order: PrefillOrder | None = None,
        engine_seqs: Mapping[str, Sequence] | None = None,
    ) -> None:
        # every sequence of the engine, queued here or not: those still PREPARING may hold blocks already (a
        # remote session turn keeps its resident KV while its prefill engine works)
        self.engine_seqs: Mapping[str, Sequence] = engine_seqs if engine_seqs is not None else {}
        self.prefill_planner = prefill_planner
        self.prefill_order = prefill_order
        # None: partly prefilled sequences take the step's budget first. A ratio (shortest-first order): a
        # waiting sequence with fewer tokens left to compute goes ahead of them while none is `closed`.
        self.short_first_ratio: float | None = None
        self.step_budget: Callable[[], int] | None = None  # the token budget of each step, when it varies
        self.allocator = allocator
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._taken: list[Sequence] = []  # queued sequences whose blocks this step took back

    # ---------------------------------------------------------------------------------------- queries

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def unfinished_tokens(self) -> int:
        return sum(s.num_tokens for s in self.waiting) + sum(s.num_tokens for s in self.running)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---------------------------------------------------------------------------------------- updates

    def add(self, seq: Sequence, *, first: bool = False) -> None:
        """Queue `seq` last, or `first` (a preempted sequence back from reloading its prefix)."""
        seq.status = SeqStatus.WAITING
        if first:
            self.waiting.appendleft(seq)
        else:
            self.waiting.append(seq)

    def withdraw(self, seq: Sequence) -> None:
        """Take a preempted sequence back out of the queue while its prefix reloads (`add` returns it)."""
        self.waiting.remove(seq)
        seq.status = SeqStatus.PREPARING

    def finish(self, seq: Sequence, reason: str) -> None:
        """Remove `seq` wherever it is and free its blocks."""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        # PREPARING: not queued here yet
        self._free(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = seq.finish_reason or reason

    def fork(self, parent: Sequence, child: Sequence, num_computed_tokens: int) -> None:
        """`child` continues from the first `num_computed_tokens` of `parent`'s prompt (in the cache):
        it shares the blocks holding the prompt (one more owner each) and runs from the next step on."""
        allocator: SharingAllocator = self.allocator  # type: ignore[assignment]
        shared = parent.block_ids[: blocks_for(parent.num_prompt_tokens, self.block_size)]
        allocator.share(shared)
        child.block_ids = list(shared)
        child.num_computed_tokens = num_computed_tokens
        child.num_cached_tokens = parent.num_cached_tokens
        child.choice_of = None
        parent.may_share_blocks = child.may_share_blocks = True
        child.status = SeqStatus.RUNNING
        self.running.append(child)

    def _free(self, seq: Sequence) -> None:
        if seq.block_ids:
            self.allocator.free(seq.block_ids)
            seq.block_ids = []

    def _own_next_block(self, seq: Sequence, plan: StepPlan) -> bool:
        """Copy-on-write: the block the next token is written into becomes the sequence's own (a copy when it
        has other owners); False (nothing changed) if the cache has no free block for the copy."""
        index = seq.num_computed_tokens // self.block_size
        if not seq.may_share_blocks or index >= len(seq.block_ids):
            return True
        allocator: SharingAllocator = self.allocator  # type: ignore[assignment]
        shared = seq.block_ids[index]
        if allocator.ref_count(shared) == 1:
            return True
        if not allocator.num_free_blocks:
            return False
        copy = allocator.allocate(1)[0]
        plan.copies.append((shared, copy))
        seq.block_ids[index] = copy
        allocator.free([shared])
        return True

    def _grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Make `seq`'s block table cover `num_tokens`; False (nothing allocated) if the cache is short."""
        need = blocks_for(num_tokens, self.block_size) - len(seq.block_ids)
        if need <= 0:
            return True
        if need > self.allocator.num_free_blocks:
            return False
        seq.block_ids.extend(self.allocator.allocate(need))
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._free(seq)
        seq.num_computed_tokens = 0
        seq.num_hit_tokens = 0  # the loaded prefix is gone with the blocks: recompute it
        seq.num_preemptions += 1
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)

    # --------------------------------------------------------------------------------------- schedule

    def schedule(self) -> StepPlan:
        if self.step_budget is not None:  # `step_target_s`: the budget from the measured compute rate
            self.max_num_batched_tokens = self.step_budget()
        self._taken = []
        plan = self._schedule()
        while plan.is_empty and not plan.preempted and not plan.full and self._is_stuck():
            partials = any(s.is_prefilling for s in self.running)
            if self._take_back_queued(include_head=partials):
                plan = self._schedule()
            elif len(self.running) > 1:  # partly prefilled sequences wait for each other's blocks
                victim = self.running[-1]
                self._preempt(victim)
                plan.preempted.append(victim)  # nothing is admitted this step (it would only thrash)
            else:
                break
        taken, self._taken = self._taken[::-1], []  # in line order
        self.waiting.extend(taken)  # at the back of the line, where they were taken from
        plan.preempted[:0] = taken
        plan.num_taken_back = len(taken)
        return plan

    def _is_stuck(self) -> bool:
        """Nothing runs this step, and because of the cache: the head of the queue, or a partly prefilled
        running sequence, needs more blocks than are free. Nothing running will free any, so without taking
        blocks back they wait for their deadlines."""
        free = self.allocator.num_free_blocks
        heads = [s for s in self.running if s.is_prefilling] + list(self.waiting)[:1]
        return any(blocks_for(_start(s) + 1, self.block_size) - len(s.block_ids) > free for s in heads)

    def _held_while_preparing(self) -> bool:
        return any(s.block_ids for s in self.engine_seqs.values() if s.status is SeqStatus.PREPARING)

    def _take_back_queued(self, *, include_head: bool) -> bool:
        """Take back the blocks of the last sequence in line that holds some (a session's resident KV, which
        its turn takes when it arrives), the head of the line only if `include_head`: it is preempted
        (recomputed, or its stored prefix reloaded) and out of the queue until the step is planned. Queued
        sequences give blocks back before running ones: they are idle, and running ones make progress.
        False: no queued sequence holds any."""
        queue = list(self.waiting)[0 if include_head else 1 :]
        null = getattr(self.allocator, "null_block_or_none", -1)  # a routed prefix's places take no memory
        victim = next((s for s in reversed(queue) if any(b != null for b in s.block_ids)), None)
        if victim is None:
            return False
        self.waiting.remove(victim)
        self._free(victim)
        victim.num_computed_tokens = victim.num_hit_tokens = 0
        victim.num_preemptions += 1
        self._taken.append(victim)
        return True

    def _schedule(self) -> StepPlan:
        plan = StepPlan()
        self._schedule_decodes(plan)
        if self.prefill_planner is not None:
            self._schedule_planned_prefills(plan, self.prefill_planner)
            return plan
        budget = self.max_num_batched_tokens
        partials = [s for s in self.running if s.is_prefilling]
        if self.short_first_ratio is not None and not plan.preempted:
            budget = self._admit(plan, budget, shorter_than=partials)
        for seq in partials:
            budget -= self._add_chunk(plan, seq, budget) or 0
            if budget <= 0:
                return plan
        if plan.preempted:
            return plan  # the cache is short: admitting now would only thrash
        self._admit(plan, budget)
        return plan

    def _admit(self, plan: StepPlan, budget: int, shorter_than: list[Sequence] | None = None) -> int:
        """Admit waiting sequences into the step (in the prefill order) while the budget lasts; the budget
        left. With `shorter_than` (partly prefilled sequences): only while the next one has fewer tokens
        left to compute than each of them and none of them is `closed`; each admission postpones them all
        by its tokens."""
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            if self.prefill_order is not None:
                self.prefill_order(self.waiting, 0)
            seq = self.waiting[0]
            left = seq.prefill_target - _start(seq)
            if shorter_than is not None:
                ratio = self.short_first_ratio or 0.0
                partials = [waiting_prefill(p) for p in shorter_than]
                if any(closed(p, ratio) or p.tokens_left <= left for p in partials):
                    break
            used = self._add_chunk(plan, seq, budget)
            if used is None:
                break  # head of line does not fit: keep FIFO order
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            budget -= used
            for p in shorter_than or ():
                p.postponed_tokens += left
        return budget

    def _schedule_planned_prefills(self, plan: StepPlan, planner: PrefillPlanner) -> None:
        """Prefill batch chosen by the planner (a compute quota): running chunks first, then the queue."""
        room = max(0, self.max_num_seqs - len(self.running))
        if self.prefill_order is not None and not plan.preempted:
            for start in range(min(room, len(self.waiting))):
                self.prefill_order(self.waiting, start)
        partials = [s for s in self.running if s.is_prefilling]
        queued = list(self.waiting)[:room] if not plan.preempted else []
        ratio = self.short_first_ratio
        if ratio is not None:
            waiting = [waiting_prefill(s) for s in queued]
            ahead = queued[: num_passing(waiting, [waiting_prefill(p) for p in partials], ratio)]
        else:
            ahead = []
        candidates = ahead + partials + queued[len(ahead) :]
        work = [(s.request_id, _start(s), s.prefill_target - _start(s)) for s in candidates]
        by_id = {s.request_id: s for s in candidates}
        for request_id, num_tokens in planner([w for w in work if w[2] > 0]):
            seq = by_id[request_id]
            left = seq.prefill_target - _start(seq)
            if self._add_chunk(plan, seq, num_tokens) is None:
                return  # the cache is short: the rest waits, FIFO kept
            if seq.status is SeqStatus.WAITING:
                self.waiting.remove(seq)
                seq.status = SeqStatus.RUNNING
                self.running.append(seq)
                for p in partials if seq in ahead else ():
                    p.postponed_tokens += left

    def _schedule_decodes(self, plan: StepPlan) -> None:
        for seq in list(self.running):
            if seq.status is not SeqStatus.RUNNING or seq.is_prefilling:
                continue
            while not (self._own_next_block(seq, plan) and self._grow(seq, seq.num_computed_tokens + 1)):
                if self._take_back_queued(include_head=True):
                    continue
                victim = self.running[-1]
                if victim is seq and len(self.running) == 1:
                    if not self._held_while_preparing():
                        plan.full.append(seq)  # nothing else holds blocks: preempting it would only loop
                    break  # else it waits: those blocks come to the queue with their sequences, and back
                self._preempt(victim)
                plan.preempted.append(victim)
                if victim is seq:
                    break
            else:
                plan.decode.append(seq)

    def _add_chunk(self, plan: StepPlan, seq: Sequence, budget: int) -> int | None:
        """Plan the sequence's next chunk; return the budget it uses, None if it does not fit now.

        A sequence whose whole prefix is supplied (a decode engine taking over a prefilled prompt) gets a
        load-only chunk: blocks and an import, no compute, no budget.
        """
        load = seq.num_hit_tokens if seq.num_computed_tokens == 0 else 0
        start = _start(seq)
        num = min(budget, seq.prefill_target - start)
        if num > 0 and not self._own_next_block(seq, plan):  # a forked choice recomputing into a shared block
            return None
        if num <= 0:
            if load <= 0 or load < seq.prefill_target or not self._grow(seq, load + 1):
                return None
            plan.prefill.append(
                PrefillChunk(seq=seq, start=load, num_tokens=0, load_tokens=load, sample=False)
            )
            return 0
        if not self._grow(seq, start + num):
            free_tokens = (len(seq.block_ids) + self.allocator.num_free_blocks) * self.block_size - start
            num = min(num, free_tokens)
            if num <= 0 or not self._grow(seq, start + num):
                return None
        sample = start + num == seq.prefill_target and not seq.output_token_ids
        plan.prefill.append(
            PrefillChunk(seq=seq, start=start, num_tokens=num, load_tokens=load, sample=sample)
        )
        return num


def waiting_prefill(seq: Sequence) -> WaitingPrefill:
    """A queued or partly prefilled sequence as the shortest-first order sees it."""
    left = seq.prefill_target - _start(seq)
    return WaitingPrefill(left, seq.prefill_target - seq.num_hit_tokens, seq.postponed_tokens)


def _start(seq: Sequence) -> int:
    """The first token the sequence's next chunk computes (loaded prefix tokens are not computed)."""
    load = seq.num_hit_tokens if seq.num_computed_tokens == 0 else 0
    return max(seq.num_computed_tokens, load)
