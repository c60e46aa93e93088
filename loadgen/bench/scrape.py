"""Prometheus scrapes for the benchmarks: a service's /metrics as {(name, labels): value}, and the router's
TTFT stage breakdown from it."""

from __future__ import annotations

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


async def scrape(http: aiohttp.ClientSession, url: str, *, timeout_s: float = 5.0) -> Samples:
    """Every sample of `url`/metrics, keyed by (sample name, sorted label pairs)."""
    async with http.get(f"{url}/metrics", timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
        text = await resp.text()
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def stage_totals(samples: Samples, stages: tuple[str, ...]) -> dict[str, tuple[float, float]]:
    """(sum of seconds, count) of `kvpath_router_ttft_stage_seconds` per stage."""
    out = {}
    for stage in stages:
        labels = (("stage", stage),)
        total = samples.get(("kvpath_router_ttft_stage_seconds_sum", labels), 0.0)
        count = samples.get(("kvpath_router_ttft_stage_seconds_count", labels), 0.0)
        out[stage] = (total, count)
    return out
