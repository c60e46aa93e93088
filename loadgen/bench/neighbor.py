"""A CPU-bound neighbour process for benches that measure on a loaded machine (`kvpath bench transport
--neighbor`): a pure-Python counting loop that runs until told to stop, then reports its rate, so a bench
shows both what the neighbour costs it and what it costs the neighbour."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time


def start() -> subprocess.Popen[str]:
    """Start the neighbour; it is counting when this returns."""
    neighbor = subprocess.Popen(
        [sys.executable, "-m", "loadgen.bench.neighbor"], stdout=subprocess.PIPE, text=True
    )
    assert neighbor.stdout is not None
    if neighbor.stdout.readline().strip() != json.dumps("counting"):
        neighbor.kill()
        neighbor.wait(timeout=30)
        raise RuntimeError("bench neighbor did not start")
    return neighbor


def stop(neighbor: subprocess.Popen[str]) -> float:
    """Stop the neighbour; its iterations per second while it ran."""
    neighbor.send_signal(signal.SIGTERM)
    out, _ = neighbor.communicate(timeout=30)
    return float(json.loads(out.splitlines()[-1]))


def count_until_terminated() -> None:
    """The neighbour: count in pure Python until SIGTERM, then print the rate."""
    stopping = [False]
    signal.signal(signal.SIGTERM, lambda *_: stopping.__setitem__(0, True))
    print(json.dumps("counting"), flush=True)
    began, n = time.perf_counter(), 0
    while not stopping[0]:
        for _ in range(10_000):
            n += 1
    print(json.dumps(n / (time.perf_counter() - began)), flush=True)


if __name__ == "__main__":
    count_until_terminated()
