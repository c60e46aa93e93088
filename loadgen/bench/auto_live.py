"""The live part of `kvpath bench auto`: per configuration a real `kvpath up` cluster per policy, every policy
on the same workload, each `repeats` times in ABBA order; auto's predicted vs measured TTFT.

  pool, remote   colocated engines on a KV tier above storage: the fixed policy `kvpath up` uses there
                 (`beluga` on the pool tier, `cache-aware` on the remote-store tier, whose engines keep a
                 local DRAM cache announced as `dram:<engine>`) and `auto`. Score: mean request latency.
  pd, fanin      prefill/decode nodes with multi-turn agents (`dualpath`, `ampd`, `auto`; score: mean session
                 JCT), and a move-the-query fan-in (`route`, `fetch`, `auto`; score: mean latency):
                 `auto_live_agents.py`.

Tier workload (`tiny`): `docs` shared documents, each populated once, then `questions` questions drawn with
Zipf popularity (document + its own question tokens, short answers) sent by `clients` closed-loop clients; and
`sessions` three-turn sessions whose later turns extend the earlier ones. On colocated engines auto chooses
among the engine-resident prefix, the pool, storage on the engine's node and recomputing
(`services/router/auto_dispatch.py`). The router logs each decision at debug level with its predicted and
measured TTFT (both from dispatch); the median absolute percentage error is computed from those lines.
"""

from __future__ import annotations

import asyncio
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from loadgen.bench import auto_live_agents as agents
from loadgen.bench.auto_live_options import CONFIG_NAMES, LiveOptions
from services.up.process import UpProcess
from services.up.topology import engine_threads, fcfs_engine_args, host_cores

# per configuration its policies (the fixed ones first, auto last) and the score `results` keeps
CONFIGS = {
    "pool": ("beluga", "auto"),  # the fixed policy `kvpath up` defaults to on this tier, and auto
    "remote": ("cache-aware", "auto"),
    "pd": ("dualpath", "ampd", "auto"),
    "fanin": tuple(agents.FANIN_POLICIES),
}
assert tuple(CONFIGS) == CONFIG_NAMES
SCORES = {
    "pool": "mean_latency_s",
    "remote": "mean_latency_s",
    "pd": "mean_session_jct_s",
    "fanin": "mean_latency_s",
}
WARMUP = 24  # measured decisions before the router's TTFT calibration counts as settled
_DECISION = re.compile(
    r"auto plan .*plan=(\S+) engine=(\S+) .*predicted_ttft_s=([0-9.e+-]+) measured_ttft_s=([0-9.e+-]+)"
)
_MIN_TOKEN, _MAX_TOKEN = 3, 250  # the tiny model's byte vocabulary


def _prompts(o: LiveOptions) -> tuple[list[list[int]], list[list[int]]]:
    """(populate prompts, measured prompts): the documents once, then questions (Zipf) and session turns."""
    rng = random.Random(o.seed)
    docs = [[rng.randrange(_MIN_TOKEN, _MAX_TOKEN) for _ in range(o.doc_tokens)] for _ in range(o.docs)]
    weights = [1.0 / (i + 1) for i in range(o.docs)]
    measured = []
    for _ in range(o.questions):
        doc = rng.choices(docs, weights)[0]
        measured.append(doc + [rng.randrange(_MIN_TOKEN, _MAX_TOKEN) for _ in range(32)])
    for _ in range(o.sessions):
        context: list[int] = []
        for n in (600, 120, 120):
            context = context + [rng.randrange(_MIN_TOKEN, _MAX_TOKEN) for _ in range(n)]
            measured.append(list(context))
    return docs, measured


