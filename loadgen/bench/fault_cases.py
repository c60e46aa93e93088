"""The faults of `kvpath bench faults`, each against a fresh `kvpath up` cluster of real processes.

Every case warms a prompt (its blocks persisted), starts streams, injects its fault, and measures what the
issue asks of it: how every stream ended (no hang), whether a request the fault did not concern failed, the
time until a new request is served again, and how many of the warm prompt's stored blocks no longer hit once
the cluster recovered (`kvpath up` restarts what was killed).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import orjson

from loadgen.bench.fault_client import StreamEnd, complete, hit_tokens, prompt, stream, until_served
from services.up.process import UpProcess
from shared.bus import Bus

BLOCK = 64
WARM_TOKENS = 6 * BLOCK + 10  # the warm prompt: 6 full blocks persisted
RECOVER_S = 120.0


@dataclass(slots=True)
class Row:
    fault: str
    expectation: str
    streams: dict[str, int] = field(default_factory=dict)  # outcome -> count
    others_failed: int = 0  # streams the fault did not concern that did not end ok
    recover_s: float = 0.0  # fault -> a new request served again
    blocks_lost: int = 0  # warm blocks that no longer hit after recovery
    passed: bool = False
    note: str = ""


@dataclass(slots=True)
class Ctx:
    """A running cluster and the warm prompt's hits before the fault."""

    up: UpProcess
    http: aiohttp.ClientSession
    tmp: Path
    warm: list[int]
    warm_cached: int = 0

    @property
    def url(self) -> str:
        return self.up.url

    def pid(self, child: str) -> int:
        return int(self.up.supervisor_state()[child]["pid"])

    def kill(self, child: str) -> float:
        os.kill(self.pid(child), signal.SIGKILL)
        return time.monotonic()


Case = Callable[[Ctx], Awaitable[Row]]


def block_files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.blk"), key=lambda p: p.stat().st_mtime)


def damage(truncated: Path, flipped: Path) -> None:
    with open(truncated, "r+b") as f:
        f.truncate(100)
    with open(flipped, "r+b") as f:
        f.seek(-64, os.SEEK_END)
        f.write(b"\xff" * 64)


async def run_case(name: str, case: Case, tmp: Path, up_args: list[str]) -> Row:
    """Start a cluster, warm it, run one case, stop the cluster; a case that raises is a failed row."""
    work = tmp / name.replace(" ", "-")
    work.mkdir(parents=True, exist_ok=True)
    up = await asyncio.to_thread(UpProcess, work, "--kv-root", str(work / "kv"), *up_args)
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
            ctx = Ctx(up, http, work, prompt(1, WARM_TOKENS))
            await complete(http, up.url, ctx.warm)  # persists the warm prompt
            ctx.warm_cached = await hit_tokens(http, up.url, ctx.warm, 6 * BLOCK, 20.0)
            try:
                return await case(ctx)
            except Exception as exc:  # the row says what broke; the other cases still run
                return Row(name, "", note=f"case failed: {type(exc).__name__}: {exc}")
    finally:
        await asyncio.to_thread(up.stop)


async def _streams_with_kill(
    ctx: Ctx, victim: str, n: int, max_tokens: int = 300
) -> tuple[list[StreamEnd], float]:
    """`n` long streams; SIGKILL `victim` once one of them streams; every stream's end, and the kill time."""
    started = asyncio.Event()
    tasks = [
        asyncio.ensure_future(stream(ctx.http, ctx.url, prompt(100 + i, 200), max_tokens, started=started))
        for i in range(n)
    ]
    await asyncio.wait_for(started.wait(), 60)
    killed_at = ctx.kill(victim)
    return list(await asyncio.gather(*tasks)), killed_at


def _count(ends: list[StreamEnd]) -> dict[str, int]:
    out: dict[str, int] = {}
    for end in ends:
        out[end.outcome] = out.get(end.outcome, 0) + 1
    return out


