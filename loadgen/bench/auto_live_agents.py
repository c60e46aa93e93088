"""The agent configurations of `kvpath bench auto --live` (`auto_live.py` runs them per policy, ABBA).

  pd      prefill/decode nodes (`kvpath up --prefill-nodes 1 --decode-nodes 1`), `dualpath`, `ampd` (session
          decode engines, Algorithm 2 prefill order) and `auto` (session decode engines). Multi-turn agents:
          a long first context, then per turn the previous context + the model's own previous output + a
          tool result, one `X-Session-Id` per session, `pd_clients` closed-loop clients each running whole
          sessions. Score: mean session JCT (first request sent -> last response done).
  fanin   colocated engines that move the query (`--move-query`, each may hold `--hold-bytes`): one document
          pinned on a holder with the `kv_chunk` extension, then sub-agents = document + own suffix + a
          short answer, `fanin_clients` at once (0: all). Fixed `--move-query route` and `fetch` under the
          default colocated policy against `--policy auto --move-query auto`. Score: mean latency; the time
          until the last finished is kept beside it.

Each runner returns (row, number of unmeasured requests sent first): the caller reads auto's decisions from
the router's log past those.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import aiohttp
import numpy as np

from services.up.process import UpProcess

if TYPE_CHECKING:
    from loadgen.bench.auto_live_options import LiveOptions

_MIN_TOKEN, _MAX_TOKEN = 3, 250  # the tiny model's byte vocabulary
CHUNK_NAME = "bench-doc"
PIN_TIMEOUT_S = 30.0
_CHOICES = "kvpath_router_movequery_choices_total{"


@dataclass(slots=True)
class _Outcome:
    latencies_s: list[float] = field(default_factory=list)
    failed: int = 0
    errors: list[str] = field(default_factory=list)

    async def post(
        self,
        http: aiohttp.ClientSession,
        url: str,
        body: dict[str, Any],
        headers: dict[str, str] | None = None,
    ) -> dict[str, Any] | None:
        """One completion; its latency counted, a failure counted (first few kept) and None returned."""
        started = time.monotonic()
        async with http.post(f"{url}/v1/completions", json=body, headers=headers or {}) as resp:
            if resp.status != 200:
                self.failed += 1
                if len(self.errors) < 4:
                    self.errors.append(f"{resp.status} {(await resp.text())[:300]}")
                return None
            out = dict(await resp.json())
        self.latencies_s.append(time.monotonic() - started)
        return out


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(_MIN_TOKEN, _MAX_TOKEN) for _ in range(n)]


def _summary(outcome: _Outcome, wall_s: float) -> dict[str, Any]:
    lat = outcome.latencies_s or [0.0]
    return {
        "mean_latency_s": statistics.fmean(lat),
        "p90_latency_s": float(np.percentile(lat, 90)),
        "wall_s": wall_s,
        "requests": len(outcome.latencies_s),
        "failed": outcome.failed,
        "failures": outcome.errors,
    }


# ------------------------------------------------------------------------------------------------ pd


@dataclass(frozen=True, slots=True)
class AgentSession:
    session_id: str
    first_context: list[int]
    tool_results: list[list[int]]  # one per turn after the first


def agent_sessions(o: LiveOptions, count: int, prefix: str, seed: int) -> list[AgentSession]:
    rng = random.Random(seed)
    lo, hi = o.pd_tool_tokens
    out = []
    for i in range(count):
        turns = rng.randint(*o.pd_turns)
        tools = [_tokens(rng, rng.randint(lo, hi)) for _ in range(turns - 1)]
        out.append(AgentSession(f"{prefix}-{i}", _tokens(rng, o.pd_first_tokens), tools))
    return out


async def _drive_sessions(
    url: str, sessions: list[AgentSession], o: LiveOptions
) -> tuple[_Outcome, list[float]]:
    """`pd_clients` closed-loop clients, each running whole sessions; (requests, each session's JCT)."""
    queue: asyncio.Queue[AgentSession] = asyncio.Queue()
    for s in sessions:
        queue.put_nowait(s)
    outcome, jcts = _Outcome(), []
    body = {"model": "tiny", "max_tokens": o.pd_output_tokens, "ignore_eos": True, "temperature": 0}
    body["return_token_ids"] = True

    async def one(http: aiohttp.ClientSession, s: AgentSession) -> None:
        started, context = time.monotonic(), list(s.first_context)
        headers = {"X-Session-Id": s.session_id}
        for turn in range(1 + len(s.tool_results)):
            if turn > 0:
                await asyncio.sleep(o.pd_tool_latency_s)  # the tool runs
                context += s.tool_results[turn - 1]
            out = await outcome.post(http, url, {**body, "prompt": context}, headers)
            if out is None:
                return  # a failed turn ends its session (counted in `failed`, no JCT)
            context += list(out["choices"][0]["token_ids"])
        jcts.append(time.monotonic() - started)

    async def client(http: aiohttp.ClientSession) -> None:
        while not queue.empty():
            await one(http, queue.get_nowait())

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
        await asyncio.gather(*(client(http) for _ in range(o.pd_clients)))
    return outcome, jcts


def pd_args(policy: str) -> list[str]:
    return ["--prefill-nodes", "1", "--decode-nodes", "1", "--policy", policy]


def run_pd(o: LiveOptions, up: UpProcess) -> tuple[dict[str, Any], int]:
    """One warm-up session (two turns, unmeasured), then every measured session."""
    warm = agent_sessions(o, 1, "warm", o.seed + 1)[0]
    warm = AgentSession(warm.session_id, warm.first_context[:400], warm.tool_results[:1])
    asyncio.run(_drive_sessions(up.url, [warm], o))
    sessions = agent_sessions(o, o.pd_sessions, "agent", o.seed)
    started = time.monotonic()
    outcome, jcts = asyncio.run(_drive_sessions(up.url, sessions, o))
    row = _summary(outcome, time.monotonic() - started)
    row |= {"mean_session_jct_s": statistics.fmean(jcts) if jcts else float("nan"), "sessions": len(jcts)}
    return row, 2


# --------------------------------------------------------------------------------------------- fanin


FANIN_POLICIES = {"route": ("colocated", "route"), "fetch": ("colocated", "fetch"), "auto": ("auto", "auto")}


def fanin_args(o: LiveOptions, policy: str) -> list[str]:
    """Every engine may hold (only named chunks: the hold threshold is out of reach); the router's policy
    picks the engine, `--move-query` how a sub-agent uses the held document."""
    router_policy, mode = FANIN_POLICIES[policy]
    args = ["--engines", str(o.fanin_engines), "--policy", router_policy, f"--router-arg=--move-query={mode}"]
    for flag in ("--move-query", f"--hold-bytes={256 << 20}", f"--hold-min-tokens={1 << 20}"):
        args.append(f"--engine-arg={flag}")
    return args


def fanin_prompts(o: LiveOptions) -> tuple[list[int], list[list[int]]]:
    rng = random.Random(o.seed + 16)
    doc = _tokens(rng, o.fanin_doc_tokens)
    lo, hi = o.fanin_suffix_tokens
    return doc, [doc + _tokens(rng, rng.randint(lo, hi)) for _ in range(o.fanin_agents)]


async def _pin(http: aiohttp.ClientSession, url: str, doc: list[int]) -> str:
    """The document kept on a holder under CHUNK_NAME; the holder once the router lists it."""
    body = {"model": "tiny", "prompt": doc, "max_tokens": 1, "temperature": 0, "kv_chunk": CHUNK_NAME}
    async with http.post(f"{url}/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"pinning the document failed: {resp.status} {await resp.text()}")
    deadline = time.monotonic() + PIN_TIMEOUT_S
    while time.monotonic() < deadline:
        async with http.get(f"{url}/v1/kv_chunks") as resp:
            listed = [c for c in (await resp.json())["data"] if c["id"] == CHUNK_NAME]
        if listed:
            return str(listed[0]["holder"])
        await asyncio.sleep(0.05)
    raise TimeoutError(f"the pinned document was not listed within {PIN_TIMEOUT_S:.0f} s")


async def _choices(http: aiohttp.ClientSession, url: str) -> dict[str, int]:
    """The router's move-the-query choices so far, per primitive."""
    async with http.get(f"{url}/metrics") as resp:
        text = await resp.text()
    out = {}
    for line in text.splitlines():
        if line.startswith(_CHOICES):
            out[line.split('primitive="', 1)[1].split('"', 1)[0]] = int(float(line.rsplit(" ", 1)[1]))
    return out


async def _fan_in(url: str, o: LiveOptions) -> dict[str, Any]:
    doc, agents = fanin_prompts(o)
    outcome, queue = _Outcome(), asyncio.Queue[list[int]]()
    for a in agents:
        queue.put_nowait(a)
    body = {"model": "tiny", "max_tokens": o.fanin_answer_tokens, "ignore_eos": True, "temperature": 0}

    async def client(http: aiohttp.ClientSession) -> None:
        while not queue.empty():
            await outcome.post(http, url, {**body, "prompt": queue.get_nowait()})

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
        holder = await _pin(http, url, doc)
        started = time.monotonic()
        await asyncio.gather(*(client(http) for _ in range(o.fanin_clients or len(agents))))
        makespan_s = time.monotonic() - started
        choices = await _choices(http, url)
    row = _summary(outcome, makespan_s)
    return row | {"makespan_s": makespan_s, "holder": holder, "movequery_choices": choices}


def run_fanin(o: LiveOptions, up: UpProcess) -> tuple[dict[str, Any], int]:
    """The pin (unmeasured), then the sub-agents."""
    return asyncio.run(_fan_in(up.url, o)), 1
