"""The `n` choices of one request: one engine task for all of them, and their pieces merged into one stream,
in arrival order (pure asyncio).

With a colocated or DualPath dispatch the n choices are one engine task (`sampling.n`): the prompt is
prefilled once and forked n ways (services/engine/choices.py); choice i streams under its own request id
(`choice_request_id`) and seed (`seed + i`). Choice 0's generator plans and dispatches the task; the others
wait for that (`ChoiceGroup`), then read their own streams, so each choice still ends, fails or is aborted
alone. Other dispatches send n tasks of one choice each (same ids and seeds).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import TypeVar, cast

T = TypeVar("T")

_DONE = object()


@dataclass(slots=True)
class ChoiceGroup:
    """The choices of one request sent as one task. Choice 0 opens every choice's stream before dispatching
    (tokens may come before the ack) and resolves `dispatched` (its error, if dispatching failed)."""

    num_choices: int
    dispatched: asyncio.Future[None] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )
    left: set[str] = field(default_factory=set)  # choices already gone: choice 0 opens no stream for them

    def resolve(self, error: BaseException | None = None) -> None:
        if self.dispatched.done():
            return
        if error is None:
            self.dispatched.set_result(None)
            return
        self.dispatched.set_exception(error)
        self.dispatched.exception()  # retrieved: no "never retrieved" report when every other choice left


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
