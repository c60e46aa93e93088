"""Engine core: admit tasks, run steps (schedule -> execute -> apply), emit token batches.

One asyncio task runs the step loop; model compute happens in the runner's worker thread, so the event loop
keeps serving tasks, aborts and load reports while a step computes. Aborts and deadlines are applied between
steps, in one place (`_apply_aborts`), and a request leaves in one place (`_finish`). Tokens of one step go
out as one `TokenBatch` per router.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from gpu.grammar import GrammarCompiler
from gpu.runner import DecodeSeq, ModelRunner, PrefillSeq
from services.engine import choices, metrics, tracing
from services.engine.admission import check_kv_plan, check_pinned, check_prompt, check_room
from services.engine.config import EngineConfig
from services.engine.connector import KvConnector, NullConnector
from services.engine.load_state import PrefillRates, engine_load
from services.engine.outbox import Outgoing, Publish, TokenOutbox
from services.engine.sampling import banned_token_ids, new_sequence, sampling_options
from services.engine.scheduler import EngineScheduler, PrefillChunk, StepPlan
from services.engine.sequence import SeqStatus, Sequence
from services.engine.slo_order import configure_scheduler
from services.engine.step_budget import quota_planner
from services.engine.step_faults import retry_alone
from services.engine.stopping import check_stop
from services.policy.quota import RateMeter
from shared.errors import KvpathError, OverloadedError
from shared.hashing import fingerprint_seed
from shared.protocol import KvFormat, TaskAck, TokenDelta
from shared.protocol.tasks import Task

log = logging.getLogger(__name__)


IDLE_RECHECK_S = 1.0  # an idle engine still re-checks deadlines this often


class EngineCore:
    def __init__(
        self,
        config: EngineConfig,
        runner: ModelRunner,
        engine_id: str,
        publish: Publish,
        connector: KvConnector | None = None,
    ) -> None:
        self.config = config
        self.runner = runner
        self.engine_id = engine_id
        self.connector = connector or NullConnector()
        self.kv_format = KvFormat(
            fingerprint=runner.fingerprint,
            block_size=runner.block_size,
            bytes_per_token=runner.kv_bytes_per_token,
        )
        self._seed = fingerprint_seed(runner.fingerprint)
        self.quota = quota_planner(config, runner)
        self.seqs: dict[str, Sequence] = {}  # every request in the engine, the one owner of its state
        self.scheduler = EngineScheduler(
            self.connector.block_allocator(runner.kv),
            block_size=runner.block_size,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            prefill_planner=self.quota.plan if self.quota is not None else None,
            engine_seqs=self.seqs,
        )
        self._wake = asyncio.Event()
        self.is_idle = asyncio.Event()  # no request in the engine (drain waits on it)
        self.is_idle.set()
        self.step_count = 0
        self.prefill_rates = PrefillRates()  # prompt and compute tokens per second (load_state.py)
        self.step_rate = RateMeter()  # decoding steps per second of the loop (load_state.py)
        configure_scheduler(self.scheduler, config, self.quota, self.prefill_rates.compute)
        self.outbox = TokenOutbox(engine_id, publish)
        self.grammars = GrammarCompiler(runner.tokenizer)
        self.is_draining = False

    # ------------------------------------------------------------------------------------- admission

    def submit(self, task: Task, *, trace_parent: Any = None) -> TaskAck:
        """Validate a task, let the connector take its part, start it; the ack says whether the engine took
        it (a decode engine's names the buffer its prefill engine writes into). `trace_parent`: the trace
        context that came with the task (the request's spans hang off it)."""
        try:
            seq = self.admit(task)
            buffer = self.connector.accept(seq, task)
        except KvpathError as exc:
            return TaskAck(request_id=task.request_id, accepted=False, code=exc.code, message=exc.message)
        tracing.attach(seq, trace_parent)
        self.start(seq)
        return TaskAck(request_id=task.request_id, accepted=True, buffer=buffer)

    def admit(self, task: Task) -> Sequence:
        """A new sequence for a task, or a KvpathError saying why the engine cannot take it."""
        plan = task.plan
        if self.is_draining:
            raise OverloadedError(f"engine {self.engine_id} is draining")
        room = self.config.max_waiting + self.config.max_num_seqs - len(self.seqs)
        num_choices = check_room(plan, self.seqs, room=room, connector=self.connector)  # choices.py
        spec, block_size = self.runner.spec, self.runner.block_size
        # first: a prompt too long for the cache beside a holder's pinned chunks fits another engine's
        check_pinned(plan, block_size=block_size, num_kv_blocks=self.runner.kv.num_blocks,
                     pinned_blocks=self.connector.pinned_blocks())  # fmt: skip
        check_prompt(plan, max_model_len=spec.max_model_len, vocab_size=spec.vocab_size,
                     block_size=block_size, num_kv_blocks=self.runner.kv.num_blocks)  # fmt: skip
        check_kv_plan(plan, block_size=block_size, seed=self._seed)
        seq = new_sequence(plan, spec.vocab_size, self.grammars)
        seq.pending_choices = [
            new_sequence(plan.choice(i), spec.vocab_size, self.grammars, seq) for i in range(1, num_choices)
        ]
        return seq

    def start(self, seq: Sequence) -> None:
        """Take the admitted sequence: let the connector load its external KV, then schedule it."""
        self.seqs[seq.request_id] = seq
        self.seqs.update((c.request_id, c) for c in seq.pending_choices)  # aborts find them before the fork
        self.is_idle.clear()
        seq.prepare_task = asyncio.create_task(self._prepare(seq), name=f"prepare:{seq.request_id}")

    async def _prepare(self, seq: Sequence) -> None:
        """Let the connector fetch the stored prefix, then queue the sequence for scheduling."""
        started = time.monotonic()
        try:
            with tracing.kv_span(seq, self.config.role):
                await self.connector.load(seq)
        except KvpathError as exc:
            seq.error_code, seq.error_message = exc.code, exc.message
        except Exception as exc:
            log.exception("kv load failed request_id=%s", seq.request_id)
            seq.error_code, seq.error_message = "internal_error", f"{type(exc).__name__}: {exc}"
        finally:
            seq.prepare_task = None
        seq.timings.setdefault("read_s", time.monotonic() - started)
        if seq.status is SeqStatus.FINISHED or seq.request_id not in self.seqs:
            self.connector.release(seq)  # it left while loading: drop what the load got
            return
        if seq.error_code:
            await self.outbox.flush([self._finish(seq, "error")])
            return
        if seq.finish_reason and not choices.pending(seq):  # its PE's first token ended it (choices.py)
            self._finish_silently(seq, seq.finish_reason)
            return
        seq.timings["queued_at"] = time.monotonic()
        tracing.queued(seq, self.config.role)
        self.scheduler.add(seq, first=seq.num_preemptions > 0)
        self._wake.set()

    def _preempted(self, plan: StepPlan) -> None:
        """Preempted sequences recompute, or first reload what their connector stored (reloads_preempted)."""
        for i, seq in enumerate(plan.preempted):
            self.connector.release(seq)
            metrics.PREEMPTIONS.labels("queued" if i < plan.num_taken_back else "running").inc()
            if self.connector.reloads_preempted:
                self.scheduler.withdraw(seq)
                seq.prepare_task = asyncio.create_task(self._prepare(seq), name=f"reload:{seq.request_id}")

    def abort(self, request_id: str, reason: str = "abort") -> None:
        seq = self.seqs.get(request_id)
        if seq is not None:
            seq.abort_reason = reason
            self._wake.set()

    # -------------------------------------------------------------------------------------- the loop

    async def run(self) -> None:
        while True:
            out = self._apply_aborts()
            plan = self.scheduler.schedule()
            out += [self._finish(seq, "length") for seq in plan.full]  # the cache is its whole context
            self._preempted(plan)
            if plan.is_empty:
                await self.outbox.flush(out)
                if plan.full or plan.preempted:
                    continue  # blocks came free: queued requests may start now
                self._wake.clear()
                if not any(s.abort_reason for s in self.seqs.values()):
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._wake.wait(), IDLE_RECHECK_S)
                continue
            if plan.copies:  # copy-on-write of shared blocks, before the step writes into the copies
                await self.runner.copy_blocks(plan.copies)
            try:
                tokens = await self._execute(plan)
            except Exception as exc:  # find the sequence(s) at fault: only they fail (step_faults.py)
                log.exception("step failed engine=%s", self.engine_id)
                plan, tokens, failed = await retry_alone(self._execute, plan, exc, self.config.role)
                out += [self._finish(seq, "error") for seq in failed]
            out += self._apply(plan, tokens)
            self.step_count += 1
            self.outbox.step = self.step_count
            await self.outbox.flush(out)

    def _apply_aborts(self) -> list[Outgoing]:
        """Requests past their deadline fail (the router hears why); aborted ones end silently (the router
        asked: it expects nothing more)."""
        now = time.time()
        out: list[Outgoing] = []
        for seq in [s for s in self.seqs.values() if s.abort_reason or s.deadline_unix_s < now]:
            if seq.error_code:  # a choice whose choice 0 failed before the fork (services/engine/choices.py)
                out.append(self._finish(seq, "error"))
                continue
            if seq.abort_reason and seq.abort_reason != "deadline":
                self._finish_silently(seq, "abort")
                continue
            seq.error_code, seq.error_message = "deadline_exceeded", "request deadline passed in the engine"
            out.append(self._finish(seq, "error"))
        return out

    async def _execute(self, plan: StepPlan) -> dict[Sequence, int]:
        started = time.perf_counter()
        sampled: dict[Sequence, int] = {}
        loads = [c for c in plan.prefill if c.num_tokens == 0]
        if loads:  # prompts prefilled elsewhere: import their KV, nothing to compute
            self.connector.import_prefilled(loads)
        computed = [c for c in plan.prefill if c.num_tokens > 0]
        if computed:
            sampled.update(await self._prefill(computed))
        if plan.decode:
            sampled.update(await self._decode(plan.decode))
            self.step_rate.add(1, time.perf_counter() - started)  # a decoding step: its prefill chunks too
        return sampled

    async def _prefill(self, computed: list[PrefillChunk]) -> dict[Sequence, int]:
        started = time.perf_counter()
        waiting = [choices.pending(c.seq) if c.sample else [] for c in computed]  # first tokens sampled now
        pseqs = [
            PrefillSeq(
                seq_id=c.seq.request_id,
                block_ids=c.seq.block_ids,
                num_cached_tokens=c.start,
                token_ids=c.seq.token_ids(c.start, c.start + c.num_tokens),
                sample=c.sample,
                sampling=sampling_options(c.seq),
                banned_token_ids=banned_token_ids(c.seq, self.runner.spec.eos_token_ids),
                prefix=self.connector.attention_prefix(c.seq),
                forks=[sampling_options(x) for x in forks],
            )
            for c, forks in zip(computed, waiting, strict=True)
        ]
        out = await self.runner.prefill(pseqs, self.connector.layer_hook(computed))
        elapsed = time.perf_counter() - started
        num_tokens = sum(c.num_tokens for c in computed)
        if self.quota is not None:
            pairs = [(c.start, c.num_tokens) for c in computed]
            self.quota.observe(pairs, elapsed / self.runner.spec.num_layers)
            metrics.PREFILL_PREDICTED.observe(self.quota.last_predicted_s)
        metrics.PREFILL_STEP.observe(elapsed)
        metrics.PREFILL_BATCH_SIZE.observe(len(computed))
        metrics.PREFILL_TOKENS.inc(num_tokens)
        self.prefill_rates.count(num_tokens, sum(c.load_tokens for c in computed), elapsed)
        sampled = {c.seq: t for c, t in zip(computed, out, strict=True) if t is not None}
        for forks, p in zip(waiting, pseqs, strict=True):  # the other choices' first tokens (choices.py)
            sampled.update(zip(forks, p.fork_token_ids, strict=True))
        return sampled

    async def _decode(self, seqs: list[Sequence]) -> dict[Sequence, int]:
        started = time.perf_counter()
        dseqs = [
            DecodeSeq(
                seq_id=s.request_id,
                block_ids=s.block_ids,
                num_cached_tokens=s.num_computed_tokens,
                token_id=s.output_token_ids[-1],
                sampling=sampling_options(s),
                banned_token_ids=banned_token_ids(s, self.runner.spec.eos_token_ids),
                prefix=self.connector.attention_prefix(s),
            )
            for s in seqs
        ]
        out = await self.runner.decode(dseqs)
        metrics.DECODE_STEP.observe(time.perf_counter() - started)
        metrics.BATCH_SIZE.observe(len(seqs))
        return dict(zip(seqs, out, strict=True))

    def _apply(self, plan: StepPlan, sampled: dict[Sequence, int]) -> list[Outgoing]:
        touched: list[Sequence] = []
        for chunk in plan.prefill:
            if chunk.seq.trace is not None:
                tracing.prefill_chunk(chunk)
            if chunk.load_tokens and not chunk.seq.num_preemptions:  # usage: hits, not its own reloads
                chunk.seq.num_cached_tokens = chunk.load_tokens
            chunk.seq.num_computed_tokens = chunk.start + chunk.num_tokens
            touched.append(chunk.seq)
        for seq in plan.decode:
            seq.num_computed_tokens += 1
            touched.append(seq)
        self.connector.save(touched)
        touched += choices.fork(plan.prefill, sampled, self.scheduler, self.connector)
        for seq in [s for s in touched if s.finish_reason and s.status is not SeqStatus.FINISHED]:
            self._finish_silently(seq, seq.finish_reason or "stop")  # ended on its PE; its choices forked
        out: list[Outgoing] = []
        for seq in touched:
            if seq.status is SeqStatus.FINISHED:
                continue
            error = self.connector.failure(seq)
            if error is not None:
                seq.error_code, seq.error_message = error.code, error.message
                out.append(self._finish(seq, "error"))
                continue
            token = sampled.get(seq)
            if token is not None:
                out.append(self._emit(seq, token))
        return out

    def _emit(self, seq: Sequence, token: int) -> Outgoing:
        """A newly sampled token: its delta, or the last one when it ends the request here."""
        if not seq.output_token_ids:
            now = time.monotonic()
            seq.timings["first_token_s"] = now - seq.arrived_at
            if self.config.role != "decode":  # queued to first token: queueing and the prefill's compute
                seq.timings["prefill_s"] = now - seq.timings.get("queued_at", seq.arrived_at)
            tracing.first_token(seq, self.config.role)
        spec = self.runner.spec
        emit, reason = check_stop(seq, token, spec.eos_token_ids, spec.max_model_len)
        logprobs = seq.sampled_logprobs.pop() if seq.sampled_logprobs else None
        if emit:
            seq.output_token_ids.append(token)
            seq.unsent_token_ids.append(token)
            if logprobs is not None:
                seq.unsent_logprobs.append(logprobs)
        if reason is None and seq.grammar is not None and seq.grammar.is_stopped:
            reason = "stop"  # the grammar is complete: nothing but EOS could follow
        if reason is None and self.config.role == "prefill":
            reason = "handoff"  # the decode engine takes it from here
        return self._finish(seq, reason) if reason else self._delta(seq)

    def _finish(self, seq: Sequence, reason: str) -> Outgoing:
        """The request leaves the engine: everything held for it is released here, and only here."""
        seq.finish_reason = seq.finish_reason or reason
        if seq.pending_choices and choices.orphan(seq):
            self._wake.set()
        # the connector sees the sequence before its blocks are freed (it may copy them out)
        if seq.choice_of is None:  # a choice still waiting for its fork has no connector record
            seq.final_wait = self.connector.finish(seq)
            self.connector.release(seq)
        self.scheduler.finish(seq, reason)
        self.seqs.pop(seq.request_id, None)
        if not self.seqs:
            self.is_idle.set()
        if seq.prepare_task is not None:
            seq.prepare_task.cancel()
            seq.prepare_task = None
        metrics.REQUESTS.labels(reason).inc()
        if seq.trace is not None:
            tracing.finished(seq)
        log.debug(
            "request finished request_id=%s reason=%s output_tokens=%d",
            seq.request_id, seq.finish_reason, len(seq.output_token_ids),
            extra={"request_id": seq.request_id},
        )  # fmt: skip
        return self._delta(seq)

    def _finish_silently(self, seq: Sequence, reason: str) -> None:
        """Finish without a delta (nobody expects one); connector waits still run to completion."""
        self._finish(seq, reason)
        self.outbox.run_detached(seq.final_wait)
        seq.final_wait = None

    def _delta(self, seq: Sequence) -> Outgoing:
        finish = seq.finish_reason if seq.status is SeqStatus.FINISHED else None
        delta = TokenDelta(
            request_id=seq.request_id,
            seq=seq.next_delta_seq,
            token_ids=seq.unsent_token_ids,
            finish_reason=None if finish == "handoff" else finish,
            handoff=finish == "handoff",
            logprobs=seq.unsent_logprobs,
        )
        seq.unsent_logprobs = []
        if seq.next_delta_seq == 0:
            delta.prompt_tokens = seq.num_prompt_tokens
            delta.cached_tokens = seq.num_cached_tokens
            delta.timings = seq.timings
        if delta.finish_reason == "error":
            delta.error_code, delta.error_message = seq.error_code, seq.error_message
            delta.error_engine = seq.error_engine
        seq.unsent_token_ids = []
        seq.next_delta_seq += 1
        return seq.router_id, delta, seq.final_wait if finish is not None else None

    async def close(self) -> None:
        """Wait (bounded) for deferred last deltas, then cancel what is left."""
        await self.outbox.close()
        for seq in self.seqs.values():
            if seq.prepare_task is not None:
                seq.prepare_task.cancel()

    # --------------------------------------------------------------------------------------- reports

    def load(self) -> dict[str, Any]:
        """What the engine's load report and health state say of its requests and cache (load_state.py)."""
        seqs, kv = self.seqs.values(), self.runner.kv
        load = engine_load(seqs, self.scheduler, kv, self.prefill_rates, self.step_rate)
        return {**load, "prefill_order": self.config.prefill_order}
