"""Deadlines for every wait of the data plane: asyncio timeouts reported as DeadlineExceededError."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from shared.errors import DeadlineExceededError


@contextlib.asynccontextmanager
async def deadline(timeout_s: float, what: str) -> AsyncIterator[None]:
    """Run the body within `timeout_s`; past it, raise DeadlineExceededError naming `what`."""
    if not timeout_s > 0:
        raise DeadlineExceededError(f"{what}: timeout_s must be > 0, got {timeout_s!r}", param="timeout_s")
    try:
        async with asyncio.timeout(timeout_s):
            yield
    except TimeoutError:
        raise DeadlineExceededError(f"{what}: not done within {timeout_s:g} s") from None
