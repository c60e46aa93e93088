"""The `n` choices of one request: their pieces merged into one stream, in arrival order (pure asyncio)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

from services.router.core import Piece

_DONE = object()


async def merged_pieces(generators: list[AsyncGenerator[Piece]]) -> AsyncGenerator[tuple[int, Piece]]:
    """(choice index, piece) from every generator as they come. One choice failing fails the request (its
    error is raised here); closing this iterator cancels the readers (the caller closes the generators,
    which aborts their engine requests)."""
    if len(generators) == 1:
        async for piece in generators[0]:
            yield 0, piece
        return
    queue: asyncio.Queue[tuple[int, object]] = asyncio.Queue()

    async def read(index: int, generator: AsyncGenerator[Piece]) -> None:
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
                assert isinstance(item, Piece)
                yield index, item
    finally:
        for reader in readers:
            reader.cancel()
        await asyncio.gather(*readers, return_exceptions=True)
