"""What `kvpath up --kv-tier` starts: the pool or the remote store before the engines, the engine flags that
use it, the tier's default policy, and a remote store never reached through this host's shared memory."""

from __future__ import annotations

import argparse

import pytest

from services.up.launcher import register, spec_from_args
from services.up.topology import cluster_processes, engine_threads, fcfs_engine_args


def _spec(*argv: str) -> tuple[list, str]:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    spec = spec_from_args(parser.parse_args(["up", *argv]), "/tmp/kv")
    return cluster_processes(spec), spec.policy


def test_pool_tier_starts_the_pool_for_the_engines_model_and_block_size() -> None:
    procs, policy = _spec("--kv-tier", "pool", "--engines", "2", "--block-size", "32", "--pool-bytes", "4096")
    names = [p.name for p in procs]
    pool = procs[names.index("pool-0")]
    assert pool.service == "cxlpool" and names.index("pool-0") < names.index("engine0-n0")
    assert pool.args[pool.args.index("--block-size") + 1] == "32"
    assert pool.args[pool.args.index("--capacity-bytes") + 1] == "4096"
    engines = [p for p in procs if p.service == "engine"]
    assert len(engines) == 2 and all(p.args[p.args.index("--kv-pool") + 1] == "pool-0" for p in engines)
    assert policy == "beluga"


@pytest.mark.parametrize(
    ("engine_args", "want"),
    [
        ([], None),  # the engines' default on this host: the pool resolves it the same way
        (["--engine-arg=--device cuda"], "bfloat16"),
        (["--engine-arg=--device=cpu"], "float32"),
        (["--engine-arg=--device cuda:1", "--engine-arg=--dtype float32"], "float32"),
    ],
)
def test_the_pool_holds_the_engines_kv_dtype(engine_args: list[str], want: str | None) -> None:
    procs, _ = _spec("--kv-tier", "pool", *engine_args)
    pool = next(p for p in procs if p.service == "cxlpool")
    got = pool.args[pool.args.index("--dtype") + 1] if "--dtype" in pool.args else None
    assert got == want


def test_remote_tier_store_is_reached_over_the_network() -> None:
    procs, policy = _spec("--kv-tier", "remote")
    store = next(p for p in procs if p.service == "remotekv")
    backends = store.args[store.args.index("--kv-backends") + 1].split(",")
    assert "shm" not in backends and "tcp" in backends
    engine = next(p for p in procs if p.service == "engine")
    assert engine.args[engine.args.index("--kv-remote") + 1] == "remotekv-0"
    assert policy == "cache-aware"


def test_tiers_need_a_store_and_on_pd_nodes_the_pool_needs_auto() -> None:
    pd = ("--prefill-nodes", "1", "--decode-nodes", "1")
    with pytest.raises(SystemExit, match="engines with a KV store"):
        _spec("--kv-tier", "pool", "--no-kv-store")
    with pytest.raises(SystemExit, match="remote serves colocated engines only"):
        _spec("--kv-tier", "remote", *pd, "--policy", "auto")
    for policy in ("dualpath", "ampd"):  # they never plan a pool read
        with pytest.raises(SystemExit, match="needs --policy auto"):
            _spec("--kv-tier", "pool", *pd, "--policy", policy)


@pytest.mark.parametrize("decode_engines", ["session", "dualpath"])
def test_auto_on_pd_nodes_maps_the_pool_into_the_engines_that_prefill(decode_engines: str) -> None:
    pd = ("--prefill-nodes", "1", "--decode-nodes", "2", "--auto-decode-engines", decode_engines)
    procs, policy = _spec("--kv-tier", "pool", "--policy", "auto", *pd)
    names = [p.name for p in procs]
    assert policy == "auto" and procs[names.index("pool-0")].service == "cxlpool"
    engines = {p.name: p.args for p in procs if p.service == "engine"}
    for name, args in engines.items():  # PEs, and decode engines that prefill locally (session ones)
        role = args[args.index("--role") + 1]
        prefills = role == "prefill" or "--session-kv" in args
        assert ("--kv-pool" in args) == prefills, (name, args)
        if prefills:
            assert args[args.index("--kv-pool") + 1] == "pool-0"
    assert sum("--kv-pool" in a for a in engines.values()) == (3 if decode_engines == "session" else 1)


def test_the_index_snapshots_beside_the_block_store() -> None:
    """Snapshots let the index purge the KV-events stream (nats-server's memory grows with it)."""
    procs, _ = _spec()
    index = next(p for p in procs if p.service == "index")
    assert index.args[index.args.index("--data-dir") + 1] == "/tmp/kv.index"


def test_auto_runs_on_colocated_and_on_pd_topologies_with_session_decode_engines() -> None:
    procs, policy = _spec("--policy", "auto", "--prefill-nodes", "1", "--decode-nodes", "2")
    engines = {p.name: p.args for p in procs if p.service == "engine"}
    roles = {name: args[args.index("--role") + 1] for name, args in engines.items()}
    assert policy == "auto" and sorted(roles.values()) == ["decode", "decode", "prefill"]
    for name, args in engines.items():  # decode engines keep sessions: auto's local and hbm paths
        assert ("--session-kv" in args) == (roles[name] == "decode")
    router = next(p for p in procs if p.service == "router")
    assert router.args[router.args.index("--policy") + 1] == "auto"
    colocated, policy = _spec("--policy", "auto", "--engines", "2")
    assert policy == "auto" and all("--session-kv" not in p.args for p in colocated if p.service == "engine")


