"""`kvpath up`'s restart policy: backoff doubling within the window up to its cap, a crash loop given up; its
shutdown order."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from services.up.launcher import LocalCluster, RestartPolicy, register, spec_from_args
from services.up.supervision import Child
from services.up.topology import cluster_processes


def test_backoff_doubles_within_the_window_and_resets_after_it() -> None:
    policy = RestartPolicy(initial_backoff_s=0.5, max_backoff_s=3.0, max_restarts=5, window_s=60.0)
    exits: list[float] = []
    delays = []
    for t in (0.0, 1.0, 2.0, 3.0, 4.0):
        exits.append(t)
        delays.append(policy.backoff_s(exits, t))
    assert delays == [0.5, 1.0, 2.0, 3.0, 3.0]  # doubling, capped
    assert policy.backoff_s([*exits, 100.0], 100.0) == 0.5  # the old exits left the window: a fresh start


def test_a_crash_loop_is_given_up() -> None:
    policy = RestartPolicy(max_restarts=3, window_s=10.0)
    exits = [0.0, 1.0, 2.0]
    assert policy.backoff_s(exits, 2.0) is not None
    assert policy.backoff_s([*exits, 3.0], 3.0) is None  # a fourth exit within 10 s
    assert policy.backoff_s([*exits, 30.0], 30.0) is not None  # the same count spread out is not a loop


_STOPPABLE = """
import signal, sys, time
name, record, linger = sys.argv[1], sys.argv[2], float(sys.argv[3])
def stop(*_):
    with open(record, "a") as f:
        f.write(f"{name} term {time.monotonic()}\\n")
    time.sleep(linger)  # an engine finishing its last writes
    with open(record, "a") as f:
        f.write(f"{name} exit {time.monotonic()}\\n")
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
print("up", flush=True)
time.sleep(60)
"""


def test_shutdown_stops_the_router_then_the_engines_then_the_services_they_use(tmp_path: Path) -> None:
    """Real processes that take a while to exit on SIGTERM: the KV tier, storage and the index are told to
    stop only once every engine has exited, and the engines once the router has (before, all at once: an
    engine's last writes met a remote store that had gone, and it logged the connection lost)."""
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    spec = spec_from_args(parser.parse_args(["up", "--kv-tier", "remote", "--engines", "2"]), str(tmp_path))
    cluster = LocalCluster(spec, tmp_dir=str(tmp_path), nats_url="", namespace="t", log_dir=str(tmp_path))
    record = tmp_path / "record"
    for p in cluster_processes(spec):  # start order: index, remote store, storage, engines, router
        linger = "0.3" if p.kind in ("engine", "router") else "0"
        proc = subprocess.Popen(
            [sys.executable, "-c", _STOPPABLE, p.name, str(record), linger], stdout=subprocess.PIPE
        )
        assert proc.stdout is not None and proc.stdout.readline() == b"up\n"
        cluster.children.append(Child(p, proc, str(tmp_path / p.name)))
    try:
        cluster._shutdown()
    finally:
        for child in cluster.children:
            assert isinstance(child.proc, subprocess.Popen) and child.proc.stdout is not None
            child.proc.stdout.close()
    events = [line.split() for line in record.read_text().splitlines()]
    at = {(name, what): float(t) for name, what, t in events}
    kinds = {c.spec.name: c.spec.kind for c in cluster.children}
    last_exit = {k: max(at[n, "exit"] for n in kinds if kinds[n] == k) for k in ("router", "engine")}
    first_term = {k: min(at[n, "term"] for n in kinds if kinds[n] == k) for k in set(kinds.values())}
    assert first_term["engine"] > last_exit["router"]
    assert min(first_term[k] for k in ("index", "storage", "remotekv")) > last_exit["engine"]
    assert all(c.proc.poll() == 0 for c in cluster.children)
