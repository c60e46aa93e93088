"""The live part of `kvpath bench auto`: real `kvpath up` clusters of colocated engines, per KV tier the fixed
policy `kvpath up` uses there (`beluga` on the pool tier, `cache-aware` on the remote-store tier, whose
engines keep a local DRAM cache announced as `dram:<engine>`) and `auto`, on the same workload; auto's
predicted vs measured TTFT.

Workload (`tiny`): `docs` shared documents, each populated once, then `questions` questions drawn with Zipf
popularity (document + its own question tokens, short answers) sent by `clients` closed-loop clients; and
`sessions` three-turn sessions whose later turns extend the earlier ones. What a colocated topology offers is
all auto chooses among live: the engine-resident prefix, the pool, storage on the engine's node, recompute
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from services.up.process import UpProcess

# per KV tier above storage: the fixed policy `kvpath up` defaults to there, and auto
TIERS = {"pool": ("beluga", "auto"), "remote": ("cache-aware", "auto")}
WARMUP = 24  # measured decisions before the router's TTFT calibration counts as settled
_DECISION = re.compile(r"auto plan .*plan=(\S+) .*predicted_ttft_s=([0-9.e+-]+) measured_ttft_s=([0-9.e+-]+)")
_MIN_TOKEN, _MAX_TOKEN = 3, 250  # the tiny model's byte vocabulary


@dataclass(frozen=True, slots=True)
class LiveOptions:
    engines: int = 2
    docs: int = 6
    doc_tokens: int = 1500
    questions: int = 48
    sessions: int = 4
    clients: int = 4
    max_tokens: int = 8
    repeats: int = 2  # runs per policy
    tiers: tuple[str, ...] = ("pool", "remote")
    seed: int = 0


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


def calibrate(out: Path) -> Path:
    """`kvpath profile` of the tiny model on this machine (T_pre, T_dec, T_kv): what auto prices with."""
    cmd = [sys.executable, "-m", "services.cli", "profile", "--model", "tiny", "--repeats", "2"]
    done = subprocess.run([*cmd, "--max-tokens", "2048", "--out", str(out)], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"kvpath profile failed ({done.returncode}): {done.stderr[-2000:]}")
    return out


def _one_policy(o: LiveOptions, tier: str, policy: str, tmp: Path, profile: Path) -> dict[str, Any]:
    docs, measured = _prompts(o)
    args = ["--engines", str(o.engines), "--kv-tier", tier, "--policy", policy]
    # both routers log at debug level (auto's decisions are read from its log), so both pay the same for it
    args += ["--router-arg=--log-level=DEBUG", f"--router-arg=--cost-profile={profile}"]
    up = UpProcess(tmp, *args)
    try:
        asyncio.run(_drive(up.url, docs, o.clients, o.max_tokens))
        started = time.monotonic()
        latencies = asyncio.run(_drive(up.url, measured, o.clients, o.max_tokens))
        wall_s = time.monotonic() - started
    finally:
        up.stop()
    row: dict[str, Any] = {
        "mean_latency_s": statistics.fmean(latencies),
        "p90_latency_s": float(np.percentile(latencies, 90)),
        "wall_s": wall_s,
        "requests": len(latencies),
    }
    if policy == "auto":
        row |= _decisions((tmp / "logs" / "router-0.log").read_text(errors="replace"), skip=len(docs))
    return row


def _decisions(log_text: str, skip: int) -> dict[str, Any]:
    """Auto's plans and TTFT error of the measured run (the populate run's `skip` decisions left out)."""
    found = [(m.group(1), float(m.group(2)), float(m.group(3))) for m in _DECISION.finditer(log_text)][skip:]
    errors = [abs(p - m) / m for _, p, m in found if m > 0]
    plans: dict[str, int] = {}
    for label, _, _ in found:
        plans[label] = plans.get(label, 0) + 1
    samples = [
        {"plan": label, "predicted_ttft_s": p, "measured_ttft_s": m}
        for label, p, m in found[:: max(1, len(found) // 8)]
    ]
    return {"plans": plans, "errors": errors, "decisions": len(found), "samples": samples[:8]}


def run_live(o: LiveOptions, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Per tier, each policy `o.repeats` times in ABBA order (the machine's drift falls on both alike)."""
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {t: {p: [] for p in TIERS[t]} for t in o.tiers}
    with tempfile.TemporaryDirectory(prefix="kvpath-auto-") as work:
        profile = calibrate(Path(work) / "profile.json")
        for tier in o.tiers:
            pair = TIERS[tier]
            for i, policy in enumerate(
                p for r in range(o.repeats) for p in (pair if r % 2 == 0 else pair[::-1])
            ):
                tmp = Path(work) / f"{tier}-{i}-{policy}"
                tmp.mkdir()
                runs[tier][policy].append(_one_policy(o, tier, policy, tmp, profile))
                if progress:
                    progress(
                        f"live {tier} {policy}: mean latency {runs[tier][policy][-1]['mean_latency_s']:.3f} s"
                    )
    rows = {t: {p: _merge(r) for p, r in by.items()} for t, by in runs.items()}
    errors = [e for by in runs.values() for r in by["auto"] for e in r.get("errors", [])]
    return {
        "options": {k: getattr(o, k) for k in o.__dataclass_fields__},
        "results": {t: {p: r["mean_latency_s"] for p, r in by.items()} for t, by in rows.items()},
        "rows": rows,
        "ttft_mdape": float(np.median(errors)) if errors else None,
    }


