"""Deadlines for every wait of the data plane: asyncio timeouts reported as DeadlineExceededError."""

from __future__ import annotations

import asyncio
from types import TracebackType

from shared.errors import DeadlineExceededError


class deadline:
    """Run the body within `timeout_s`; past it, raise DeadlineExceededError naming `what`.

    A class rather than an asynccontextmanager: it sits on every write and wait (hot path).
    """

    __slots__ = ("_timeout", "timeout_s", "what")

    def __init__(self, timeout_s: float, what: str) -> None:
        if not timeout_s > 0:
            raise DeadlineExceededError(
                f"{what}: timeout_s must be > 0, got {timeout_s!r}", param="timeout_s"
            )
        self.timeout_s = timeout_s
        self.what = what
        self._timeout: asyncio.Timeout | None = None

    async def __aenter__(self) -> None:
        self._timeout = asyncio.timeout(self.timeout_s)
        await self._timeout.__aenter__()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        assert self._timeout is not None
        try:
            await self._timeout.__aexit__(exc_type, exc, tb)
        except TimeoutError:
            raise DeadlineExceededError(f"{self.what}: not done within {self.timeout_s:g} s") from None