async def _drive(url: str, prompts: list[list[int]], clients: int, max_tokens: int) -> list[float]:
    """Send every prompt with `clients` in flight; each request's latency in seconds."""
    queue: asyncio.Queue[list[int]] = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    latencies: list[float] = []
    body = {"model": "tiny", "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}

    async def client(http: aiohttp.ClientSession) -> None:
        while not queue.empty():
            prompt = queue.get_nowait()
            started = time.monotonic()
            async with http.post(f"{url}/v1/completions", json={**body, "prompt": prompt}) as resp:
                if resp.status != 200:
                    raise RuntimeError(f"request failed: {resp.status} {await resp.text()}")
                await resp.read()
            latencies.append(time.monotonic() - started)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
        await asyncio.gather(*(client(http) for _ in range(clients)))
    return latencies


def calibrate(out: Path, threads: int) -> Path:
    """`kvpath profile` of the tiny model on this machine (T_pre, T_dec, T_kv): what auto prices with, on
    the torch threads each engine of the clusters runs with (`kvpath up` splits the cores among them)."""
    cmd = [sys.executable, "-m", "services.cli", "profile", "--model", "tiny", "--repeats", "2"]
    cmd += ["--num-threads", str(threads)]
    done = subprocess.run([*cmd, "--max-tokens", "2048", "--out", str(out)], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"kvpath profile failed ({done.returncode}): {done.stderr[-2000:]}")
    return out


def _up_args(o: LiveOptions, config: str, policy: str) -> list[str]:
    if config == "pd":
        return agents.pd_args(policy)
    if config == "fanin":
        return agents.fanin_args(o, policy)
    return ["--engines", str(o.engines), "--kv-tier", config, "--policy", policy]


def _run_tier(o: LiveOptions, up: UpProcess) -> tuple[dict[str, Any], int]:
    """The documents populated once (unmeasured), then the questions and session turns."""
    docs, measured = _prompts(o)
    asyncio.run(_drive(up.url, docs, o.clients, o.max_tokens))
    started = time.monotonic()
    latencies = asyncio.run(_drive(up.url, measured, o.clients, o.max_tokens))
    row = {
        "mean_latency_s": statistics.fmean(latencies),
        "p90_latency_s": float(np.percentile(latencies, 90)),
        "wall_s": time.monotonic() - started,
        "requests": len(latencies),
        "failed": 0,  # a failed request ends the run
    }
    return row, len(docs)


def _one_policy(o: LiveOptions, config: str, policy: str, tmp: Path, profile: Path) -> dict[str, Any]:
    args = _up_args(o, config, policy) + fcfs_engine_args(policy)  # the recorded tables' engines
    # every router logs at debug level (auto's decisions are read from its log), so all pay the same for it
    args += ["--router-arg=--log-level=DEBUG", f"--router-arg=--cost-profile={profile}"]
    up = UpProcess(tmp, *args)
    try:
        run = {"pd": agents.run_pd, "fanin": agents.run_fanin}.get(config, _run_tier)
        row, skip = run(o, up)
    finally:
        up.stop()
    if policy == "auto":
        row |= _decisions((tmp / "logs" / "router-0.log").read_text(errors="replace"), skip=skip)
        if "holder" in row:  # fan-in: sub-agents auto served on the holder itself (no move-query choice)
            row["on_holder"] = row["engines"].get(row["holder"], 0)
    return row


def _decisions(log_text: str, skip: int) -> dict[str, Any]:
    """Auto's plans, engines (decoding) and TTFT error of the measured run (the populate run's `skip`
    decisions left out)."""
    matches = list(_DECISION.finditer(log_text))[skip:]
    found = [(m.group(1), float(m.group(3)), float(m.group(4))) for m in matches]
    errors = [abs(p - m) / m for _, p, m in found if m > 0]
    plans: dict[str, int] = {}
    for label, _, _ in found:
        plans[label] = plans.get(label, 0) + 1
    engines: dict[str, int] = {}
    for m in matches:
        engines[m.group(2)] = engines.get(m.group(2), 0) + 1
    samples = [
        {"plan": label, "predicted_ttft_s": p, "measured_ttft_s": m}
        for label, p, m in found[:: max(1, len(found) // 8)]
    ]
    return {
        "plans": plans,
        "engines": engines,
        "errors": errors,
        "decisions": len(found),
        "samples": samples[:8],
    }


def run_live(o: LiveOptions, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Per configuration, each policy `o.repeats` times in ABBA order (the machine's drift falls on all
    alike): `results` {config: {policy: score}}, `rows` {config: {policy: row}}, `ttft_mdape` over every
    measured decision of auto."""
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {c: {p: [] for p in CONFIGS[c]} for c in o.configs}
    with tempfile.TemporaryDirectory(prefix="kvpath-auto-") as work:
        profile = calibrate(Path(work) / "profile.json", engine_threads(o.engines, host_cores()))
        for config in o.configs:
            policies = CONFIGS[config]
            order = [p for r in range(o.repeats) for p in (policies if r % 2 == 0 else policies[::-1])]
            for i, policy in enumerate(order):
                tmp = Path(work) / f"{config}-{i}-{policy}"
                tmp.mkdir()
                row = _one_policy(o, config, policy, tmp, profile)
                runs[config][policy].append(row)
                if progress:
                    progress(f"live {config} {policy}: {SCORES[config]} {row[SCORES[config]]:.3f} s")
    rows = {c: {p: _merge(r) for p, r in by.items()} for c, by in runs.items()}
    errors = [e for by in runs.values() for r in by["auto"] for e in r.get("errors", [])]
    return {
        "options": {k: getattr(o, k) for k in o.__dataclass_fields__},
        "scores": {c: SCORES[c] for c in o.configs},
        "results": {c: {p: r[SCORES[c]] for p, r in by.items()} for c, by in rows.items()},
        "rows": rows,
        "ttft_mdape": float(np.median(errors)) if errors else None,
    }


_AVERAGED = ("mean_latency_s", "p90_latency_s", "wall_s", "mean_session_jct_s", "makespan_s")
_SUMMED = ("requests", "failed", "sessions", "on_holder")


def _merge(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Means of the repeats; counts summed; auto's decisions pooled (MdAPE over every measured decision)."""
    row: dict[str, Any] = {k: statistics.fmean(r[k] for r in runs) for k in _AVERAGED if k in runs[0]}
    row |= {k: sum(r[k] for r in runs) for k in _SUMMED if k in runs[0]}
    row["per_run_mean_latency_s"] = [r["mean_latency_s"] for r in runs]
    failures = [f for r in runs for f in r.get("failures", [])]
    if failures:
        row["failures"] = failures[:4]
    if "movequery_choices" in runs[0]:
        row["movequery_choices"] = _summed([r["movequery_choices"] for r in runs])
        row["holders"] = [r["holder"] for r in runs]
    errors = [e for r in runs for e in r.get("errors", [])]
    if errors:
        row["ttft_mdape"] = float(np.median(errors))
        # the same after each router's first WARMUP measured decisions (its calibration still settling)
        settled = [e for r in runs for e in r.get("errors", [])[WARMUP:]]
        row["ttft_mdape_settled"] = float(np.median(settled)) if settled else None
    if any("plans" in r for r in runs):
        row["plans"] = _summed([r.get("plans", {}) for r in runs])
        row["engines"] = _summed([r.get("engines", {}) for r in runs])
        row["decisions"] = sum(r.get("decisions", 0) for r in runs)
        row["samples"] = runs[-1].get("samples", [])
    return row


def _summed(counts: list[dict[str, int]]) -> dict[str, int]:
    return {k: sum(c.get(k, 0) for c in counts) for k in sorted({k for c in counts for k in c})}


def format_live(live: dict[str, Any]) -> str:
    lines = ["live (tiny model, this machine): per configuration, each policy on the same workload"]
    for config, rows in live["rows"].items():
        for policy, row in rows.items():
            extra = f"  session JCT {row['mean_session_jct_s']:6.2f} s" if "mean_session_jct_s" in row else ""
            if "makespan_s" in row:
                extra = f"  last done {row['makespan_s']:5.2f} s  move-query {row['movequery_choices']}"
                extra += f", on the holder {row['on_holder']}" if "on_holder" in row else ""
            lines.append(
                f"  {config:6s} {policy:11s} mean {row['mean_latency_s'] * 1e3:7.1f} ms  "
                f"p90 {row['p90_latency_s'] * 1e3:7.1f} ms  ({row['requests']}, {row['failed']} failed)"
                + extra
            )
        results = live["results"][config]
        best = min(v for p, v in results.items() if p != "auto")
        auto = rows["auto"]
        mdape, settled = auto.get("ttft_mdape"), auto.get("ttft_mdape_settled")
        lines.append(
            f"  {config:6s} auto / best fixed {results['auto'] / best:.3f}; "
            f"auto's plans {auto.get('plans')}; TTFT MdAPE "
            + (f"{mdape:.1%}" if mdape is not None else "n/a")
            + (f" ({settled:.1%} after each router's first {WARMUP})" if settled is not None else "")
        )
        for s in auto.get("samples", [])[:4]:
            lines.append(
                f"    {s['plan']:16s} predicted {s['predicted_ttft_s'] * 1e3:7.1f} ms  "
                f"measured {s['measured_ttft_s'] * 1e3:7.1f} ms"
            )
    mdape = live.get("ttft_mdape")
    lines.append(
        "  auto, every configuration: TTFT MdAPE " + (f"{mdape:.1%}" if mdape is not None else "n/a")
    )
    return "\n".join(lines)
