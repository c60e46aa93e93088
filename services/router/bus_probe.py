"""Is the router's bus carrying messages? A message the router sends itself through the nats-server.

The router takes an engine whose load reports stopped for its death and fails its streams. When the bus
itself stops (the connection dropped, or the server is frozen or cut off: the connection stays up and nothing
moves), every engine falls silent at once while they decode on; the router must not fail every stream for
that. Every watch period it publishes a numbered message on its own `ping.<router>` subject and waits for it
to come back; one that does not within the period puts the engines' silence on hold until one does
(`EngineTable.bus_down` / `bus_up`).

Not nats-py's `flush()`: a flush that times out leaves its PONG's future cancelled in the client, and the
late PONG then raises in the client's read loop, which stops reading for good (nats-py 2.16; a frozen
server did exactly that to the router).
"""

from __future__ import annotations

import asyncio

from nats.aio.msg import Msg

from shared.bus import Bus


class BusProbe:
    def __init__(self, bus: Bus, service_id: str) -> None:
        self.bus = bus
        self.subject = bus.subjects.ping(service_id)
        self._waiting: dict[bytes, asyncio.Future[None]] = {}  # probe number -> its echo
        self._num_sent = 0

    async def start(self) -> None:
        await self.bus.subscribe_raw(self.subject, self._on_echo)

    async def _on_echo(self, msg: Msg) -> None:
        echo = self._waiting.pop(msg.data, None)
        if echo is not None and not echo.done():
            echo.set_result(None)

    async def round_trip(self, timeout_s: float) -> bool:
        """Whether a message to itself came back within `timeout_s` (False at once while disconnected)."""
        if not self.bus.is_connected.is_set():
            return False
        self._num_sent += 1
        key = str(self._num_sent).encode()
        echo = self._waiting[key] = asyncio.get_running_loop().create_future()
        try:
            await asyncio.wait_for(self._send(key, echo), timeout_s)
        except Exception:  # timed out, or the publish failed: the bus is not carrying messages
            return False
        finally:
            self._waiting.pop(key, None)
        return True

    async def _send(self, key: bytes, echo: asyncio.Future[None]) -> None:
        await self.bus.publish_bytes(self.subject, key)
        await echo
