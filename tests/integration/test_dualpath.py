"""DualPath end to end: prefill and decode engines on two emulated nodes, both read paths, over HTTP."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest

from tests.cluster import UpProcess
from tests.integration.test_kv_reuse import run_session

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=["tiny", "tiny-mla"])
def model(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def disagg(tmp_path_factory: pytest.TempPathFactory, model: str) -> Iterator[UpProcess]:
    # round-robin read sides: a session's turn 2 reads on the PE's node, turn 3 on the DE's node
    up = UpProcess(
        tmp_path_factory.mktemp("pd"),
        "--model",
        model,
        "--prefill-nodes",
        "1",
        "--decode-nodes",
        "1",
        "--policy",
        "dualpath-rr",
    )
    yield up
    assert up.stop() == 0, up.log()


@pytest.fixture(scope="module")
def cold(tmp_path_factory: pytest.TempPathFactory, model: str) -> Iterator[UpProcess]:
    up = UpProcess(tmp_path_factory.mktemp("cold"), "--model", model, "--no-kv-store")
    yield up
    assert up.stop() == 0, up.log()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        yield session


async def metric(http: aiohttp.ClientSession, url: str, name: str) -> float:
    async with http.get(f"{url}/metrics") as resp:
        text = await resp.text()
    values = [float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.M)]
    return sum(values)


async def test_both_read_paths_match_colocated_recompute(
    disagg: UpProcess, cold: UpProcess, model: str, http: aiohttp.ClientSession
) -> None:
    warm = await run_session(http, disagg.url, seed=3, model=model)
    ref = await run_session(http, cold.url, seed=3, model=model)
    for w, r in zip(warm, ref, strict=True):
        assert w["out"]["choices"][0]["token_ids"] == r["out"]["choices"][0]["token_ids"]
    cached = [w["out"]["usage"]["prompt_tokens_details"]["cached_tokens"] for w in warm]
    assert cached[0] == 0 and cached[1] > 0 and cached[2] > cached[1]
    # turn 2 was read by node 0 (PE path), turn 3 by node 1 (DE path, streamed DE -> PE)
    node_reads = [
        await metric(http, disagg.services[f"storage-{n}"], "kvpath_storage_read_bytes_total") for n in (0, 1)
    ]
    assert node_reads[0] > 0 and node_reads[1] > 0, node_reads
    de_url = next(u for name, u in disagg.services.items() if name.startswith("de"))
    assert await metric(http, de_url, 'kvpath_engine_kv_transfer_bytes_total{path="de_to_pe"}') > 0


def test_topology_has_no_colocated_engine(disagg: UpProcess, tmp_path: Path) -> None:
    names = sorted(disagg.services)
    assert any(n.startswith("pe") for n in names) and any(n.startswith("de") for n in names)
    assert not any(n.startswith("engine") for n in names)
