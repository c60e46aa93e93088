"""The `n` choices of one request: one engine task for all of them, and their pieces merged into one stream,
in arrival order (pure asyncio).

With a colocated or DualPath dispatch the n choices are one engine task (`sampling.n`): the prompt is
prefilled once and forked n ways (services/engine/choices.py); choice i streams under its own request id
(`choice_request_id`) and seed (`seed + i`). Choice 0's generator plans and dispatches the task; the others
wait for that (`ChoiceGroup`), then read their own streams, so each choice still ends, fails or is aborted
alone. Other dispatches (session engines: AMPD, auto on prefill/decode nodes; move-the-query) send n tasks
of one choice each (same ids and seeds), behind a `ChoiceGate`: choices 1..n-1 are planned once choice 0's
prompt KV exists where they can load it from, instead of each computing the whole prompt.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TypeVar, cast

from services.router.kv_plan import KvPlanner
from services.router.redispatch import Redispatch
from services.router.streams import RequestStream, StreamTable
from shared.errors import EngineFailedError
from shared.protocol import KvPlan

T = TypeVar("T")

_DONE = object()
_FIRST_LOOKUP_S = 0.02  # a gate's index lookups for the prompt: the first pause between two
_LAST_LOOKUP_S = 0.2  # and the longest


@dataclass(slots=True)
class ChoiceGroup:
    """The choices of one request sent as one task. Choice 0 opens every choice's stream before dispatching
    (tokens may come before the ack) and resolves `dispatched` (its error, if dispatching failed)."""

    num_choices: int
    dispatched: asyncio.Future[None] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )
    left: set[str] = field(default_factory=set)  # choices already gone: choice 0 opens no stream for them
    first: Redispatch | None = None  # choice 0's redispatch, set at its dispatch

    def again(self, choice: int) -> Redispatch | None:
        """What sends choice `choice` again when the task is lost: each choice goes on alone, as a request
        of one choice with its own id and seed (`RequestPlan.choice`), so a migration resumes its tokens."""
        first = self.first
        return (
            None if first is None else Redispatch.of(first.plan.choice(choice), first.locality, first.limit)
        )

    def resolve(self, error: BaseException | None = None) -> None:
        if self.dispatched.done():
            return
        if error is None:
            self.dispatched.set_result(None)
            return
        self.dispatched.set_exception(error)
        self.dispatched.exception()  # retrieved: no "never retrieved" report when every other choice left

    async def join(self, streams: StreamTable, request_id: str, timeout_s: float) -> RequestStream | None:
        """Choice i > 0: its stream, once choice 0 dispatched the task (its error if that failed;
        TimeoutError past `timeout_s`: the deadline)."""
        await asyncio.wait_for(asyncio.shield(self.dispatched), max(0.0, timeout_s))
        stream = streams.get(request_id)
        if stream is None:
            raise EngineFailedError(f"the stream of {request_id} closed before its task was dispatched")
        return stream

    def dispatched_prompt(self, kv: KvPlan, locality: Mapping[str, int], index: KvPlanner) -> None:
        """(The shared task's prompt needs no gate.)"""

    def first_piece(self) -> None:
        """(Nothing waits on a shared task's first token.)"""

    def ended(self, request_id: str) -> None:
        self.left.add(request_id)


@dataclass(slots=True)
class ChoiceGate:
    """The choices of one request sent as n tasks of one choice (engines that sample one choice per task).
    Choices 1..n-1 are planned once choice 0's prompt KV is somewhere they can load it from: at choice 0's
    dispatch when it computes at most one full block of the prompt (the rest is stored or resident already),
    else once the index lists the prompt's blocks (written as choice 0's prefill fills them: looked up from
    choice 0's first token on, 20 ms apart doubling to 0.2 s), or when choice 0 ended, whatever way. Sent
    together, every choice computed the whole prompt: n = 8 of an 890-token prompt on auto's 1P1D session
    engines took 4.4x one choice's time to every first token."""

    first_id: str  # choice 0's request id
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    _stored: Callable[[], Awaitable[bool]] | None = None  # whether the index lists the prompt's blocks
    _watch: asyncio.Task[None] | None = None

    async def join(self, streams: StreamTable, request_id: str, timeout_s: float) -> RequestStream | None:
        """Choice i > 0: None once it may be planned (TimeoutError past `timeout_s`: the deadline)."""
        if not self.ready.is_set():
            await asyncio.wait_for(self.ready.wait(), max(0.0, timeout_s))
        return None

    def dispatched_prompt(self, kv: KvPlan, locality: Mapping[str, int], index: KvPlanner) -> None:
        """Choice 0 is being dispatched with this plan; `index` finds its prompt's blocks once written."""
        wanted = len(kv.block_hashes) - 1
        # without an index (no KV reuse) the prompt is never listed: waiting would only serialize the choices
        if index.index is None or max(kv.num_hit_blocks, *locality.values(), 0) >= wanted:
            self.ready.set()
            return

        async def stored() -> bool:
            return await index.num_stored(kv.block_hashes) >= wanted

        self._stored = stored

    def first_piece(self) -> None:
        if self._watch is None and not self.ready.is_set():
            self._watch = asyncio.create_task(self._watch_index(), name="choice-gate")

    def ended(self, request_id: str) -> None:
        if request_id != self.first_id:  # another choice gave up waiting (its deadline, the client gone)
            return
        self.ready.set()
        if self._watch is not None:
            self._watch.cancel()

    async def _watch_index(self) -> None:
        delay = _FIRST_LOOKUP_S
        while self._stored is not None and not await self._stored():
            await asyncio.sleep(delay)  # until choice 0 ends (`ended` cancels this)
            delay = min(2 * delay, _LAST_LOOKUP_S)
        self.ready.set()


async def merged_pieces(generators: list[AsyncGenerator[T]]) -> AsyncGenerator[tuple[int, T]]:
    """(choice index, piece) from every generator as they come. One choice failing fails the request (its
    error is raised here); closing this iterator cancels the readers (the caller closes the generators,
    which aborts their engine requests)."""
    if len(generators) == 1:
        async for piece in generators[0]:
            yield 0, piece
        return
    queue: asyncio.Queue[tuple[int, object]] = asyncio.Queue()

    async def read(index: int, generator: AsyncGenerator[T]) -> None:
        try:
            async for piece in generator:
                queue.put_nowait((index, piece))
        except Exception as exc:  # handed to the consumer, who raises it
            queue.put_nowait((index, exc))
        queue.put_nowait((index, _DONE))

    readers = [asyncio.create_task(read(i, g), name=f"choice-{i}") for i, g in enumerate(generators)]
    try:
        remaining = len(readers)
        while remaining:
            index, item = await queue.get()
            if item is _DONE:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, cast(T, item)
    finally:
        for reader in readers:
            reader.cancel()
        await asyncio.gather(*readers, return_exceptions=True)