def _merge(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Means of the repeats; auto's decisions pooled (MdAPE over every measured decision)."""
    keys = ("mean_latency_s", "p90_latency_s", "wall_s")
    row: dict[str, Any] = {k: statistics.fmean(r[k] for r in runs) for k in keys}
    row["requests"] = sum(r["requests"] for r in runs)
    row["per_run_mean_latency_s"] = [r["mean_latency_s"] for r in runs]
    errors = [e for r in runs for e in r.get("errors", [])]
    if errors:
        row["ttft_mdape"] = float(np.median(errors))
        # the same after each router's first WARMUP measured decisions (its calibration still settling)
        settled = [e for r in runs for e in r.get("errors", [])[WARMUP:]]
        row["ttft_mdape_settled"] = float(np.median(settled)) if settled else None
        row["plans"] = {
            k: sum(r["plans"].get(k, 0) for r in runs) for k in {k for r in runs for k in r["plans"]}
        }
        row["samples"] = runs[-1]["samples"]
    return row


def format_live(live: dict[str, Any]) -> str:
    lines = ["live, 2 colocated engines (tiny model, this machine): request latency per KV tier"]
    for tier, rows in live["rows"].items():
        for policy, row in rows.items():
            lines.append(
                f"  {tier:6s} {policy:11s} mean {row['mean_latency_s'] * 1e3:7.1f} ms  "
                f"p90 {row['p90_latency_s'] * 1e3:7.1f} ms  wall {row['wall_s']:5.1f} s  ({row['requests']})"
            )
        auto = rows["auto"]
        mdape, settled = auto.get("ttft_mdape"), auto.get("ttft_mdape_settled")
        lines.append(
            f"  {tier:6s} auto's plans {auto.get('plans')}; TTFT MdAPE "
            + (f"{mdape:.1%}" if mdape is not None else "n/a")
            + (f" ({settled:.1%} after each router's first {WARMUP})" if settled is not None else "")
        )
        for s in auto.get("samples", [])[:4]:
            lines.append(
                f"    {s['plan']:16s} predicted {s['predicted_ttft_s'] * 1e3:7.1f} ms  "
                f"measured {s['measured_ttft_s'] * 1e3:7.1f} ms"
            )
    mdape = live.get("ttft_mdape")
    lines.append("  auto, every tier: TTFT MdAPE " + (f"{mdape:.1%}" if mdape is not None else "n/a"))
    return "\n".join(lines)
