"""Clusters for integration and e2e tests: `kvpath up` (UpProcess) or services started one by one."""

from __future__ import annotations

import asyncio

import aiohttp

from services.up.process import ServiceProcess, ServiceStack, UpProcess
from shared.bus import Bus, Registry
from shared.protocol import ServiceInfo

__all__ = ["ServiceProcess", "Stack", "UpProcess", "router_sees", "wait_ready"]


async def wait_ready(
    bus: Bus,
    ids: set[str],
    procs: list[ServiceProcess],
    timeout_s: float = 60,
    num_engines: int | None = None,
) -> dict:
    """Every service registered as ready by a process of `procs` that still runs (a killed one's entry
    stays in the registry until its TTL: a service started again under its id is ready when the new
    process registered), and the router seeing every engine's load reports. Fails at once when one of
    `procs` exited that the test did not end itself."""
    registry: Registry[ServiceInfo] = Registry(bus, ttl_s=5.0)
    await registry.open()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    if num_engines is None:
        num_engines = sum(1 for i in ids if i.startswith("engine"))
    while True:
        alive = {p.proc.pid for p in procs if p.proc.poll() is None}
        listed = await registry.list()
        ready = {s.service_id: s for s in listed if s.status == "ready" and s.pid in alive}
        has_router = "router-0" in ids
        if ids <= ready.keys() and (
            not has_router or await router_sees(ready["router-0"].http_url, num_engines)
        ):
            return ready
        for p in procs:
            assert p.ended_on_purpose or p.proc.poll() is None, p.log()
        assert loop.time() < deadline, f"not ready: {ids - ready.keys()}"
        await asyncio.sleep(0.05)


async def router_sees(url: str, num_engines: int) -> bool:
    async with aiohttp.ClientSession() as http, http.get(f"{url}/health") as resp:
        return resp.status == 200 and (await resp.json())["engines"] >= num_engines


Stack = ServiceStack