def test_engines_split_the_host_cores_unless_the_user_set_their_threads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torch's default would give each engine a thread per core; `kvpath up` gives each cores / engines."""
    monkeypatch.delenv("KVPATH_NUM_THREADS", raising=False)
    monkeypatch.setattr("services.up.topology.host_cores", lambda: 16)

    def threads(*argv: str) -> list[str | None]:
        procs, _ = _spec(*argv)
        engines = [p.args for p in procs if p.service == "engine"]
        return [a[a.index("--num-threads") + 1] if "--num-threads" in a else None for a in engines]

    assert threads("--engines", "3") == ["5"] * 3
    assert threads("--prefill-nodes", "2", "--decode-nodes", "2", "--engines-per-node", "2") == ["2"] * 8
    assert threads("--engines", "32") == ["1"] * 32
    assert threads("--engines", "2", "--engine-arg=--num-threads 3") == ["3", "3"]  # the user's flag alone
    procs, _ = _spec("--engines", "2", "--engine-arg=--num-threads=3")
    assert all(
        not any(a.startswith("--num-threads") for a in p.args[:-1]) for p in procs if p.service == "engine"
    )
    monkeypatch.setenv("KVPATH_NUM_THREADS", "4")  # so does the engines' own environment setting
    assert threads("--engines", "2") == [None, None]
    assert engine_threads(3, 2) == 1 and engine_threads(0, 2) == 2


@pytest.mark.parametrize(
    ("argv", "want"),
    [
        (
            ["--prefill-nodes", "1", "--decode-nodes", "1"],
            [754_974_720] * 2,
        ),  # SmolLM2 fp32: 2 x 8,192 tokens
        (["--engines", "2"], [2 * 754_974_720]),  # both engines read through node 0
        (["--engines", "2", "--engine-arg=--dtype bfloat16"], [754_974_720]),
        (["--model", "tiny"], [None]),  # two contexts fit the storage default (256 MiB)
    ],
)
def test_each_node_buffer_holds_two_full_length_prompts_per_engine(argv: list[str], want: list) -> None:
    procs, _ = _spec(*argv)
    storage = [p for p in procs if p.service == "storage"]
    got = [
        int(p.args[p.args.index("--buffer-bytes") + 1]) if "--buffer-bytes" in p.args else None
        for p in storage
    ]
    assert got == want


def _order(args: list[str]) -> str | None:
    """The value of the last `--prefill-order` flag (argparse keeps the last)."""
    values = [args[i + 1] for i, a in enumerate(args) if a == "--prefill-order"]
    return values[-1] if values else None


@pytest.mark.parametrize(
    ("argv", "want_engines", "want_router"),
    [
        (["--prefill-nodes", "1", "--decode-nodes", "1"], "short-first", "short-first"),  # the default
        (["--prefill-nodes", "1", "--decode-nodes", "1", "--prefill-order", "fcfs"], "fcfs", None),
        (["--engines", "2"], "short-first", None),  # no placement queue
        (["--engines", "2", "--prefill-order", "fcfs"], "fcfs", None),
        (["--prefill-nodes", "1", "--decode-nodes", "1", "--policy", "auto"], "short-first", None),
        (["--prefill-nodes", "1", "--decode-nodes", "1", "--policy", "disagg-remote"], None, None),
        (["--prefill-nodes", "1", "--decode-nodes", "1", "--policy", "ampd"], "slo", None),
        (
            ["--prefill-nodes", "1", "--decode-nodes", "1", "--policy", "ampd", "--prefill-order", "fcfs"],
            "fcfs",
            None,
        ),
    ],
)
def test_the_prefill_order_reaches_every_prefill_queue(
    argv: list[str], want_engines: str | None, want_router: str | None
) -> None:
    procs, _ = _spec(*argv)
    prefilling = [
        p for p in procs if p.service == "engine" and (p.role != "decode" or "--session-kv" in p.args)
    ]
    assert prefilling and {_order(p.args) for p in prefilling} == {want_engines}
    router = next(p for p in procs if p.service == "router")
    assert _order(router.args) == want_router


def _step_target(args: list[str]) -> str | None:
    values = [args[i + 1] for i, a in enumerate(args) if a == "--step-target-s"]
    return values[-1] if values else None


@pytest.mark.parametrize(
    ("argv", "want"),
    [
        (["--engines", "2"], "1.0"),  # the agent default
        (["--prefill-nodes", "1", "--decode-nodes", "1", "--step-target-s", "0.25"], "0.25"),
        (["--engines", "2", "--step-target-s", "0"], None),  # the fixed budget
        (["--prefill-nodes", "1", "--decode-nodes", "1", "--policy", "ampd"], None),  # the paper's engines
        (
            ["--engines", "2", "--step-target-s", "2", "--engine-arg=--step-target-s 3"],
            "3",
        ),  # the last flag wins
    ],
)
def test_the_step_target_reaches_every_engine(argv: list[str], want: str | None) -> None:
    procs, _ = _spec(*argv)
    assert {_step_target(p.args) for p in procs if p.service == "engine"} == {want}


def test_a_step_target_out_of_range_is_refused() -> None:
    with pytest.raises(SystemExit, match="between 0 and 3600"):
        _spec("--step-target-s", "-2")


def test_benchmarks_keep_fcfs_engines_except_under_the_session_policies() -> None:
    procs, _ = _spec("--engines", "2", *fcfs_engine_args("colocated"))
    assert {(_order(p.args), _step_target(p.args)) for p in procs if p.service == "engine"} == {
        ("fcfs", None)
    }
    assert fcfs_engine_args("ampd") == []