async def _finish(ctx: Ctx, row: Row, ends: list[StreamEnd], killed_at: float, concerned: str) -> Row:
    """Fill in outcomes, other failures (errors not naming `concerned`), recovery and lost blocks."""
    row.streams = _count(ends)
    row.others_failed = sum(
        1 for e in ends if e.outcome != "ok" and (not concerned or concerned not in e.message)
    )
    row.recover_s = await until_served(ctx.http, ctx.url, killed_at, RECOVER_S)
    cached = await hit_tokens(ctx.http, ctx.url, ctx.warm, ctx.warm_cached, 30.0)
    row.blocks_lost = max(0, (ctx.warm_cached - cached) // BLOCK)
    row.passed = "hung" not in row.streams and row.recover_s < RECOVER_S and row.blocks_lost == 0
    return row


async def colocated_engine(ctx: Ctx) -> Row:
    row = Row(
        "SIGKILL colocated engine mid-stream", "its streams end in an error event; the other engine's finish"
    )
    ends, killed_at = await _streams_with_kill(ctx, "engine0-n0", 6)
    row = await _finish(ctx, row, ends, killed_at, concerned="engine0-n0")
    row.note = f"{row.streams.get('ok', 0)} streams were on the other engine"
    row.passed = row.passed and row.others_failed == 0 and row.streams.get("ok", 0) > 0
    return row


async def service_killed(ctx: Ctx, child: str, fault: str) -> Row:
    """Streams through a fault of a service no stream depends on while it runs: none may fail."""
    row = Row(fault, "every stream finishes; hits restored after the restart")
    ends, killed_at = await _streams_with_kill(ctx, child, 4, max_tokens=120)
    row = await _finish(ctx, row, ends, killed_at, concerned="")
    row.passed = row.passed and row.others_failed == 0
    return row


async def nats_server(ctx: Ctx) -> Row:
    row = Row("SIGKILL nats-server", "streams end (error or done), none hangs; served after the restart")
    ends, killed_at = await _streams_with_kill(ctx, "nats-server", 4, max_tokens=120)
    return await _finish(ctx, row, ends, killed_at, concerned="")


async def nats_node(ctx: Ctx) -> Row:
    row = Row("SIGKILL 1 of 3 NATS servers", "every stream finishes; nothing lost")
    ends, killed_at = await _streams_with_kill(ctx, "nats-1", 4, max_tokens=120)
    row = await _finish(ctx, row, ends, killed_at, concerned="")
    row.passed = row.passed and row.others_failed == 0
    return row


async def prefill_engine(ctx: Ctx) -> Row:
    row = Row(
        "SIGKILL prefill engine mid-prefill", "its requests end in a retryable error; served after restart"
    )
    ends, killed_at = await _streams_with_kill(ctx, "pe0-n0", 4, max_tokens=60)
    return await _finish(ctx, row, ends, killed_at, concerned="pe0-n0")


async def decode_engine(ctx: Ctx) -> Row:
    row = Row("SIGKILL decode engine mid-stream", "its streams end in an error event; served after restart")
    ends, killed_at = await _streams_with_kill(ctx, "de1-n1", 4)
    return await _finish(ctx, row, ends, killed_at, concerned="de1-n1")


async def corrupt_blocks(ctx: Ctx) -> Row:
    """Truncate one warm block file and flip bytes in another: a partial miss, same tokens, re-persisted."""
    row = Row("corrupt + truncated block files", "a partial miss with identical tokens; blocks re-persisted")
    before = await stream(ctx.http, ctx.url, ctx.warm, 8)
    files = block_files(ctx.tmp / "kv")
    damage(files[0], files[-1])
    started = time.monotonic()
    after = await stream(ctx.http, ctx.url, ctx.warm, 8)
    row.streams = _count([after])
    row.others_failed = int(after.outcome != "ok" or after.tokens != before.tokens)
    row.recover_s = time.monotonic() - started
    cached = await hit_tokens(ctx.http, ctx.url, ctx.warm, ctx.warm_cached, 30.0)
    row.blocks_lost = max(0, (ctx.warm_cached - cached) // BLOCK)
    row.note = f"hit {after.cached_tokens} of {ctx.warm_cached} tokens right after the damage"
    row.passed = after.outcome == "ok" and row.blocks_lost == 0 and after.cached_tokens < ctx.warm_cached
    return row


async def garbage(ctx: Ctx) -> Row:
    """Junk and out-of-range messages on every subject of the namespace; nothing may restart or fail."""
    row = Row("garbage + out-of-range messages on every subject", "no service restarts; streams finish")
    bus = Bus(ctx.up.info["nats_url"], ctx.up.info["namespace"], name="bench-faults")
    await bus.connect()
    started = time.monotonic()
    try:
        subjects = _subjects(bus, ctx)
        bad = orjson.dumps(
            {"kind": "generate_task", "v": 2, "plan": {"request_id": "x", "router_id": "a.b.>"}}
        )
        junk = [b"\x00garbage", b"[]", b'{"kind": "token_batch", "v": 1}', bad]
        tasks = [asyncio.ensure_future(stream(ctx.http, ctx.url, prompt(300 + i, 200), 60)) for i in range(4)]
        for subject in subjects:
            for payload in junk:
                await bus.nc.publish(subject, payload)
        await bus.flush()
        ends = list(await asyncio.gather(*tasks))
    finally:
        await bus.close()
    state = ctx.up.supervisor_state()
    restarts = sum(int(s.get("restarts", 0)) for s in state.values())
    row.streams = _count(ends)
    row.others_failed = sum(1 for e in ends if e.outcome != "ok")
    row.recover_s = await until_served(ctx.http, ctx.url, started, RECOVER_S)
    row.note = f"{len(subjects)} subjects x {len(junk)} messages, {restarts} restarts"
    row.passed = row.others_failed == 0 and restarts == 0
    return row


def _subjects(bus: Bus, ctx: Ctx) -> list[str]:
    s = bus.subjects
    names = list(ctx.up.supervisor_state())
    engines = [n for n in names if "engine" in n or n.startswith(("pe", "de"))]
    out = [s.task(n) for n in engines] + [s.transfer(n) for n in engines]
    out += [s.load("colocated", "x"), s.load_storage(0), s.tokens("router-0"), s.abort, s.index_match]
    return [*out, s.index_stats, s.kv_events("storage-0"), s.storage_read(0), s.storage_write(0)]


async def poison(ctx: Ctx) -> Row:
    """Bad requests sent into a full batch of good ones: each bad one alone gets its 400."""
    row = Row("poison requests in a full batch", "each bad request alone fails (400); the batch finishes")
    started = time.monotonic()
    good = [asyncio.ensure_future(stream(ctx.http, ctx.url, prompt(400 + i, 150), 80)) for i in range(8)]
    bad_params: list[dict[str, object]] = [{"top_p": 5}, {"max_tokens": -1}, {"temperature": -5}]
    bad_params.append({"logit_bias": {"99999999": 1}})
    bad = [stream(ctx.http, ctx.url, prompt(500, 50), 8, extra=p) for p in bad_params]
    bad_ends = await asyncio.gather(*bad)
    good_ends = list(await asyncio.gather(*good))
    row.streams = _count(good_ends + list(bad_ends))
    row.others_failed = sum(1 for e in good_ends if e.outcome != "ok")
    row.recover_s = time.monotonic() - started
    row.passed = row.others_failed == 0 and all(e.status == 400 for e in bad_ends)
    row.note = f"bad requests answered {sorted({e.status for e in bad_ends})}"
    return row


CASES: list[tuple[str, Case, list[str]]] = [
    ("colocated-engine", colocated_engine, ["--engines", "2"]),
    ("storage", lambda c: service_killed(c, "storage-0", "SIGKILL storage"), []),
    ("index", lambda c: service_killed(c, "index-0", "SIGKILL index"), []),
    ("nats-server", nats_server, []),
    ("nats-node", nats_node, ["--nats-cluster", "3"]),
    ("prefill-engine", prefill_engine, ["--prefill-nodes", "1", "--decode-nodes", "1"]),
    ("decode-engine", decode_engine, ["--prefill-nodes", "1", "--decode-nodes", "1"]),
    ("corrupt-blocks", corrupt_blocks, []),
    ("garbage", garbage, []),
    ("poison", poison, []),
]
