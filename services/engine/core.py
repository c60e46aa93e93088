"""Engine core: admit tasks, run steps (schedule -> execute -> apply), emit token batches.

One asyncio task runs the step loop; model compute happens in the runner's worker thread, so the event loop
keeps serving tasks, aborts and load reports while a step computes. Aborts and deadlines are applied between
steps, in one place (`_apply_aborts`). Tokens of one step go out as one `TokenBatch` per router.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from gpu.runner import DecodeSeq, ModelRunner, PrefillSeq, SamplingOptions
from services.engine import metrics
from services.engine.config import EngineConfig
from services.engine.connector import KvConnector, NullConnector
from services.engine.scheduler import EngineScheduler, StepPlan, blocks_for
from services.engine.sequence import SeqStatus, Sequence
from services.engine.stopping import check_stop
from shared.errors import ContextLengthExceededError, InvalidRequestError, KvpathError, OverloadedError
from shared.protocol import GenerateTask, TaskAck, TokenBatch, TokenDelta

log = logging.getLogger(__name__)

Publish = Callable[[str, TokenBatch], Awaitable[None]]
Outgoing = tuple[str, TokenDelta]  # (router id, delta)

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
        self.publish = publish
        self.connector = connector or NullConnector()
        self.scheduler = EngineScheduler(
            runner.kv,
            block_size=runner.block_size,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
        )
        self.seqs: dict[str, Sequence] = {}
        self.preparing: dict[str, asyncio.Task[None]] = {}
        self._aborts: dict[str, str] = {}
        self._wake = asyncio.Event()
        self.is_idle = asyncio.Event()  # no request in the engine (drain waits on it)
        self.is_idle.set()
        self.step_count = 0
        self._final_waits: dict[str, Awaitable[None]] = {}  # last deltas that wait for the connector
        self._background: set[asyncio.Task[None]] = set()
        self.is_draining = False

    # ------------------------------------------------------------------------------------- admission

    def submit(self, task: GenerateTask) -> TaskAck:
        """Validate and queue a task; the ack says whether the engine took it."""
        try:
            seq = self._admit(task)
        except KvpathError as exc:
            return TaskAck(request_id=task.request_id, accepted=False, code=exc.code, message=exc.message)
        self.seqs[seq.request_id] = seq
        self.is_idle.clear()
        prep = asyncio.create_task(self._prepare(seq), name=f"prepare:{seq.request_id}")
        self.preparing[seq.request_id] = prep
        return TaskAck(request_id=task.request_id, accepted=True)

    def _admit(self, task: GenerateTask) -> Sequence:
        spec = self.runner.spec
        if self.is_draining:
            raise OverloadedError(f"engine {self.engine_id} is draining")
        if task.request_id in self.seqs:
            raise InvalidRequestError(f"duplicate request id {task.request_id}", param="request_id")
        if len(self.seqs) >= self.config.max_waiting + self.config.max_num_seqs:
            raise OverloadedError(f"engine {self.engine_id} has {len(self.seqs)} requests queued")
        n = len(task.prompt_token_ids)
        if n == 0 or n + task.sampling.max_tokens > spec.max_model_len:
            raise ContextLengthExceededError(
                f"prompt of {n} tokens + max_tokens {task.sampling.max_tokens} exceeds the context of "
                f"{spec.max_model_len}",
                param="max_tokens",
            )
        if max(task.prompt_token_ids) >= spec.vocab_size or min(task.prompt_token_ids) < 0:
            raise InvalidRequestError("prompt token id outside the vocabulary", param="prompt")
        if blocks_for(n + 1, self.runner.block_size) > self.runner.kv.num_blocks:
            raise ContextLengthExceededError(
                f"prompt of {n} tokens does not fit this engine's KV cache", param="prompt"
            )
        return Sequence(
            request_id=task.request_id,
            router_id=task.router_id,
            prompt_token_ids=list(task.prompt_token_ids),
            sampling=task.sampling,
            deadline_unix_s=task.deadline_unix_s,
            arrived_at=time.monotonic(),
            kv_plan=task.kv,
        )

    async def _prepare(self, seq: Sequence) -> None:
        """Let the connector fetch the stored prefix, then queue the sequence for scheduling."""
        started = time.monotonic()
        try:
            await self.connector.prepare(seq)
        except Exception:  # a failed load is a miss, never a failed request
            log.exception("kv prepare failed request_id=%s; recomputing", seq.request_id)
            seq.num_hit_tokens = 0
        finally:
            self.preparing.pop(seq.request_id, None)
        seq.timings["load_s"] = time.monotonic() - started
        if seq.status is SeqStatus.FINISHED or seq.request_id not in self.seqs:
            self.connector.release(seq)
            return
        self.scheduler.add(seq)
        self._wake.set()

    def abort(self, request_id: str, reason: str = "abort") -> None:
        if request_id in self.seqs:
            self._aborts[request_id] = reason
            self._wake.set()

    # -------------------------------------------------------------------------------------- the loop

    async def run(self) -> None:
        while True:
            out = self._apply_aborts()
            plan = self.scheduler.schedule()
            if plan.is_empty:
                await self._flush(out)
                self._wake.clear()
                if not self._aborts:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._wake.wait(), IDLE_RECHECK_S)
                continue
            for seq in plan.preempted:
                self.connector.release(seq)
            try:
                tokens = await self._execute(plan)
            except Exception as exc:
                log.exception("step failed engine=%s", self.engine_id)
                out += self._fail_plan(plan, exc)
            else:
                out += self._apply(plan, tokens)
            self.step_count += 1
            await self._flush(out)

    def _apply_aborts(self) -> list[Outgoing]:
        now = time.time()
        for seq in self.seqs.values():
            if seq.deadline_unix_s < now and seq.request_id not in self._aborts:
                self._aborts[seq.request_id] = "deadline"
        out: list[Outgoing] = []
        for request_id, reason in self._aborts.items():
            seq = self.seqs.get(request_id)  # type: ignore[assignment]
            if seq is None:
                continue
            if reason == "deadline":
                seq.error_code, seq.error_message = (
                    "deadline_exceeded",
                    "request deadline passed in the engine",
                )
                out.append(self._finish(seq, "error"))
            else:
                self._finish(seq, "abort")  # the router asked: it expects nothing more
                wait = self._final_waits.pop(seq.request_id, None)
                if wait is not None:
                    self._spawn(_drain(wait))
        self._aborts.clear()
        return out

    async def _execute(self, plan: StepPlan) -> dict[str, int]:
        sampled: dict[str, int] = {}
        started = time.perf_counter()
        if plan.prefill:
            pseqs = [
                PrefillSeq(
                    seq_id=c.seq.request_id,
                    block_ids=c.seq.block_ids,
                    num_cached_tokens=c.start,
                    token_ids=c.seq.token_ids(c.start, c.start + c.num_tokens),
                    sample=c.sample,
                    sampling=_sampling(c.seq),
                    banned_token_ids=self._banned(c.seq),
                )
                for c in plan.prefill
            ]
            out = await self.runner.prefill(pseqs, self.connector.layer_hook(plan.prefill))
            sampled.update({p.seq_id: t for p, t in zip(pseqs, out, strict=True) if t is not None})
            metrics.PREFILL_STEP.observe(time.perf_counter() - started)
            metrics.PREFILL_TOKENS.inc(sum(c.num_tokens for c in plan.prefill))
        if plan.decode:
            t0 = time.perf_counter()
            dseqs = [
                DecodeSeq(
                    seq_id=s.request_id,
                    block_ids=s.block_ids,
                    num_cached_tokens=s.num_computed_tokens,
                    token_id=s.output_token_ids[-1],
                    sampling=_sampling(s),
                    banned_token_ids=self._banned(s),
                )
                for s in plan.decode
            ]
            out_ids = await self.runner.decode(dseqs)
            sampled.update({d.seq_id: t for d, t in zip(dseqs, out_ids, strict=True)})
            metrics.DECODE_STEP.observe(time.perf_counter() - t0)
            metrics.BATCH_SIZE.observe(len(plan.decode))
        return sampled

    def _banned(self, seq: Sequence) -> list[int]:
        if len(seq.output_token_ids) >= seq.sampling.min_tokens:
            return []
        eos = [] if seq.sampling.ignore_eos else list(self.runner.spec.eos_token_ids)
        return eos + list(seq.sampling.stop_token_ids)

    def _apply(self, plan: StepPlan, sampled: dict[str, int]) -> list[Outgoing]:
        touched: list[Sequence] = []
        for chunk in plan.prefill:
            if chunk.load_tokens:
                chunk.seq.num_cached_tokens = chunk.load_tokens
            chunk.seq.num_computed_tokens = chunk.start + chunk.num_tokens
            touched.append(chunk.seq)
        for seq in plan.decode:
            seq.num_computed_tokens += 1
            touched.append(seq)
        self.connector.after_step(touched)
        out: list[Outgoing] = []
        for seq in touched:
            token = sampled.get(seq.request_id)
            if token is None or seq.status is SeqStatus.FINISHED:
                continue
            if not seq.output_token_ids:
                seq.timings["first_token_s"] = time.monotonic() - seq.arrived_at
            emit, reason = check_stop(
                seq, token, self.runner.spec.eos_token_ids, self.runner.spec.max_model_len
            )
            if emit:
                seq.output_token_ids.append(token)
                seq.unsent_token_ids.append(token)
            out.append(self._finish(seq, reason) if reason else self._delta(seq))
        return out

    def _fail_plan(self, plan: StepPlan, exc: Exception) -> list[Outgoing]:
        seqs = {c.seq.request_id: c.seq for c in plan.prefill} | {s.request_id: s for s in plan.decode}
        out = []
        for seq in seqs.values():
            seq.error_code, seq.error_message = (
                "engine_failed",
                f"model step failed: {type(exc).__name__}: {exc}",
            )
            out.append(self._finish(seq, "error"))
        return out

    def _finish(self, seq: Sequence, reason: str) -> Outgoing:
        self.scheduler.finish(seq, reason)
        self.seqs.pop(seq.request_id, None)
        if not self.seqs:
            self.is_idle.set()
        prep = self.preparing.pop(seq.request_id, None)
        if prep is not None:
            prep.cancel()
        self.connector.release(seq)
        wait = self.connector.finish(seq)
        if wait is not None:
            self._final_waits[seq.request_id] = wait
        self.runner.release(seq.request_id)
        metrics.REQUESTS.labels(reason).inc()
        return self._delta(seq)

    def _delta(self, seq: Sequence) -> Outgoing:
        delta = TokenDelta(
            request_id=seq.request_id,
            seq=seq.next_delta_seq,
            token_ids=seq.unsent_token_ids,
            finish_reason=seq.finish_reason if seq.status is SeqStatus.FINISHED else None,
        )
        if seq.next_delta_seq == 0:
            delta.prompt_tokens = seq.num_prompt_tokens
            delta.cached_tokens = seq.num_cached_tokens
            delta.timings = seq.timings
        if delta.finish_reason == "error":
            delta.error_code, delta.error_message = seq.error_code, seq.error_message
        seq.unsent_token_ids = []
        seq.next_delta_seq += 1
        return seq.router_id, delta

    async def _flush(self, out: list[Outgoing]) -> None:
        by_router: dict[str, list[TokenDelta]] = defaultdict(list)
        for router_id, delta in out:
            wait = self._final_waits.pop(delta.request_id, None) if delta.finish_reason else None
            if wait is None:
                by_router[router_id].append(delta)
            else:  # the last delta goes out once the connector is done (e.g. blocks durable)
                self._spawn(self._publish_after(wait, router_id, delta))
        for router_id, deltas in by_router.items():
            await self._publish(router_id, deltas)

    async def _publish(self, router_id: str, deltas: list[TokenDelta]) -> None:
        batch = TokenBatch(engine_id=self.engine_id, step=self.step_count, deltas=deltas)
        try:
            await self.publish(router_id, batch)
        except Exception as exc:  # the router notices the gap or the silence
            log.warning("token publish failed router=%s: %r", router_id, exc)

    async def _publish_after(self, wait: Awaitable[None], router_id: str, delta: TokenDelta) -> None:
        try:
            await wait
        except Exception:
            log.exception("finish wait failed request_id=%s", delta.request_id)
        await self._publish(router_id, [delta])

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def close(self) -> None:
        """Wait (bounded by the caller) for deferred last deltas, then cancel what is left."""
        if self._background:
            await asyncio.wait(set(self._background), timeout=5.0)
        for task in list(self._background) + list(self.preparing.values()):
            task.cancel()

    # --------------------------------------------------------------------------------------- reports

    def load(self) -> dict[str, Any]:
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting) + len(self.preparing),
            "unfinished_tokens": sum(s.num_tokens for s in self.seqs.values()),
            "free_kv_blocks": self.runner.kv.num_free_blocks,
            "total_kv_blocks": self.runner.kv.num_blocks,
        }


async def _drain(wait: Awaitable[None]) -> None:
    await wait


def _sampling(seq: Sequence) -> SamplingOptions:
    s = seq.sampling
    return SamplingOptions(temperature=s.temperature, top_p=s.top_p, seed=s.seed)
