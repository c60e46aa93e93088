"""The Beluga simulator at a tiny scale: it routes with the live colocated policies, a seed fixes its result,
Beluga beats the RDMA baseline where the paper says it does, and `--sweep beluga` prints Table 5."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import orjson
import pytest

import loadgen.sim.pool.cluster
import services.policy.colocated
from loadgen.cli import main
from loadgen.sim.pool import PoolCluster, PoolSimConfig, beluga_sweep, build_lv_trace, resolve
from loadgen.sim.pool.config import BELUGA, MOONCAKE, SystemSpec
from services.policy.snapshot import ROLE_COLOCATED, EngineSnapshot

# one server of 4 GPUs, 8 clients, 48 requests (the paper's prompt lengths and constants)
TINY = PoolSimConfig(servers=1, gpus_per_server=4, clients=8, requests=48, sensitivity=False)
TINY_FLAGS = ("--servers", "1", "--gpus-per-server", "4", "--clients", "8", "--requests", "48")


def test_the_simulator_imports_the_live_policies() -> None:
    assert loadgen.sim.pool.cluster.pick_least_loaded is services.policy.colocated.pick_least_loaded
    assert loadgen.sim.pool.cluster.pick_cache_aware is services.policy.colocated.pick_cache_aware


def _spy(monkeypatch: pytest.MonkeyPatch, name: str) -> list[tuple[Any, ...]]:
    """Wrap the cluster's reference to policy `name`, recording every call's arguments."""
    calls: list[tuple[Any, ...]] = []
    real = getattr(services.policy.colocated, name)

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(loadgen.sim.pool.cluster, name, spy)
    return calls


@pytest.mark.parametrize(
    ("system", "policy", "other"),
    [(BELUGA, "pick_least_loaded", "pick_cache_aware"), (MOONCAKE, "pick_cache_aware", "pick_least_loaded")],
)
def test_every_request_is_routed_by_its_systems_policy(
    monkeypatch: pytest.MonkeyPatch, system: SystemSpec, policy: str, other: str
) -> None:
    calls, others = _spy(monkeypatch, policy), _spy(monkeypatch, other)
    cluster = PoolCluster(resolve(TINY), system)
    cluster.run(build_lv_trace(TINY.shape(), TINY.seed), "populate")
    assert len(calls) == TINY.requests and not others
    engines = calls[0][0]
    assert [e.engine_id for e in engines] == ["s0g0", "s0g1", "s0g2", "s0g3"]
    assert all(isinstance(e, EngineSnapshot) and e.role == ROLE_COLOCATED for e in engines)
    if system.is_cache_aware:  # credited with the prompt tokens each instance's own tiers hold
        hits, prompt_tokens = calls[-1][1], calls[-1][2]
        assert set(hits) == {e.engine_id for e in engines} and prompt_tokens >= 15_360


def test_a_seed_fixes_the_result() -> None:
    first, again = beluga_sweep(TINY), beluga_sweep(TINY)
    other = beluga_sweep(dataclasses.replace(TINY, seed=1))
    assert first["rows"] == again["rows"] and first["sim_qps_speedup"] == again["sim_qps_speedup"]
    assert first["rows"] != other["rows"]


def test_beluga_wins_the_cache_hit_run() -> None:
    result = beluga_sweep(dataclasses.replace(TINY, sensitivity=True))
    rows = {(r["run"], r["system"]): r for r in result["rows"]}
    beluga, mooncake = rows["hit", BELUGA.name], rows["hit", MOONCAKE.name]
    assert beluga["ttft_mean_s"] < mooncake["ttft_mean_s"] / 3 and beluga["qps"] > 3 * mooncake["qps"]
    assert beluga["hit_ratio"] > 0.99  # every prompt is in the pool in the second run
    assert 0 < result["sim_ttft_reduction"] < 1 and result["sim_qps_speedup"] > 1
    populate = rows["populate", BELUGA.name]
    assert 0.1 < populate["hit_ratio"] < 0.4  # the repeat share (30%) minus misses of concurrent repeats
    sensitivity = result["sensitivity"]
    assert sensitivity["mooncake_16"]["ttft_mean_s"] > mooncake["ttft_mean_s"]  # per-object costs x16
    assert sensitivity["beluga_no_interleave"]["qps"] <= beluga["qps"]


def test_the_beluga_sweep_prints_table5_and_writes_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "beluga.json"
    rc = main(["sim", "--sweep", "beluga", *TINY_FLAGS, "--seed", "3", "--json", str(out)])
    text, err = capsys.readouterr()
    assert rc == 0
    assert "Beluga at paper scale: 1 servers x 4 GPUs (4 instances), 8 closed-loop clients" in text
    assert "hit       vLLM+Beluga" in text and "(11.32)" in text
    assert "QPS" in text and "(paper 7.35x)" in text and "(paper -89.6%)" in text
    assert "16 tokens" in text and "without" in text  # the sensitivity rows, on by default
    assert err.count("wall") == 8  # progress: two runs of four systems
    result = orjson.loads(out.read_bytes())
    assert result["setup"]["seed"] == 3 and result["setup"]["instances"] == 4
    assert {"sim_ttft_reduction", "sim_qps_speedup", "rows"} <= set(result)
    assert [(r["run"], r["system"]) for r in result["rows"]][-1] == ("hit", BELUGA.name)


def test_bad_beluga_options_are_one_line_errors(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["sim", "--sweep", "beluga", "--gpus-per-server", "3"])
    _, err = capsys.readouterr()
    assert rc == 2 and err.startswith("kvpath loadgen sim: error:") and "gpus_per_server" in err


def test_help_lists_the_sweep_and_its_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["sim", "--help"])
    text = capsys.readouterr().out
    assert exc.value.code == 0
    assert "beluga" in text and "--rdma-object-overhead-ms" in text and "--no-sensitivity" in text
