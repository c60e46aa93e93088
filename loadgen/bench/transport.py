"""`kvpath bench transport`: throughput of the shm and tcp backends against a plain socket copy.

The receiver runs in a child process (`python -m loadgen.bench.transport --serve`), the sender here. Per
message size, the sender streams `--total-mib` of messages, each a `write(..., tag=k)` whose notice the
child consumes, with `--window` writes in flight; a message counts when its write returned (bytes in the
receiver's region, notice posted). Baseline: the same bytes over one plain TCP socket, `sendall` here and
`recv_into` a preallocated buffer there, no framing, no notices. Prints a table (and JSON with --json).
`--repeats N`: N whole measurements, each against a fresh receiver process (on a shared 2-core host a
latency-bound tcp run moves by up to 3x from one run to the next); the table shows the medians, each run's
fixed cost is printed and every run is in the JSON (`runs`).

`--neighbor`: a CPU-bound process (a pure-Python counting loop) runs beside both ends for the whole
measurement, as on a loaded machine, and its rate is printed: run it with and without `--spin-us 0` to see
what polling costs a neighbour and what it buys the writes (the transport's polling must not slow a loaded
2-core machine; README "Hot paths").

`--cpus A,B`: the receiver process runs on CPU A only and the sender on B (with `--senders`: sender j on
the (j + 1)-th id, wrapping). Unpinned, a 2-core host's scheduler sometimes puts both ends of a one-in-flight
stream on one core, where each waits for the other's time slice: a run then moves several times slower, and
which runs do is chance. `--cpus 0,1` measures two ends on two cores (two engines), `--cpus 0` one core.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from typing import Any

import numpy as np

from loadgen.bench import neighbor as neighbor_process
from loadgen.bench import transport_senders
from shared.transport.config import TransportConfig
from shared.transport.receiver import KvReceiver
from shared.transport.sender import KvSender, Peer

DEFAULT_SIZES = "64K,256K,1M,4M,16M"
_SLOTS = 8  # ring of message slots in the receive region


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("transport", help="KV data plane throughput: shm, tcp, plain socket")
    parser.add_argument("--sizes", default=DEFAULT_SIZES, help="message sizes (K/M suffixes)")
    parser.add_argument("--total-mib", type=int, default=256, help="bytes streamed per size and backend")
    parser.add_argument("--window", type=int, default=4, help="writes in flight")
    parser.add_argument("--blocks-per-write", type=int, default=1, help="messages per write_many call")
    parser.add_argument("--backends", default="shm,tcp", help="backends to measure")
    parser.add_argument(
        "--spin-us",
        type=float,
        default=None,
        help="TransportConfig.spin_us of both ends (default: its default)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="whole measurements, each with a fresh receiver process; the table shows their medians",
    )
    parser.add_argument(
        "--senders",
        type=int,
        default=1,
        help="sender processes streaming into one receiver at once, one write in flight each "
        "(transport_senders.py; --window and --blocks-per-write then do not apply)",
    )
    parser.add_argument(
        "--neighbor",
        action="store_true",
        help="run a CPU-bound process beside both ends and print its rate (a loaded machine)",
    )
    parser.add_argument(
        "--cpus",
        type=transport_senders.parse_cpus,
        default=None,
        help="pin the receiver to the first CPU id and the sender(s) to the next (e.g. 0,1)",
    )
    parser.add_argument("--json", default="", help="also write the results to this file")
    parser.set_defaults(func=run_bench)


def run_bench(args: argparse.Namespace) -> int:
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    backends = [b for b in args.backends.split(",") if b]
    if args.repeats < 1 or args.senders < 1:
        raise SystemExit("--repeats and --senders must be at least 1")
    neighbor = None
    try:
        neighbor = neighbor_process.start() if args.neighbor else None
        runs = [_measure_once(args, sizes, backends) for _ in range(args.repeats)]
    finally:
        rate = neighbor_process.stop(neighbor) if neighbor is not None else None
    results = median_rows(runs, backends)
    doc: dict[str, Any] = {"unit": "GB/s (1e9 bytes/s)", "results": results}
    # the intercept of time per write against bytes is a per-write cost only when each write is awaited
    latency_bound = args.senders == 1 and args.window == 1
    if args.senders > 1:
        _print_senders_table(results, backends)
        doc["senders"] = args.senders
    else:
        _print_table(results, backends, with_fixed_cost=latency_bound)
    if latency_bound:
        doc["fixed_cost_us"] = {b: fixed_cost_us(results, b) for b in backends}
    if args.cpus:
        doc["cpus"] = results[0]["cpus"] if results else None
    if args.repeats > 1:
        doc["runs"] = runs
        if latency_bound:
            doc["fixed_cost_us_runs"] = _print_fixed_costs(runs, backends)
    if rate is not None:
        print(f"neighbor (a CPU-bound process beside both ends): {rate / 1e6:.1f} M iterations/s")
        doc["neighbor_iterations_per_s"] = rate
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)
    return 0


def _print_fixed_costs(
    runs: list[list[dict[str, Any]]], backends: list[str]
) -> dict[str, list[float | None]]:
    fixed_runs = {b: [fixed_cost_us(run, b) for run in runs] for b in backends}
    for backend, values in fixed_runs.items():
        known = sorted(v for v in values if v is not None)
        if known:
            each = " / ".join(f"{v:.1f}" for v in known)
            print(f"fixed cost per write call, {backend}, each run: {each} us")
    return fixed_runs


def _print_senders_table(results: list[dict[str, Any]], backends: list[str]) -> None:
    senders = results[0]["senders"] if results else 0
    print(f"{senders} sender processes into one receiver, one write in flight each; aggregate GB/s (1e9 B/s)")
    heads = " ".join(f"{b + ' GB/s':>10} {'us/write':>9}" for b in backends)
    print(f"{'size':>9} {'msgs/sender':>11} {heads}")
    for row in results:
        size = row["size_bytes"]
        label = f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"
        cells = " ".join(f"{row[b]:>10.2f} {row[b + '_us_per_write']:>9.1f}" for b in backends)
        print(f"{label:>9} {row['messages']:>11} {cells}")


def _measure_once(args: argparse.Namespace, sizes: list[int], backends: list[str]) -> list[dict[str, Any]]:
    """One whole measurement against a fresh receiver process."""
    if args.senders > 1:
        return transport_senders.measure(
            sizes, backends, args.senders, args.total_mib << 20, args.spin_us, args.cpus
        )
    region_bytes = max(sizes) * max(_SLOTS, args.blocks_per_write)
    where = ",".join(map(str, args.cpus or []))
    serve = [sys.executable, "-m", "loadgen.bench.transport", "--serve", str(region_bytes), str(args.spin_us)]
    child = subprocess.Popen(
        [*serve, where],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    allowed = os.sched_getaffinity(0)
    try:
        return asyncio.run(
            _measure_all(
                child,
                region_bytes,
                sizes,
                backends,
                args.total_mib << 20,
                args.window,
                args.blocks_per_write,
                transport_senders.bench_config(args.spin_us, ["shm", "tcp"]),
                args.cpus,
            )
        )
    finally:
        os.sched_setaffinity(0, allowed)
        if child.stdin is not None:
            child.stdin.close()
        child.wait(timeout=30)


def median_rows(runs: list[list[dict[str, Any]]], backends: list[str]) -> list[dict[str, Any]]:
    """Per size, the median of each measured column over the runs (one run: itself)."""
    columns = [*backends, "socket", *(f"{b}_us_per_write" for b in backends)]
    out = []
    for rows in zip(*runs, strict=True):
        row = dict(rows[0])
        for column in columns:
            if column in row:
                row[column] = float(np.median([r[column] for r in rows]))
        out.append(row)
    return out


async def _measure_all(
    child: subprocess.Popen[str],
    region_bytes: int,
    sizes: list[int],
    backends: list[str],
    total: int,
    window: int,
    blocks: int,
    config: TransportConfig,
    cpus: list[int] | None,
) -> list[dict[str, Any]]:
    sender = KvSender(config, sender_id="bench")
    try:
        hello = json.loads(_line(child))
        where = {"receiver": hello["cpus"], "sender": transport_senders.pin_self(cpus, 1)}
        peers = {b: await sender.connect(hello["endpoint"], timeout_s=10, backend=b) for b in backends}
        for peer in peers.values():  # fault in both mappings before timing
            await peer.write("buf", 0, np.ones(region_bytes, np.uint8), timeout_s=60)
        results = []
        for size in sizes:
            count = max(window * blocks, total // size) // blocks * blocks
            row: dict[str, Any] = {
                "size_bytes": size,
                "messages": count,
                "blocks_per_write": blocks,
                "cpus": where,
            }
            for backend, peer in peers.items():
                row[backend] = await _stream(child, peer, size, count, window, blocks, region_bytes)
            row["socket"] = _socket_baseline(child, hello["baseline_port"], size, count)
            results.append(row)
        return results
    finally:
        await sender.close()


def _line(child: subprocess.Popen[str]) -> str:
    assert child.stdout is not None
    line = child.stdout.readline()
    if not line:
        raise RuntimeError("bench receiver exited")
    return line


def _command(child: subprocess.Popen[str], text: str) -> None:
    assert child.stdin is not None
    child.stdin.write(text + "\n")
    child.stdin.flush()


async def _stream(
    child: subprocess.Popen[str],
    peer: Peer,
    size: int,
    count: int,
    window: int,
    blocks: int,
    region_bytes: int,
) -> float:
    """GB/s of `count` messages of `size` bytes, `blocks` per tagged write, `window` writes in flight."""
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    slots = region_bytes // size
    writes = count // blocks
    _command(child, f"consume {writes}")
    _line(child)  # the consumer is waiting
    in_flight: set[asyncio.Task[None]] = set()
    start = time.perf_counter()
    if window == 1:  # the latency-bound case: each write awaited in turn, no task per write
        for k in range(writes):
            extents = [(((k * blocks + j) % slots) * size, data) for j in range(blocks)]
            await peer.write_many("buf", extents, tag=k, timeout_s=60)
    for k in range(writes if window > 1 else 0):
        if len(in_flight) >= window:
            done, in_flight = await asyncio.wait(in_flight, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()
        extents = [(((k * blocks + j) % slots) * size, data) for j in range(blocks)]
        in_flight.add(asyncio.ensure_future(peer.write_many("buf", extents, tag=k, timeout_s=60)))
    await asyncio.gather(*in_flight)
    elapsed = time.perf_counter() - start
    if json.loads(_line(child)) != "consumed":
        raise RuntimeError("bench receiver did not consume every notice")
    return size * count / elapsed / 1e9


def _socket_baseline(child: subprocess.Popen[str], port: int, size: int, count: int) -> float:
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    _command(child, f"baseline {size} {count}")
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
        start = time.perf_counter()
        for _ in range(count):
            sock.sendall(data.data)
        if sock.recv(1) != b"k":
            raise RuntimeError("baseline receiver did not confirm")
        elapsed = time.perf_counter() - start
    _line(child)
    return size * count / elapsed / 1e9


def fixed_cost_us(results: list[dict[str, Any]], backend: str) -> float | None:
    """Fixed cost of one write call in microseconds: the intercept of seconds per write against bytes
    per write (least squares over the measured sizes); None with fewer than two sizes."""
    if len(results) < 2:
        return None
    nbytes = np.array([r["size_bytes"] * r["blocks_per_write"] for r in results], dtype=np.float64)
    seconds = nbytes / (np.array([r[backend] for r in results]) * 1e9)
    _slope, intercept = np.polyfit(nbytes, seconds, 1)
    return float(intercept * 1e6)


def _print_table(results: list[dict[str, Any]], backends: list[str], *, with_fixed_cost: bool) -> None:
    columns = [*backends, "socket"]
    blocks = results[0]["blocks_per_write"] if results else 1
    print(f"messages of `size` bytes, {blocks} per write call; GB/s = 1e9 bytes/s")
    print(f"{'size':>9} {'msgs':>6} " + " ".join(f"{c + ' GB/s':>12}" for c in columns) + "   tcp/socket")
    for row in results:
        size = row["size_bytes"]
        label = f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"
        cells = " ".join(f"{row[c]:>12.2f}" for c in columns)
        ratio = f"{row['tcp'] / row['socket']:>10.2f}" if "tcp" in row else ""
        print(f"{label:>9} {row['messages']:>6} {cells}   {ratio}")
    for backend in backends if with_fixed_cost else []:
        fixed = fixed_cost_us(results, backend)
        if fixed is not None:
            print(
                f"fixed cost per write call, {backend}: {fixed:.1f} us (intercept of time per write vs bytes)"
            )


# ---------------------------------------------------------------------------------- receiver process


async def _serve(region_bytes: int, spin_us: float | None, cpus: list[int]) -> None:
    where = transport_senders.pin_self(cpus, 0)
    receiver = KvReceiver(transport_senders.bench_config(spin_us, ["shm", "tcp"]), receiver_id="bench-rx")
    await receiver.start()
    receiver.register_region("buf", region_bytes)
    baseline = socket.create_server(("127.0.0.1", 0))
    loop = asyncio.get_running_loop()
    print(
        json.dumps(
            {"endpoint": receiver.endpoint(), "baseline_port": baseline.getsockname()[1], "cpus": where}
        ),
        flush=True,
    )
    while words := (await loop.run_in_executor(None, sys.stdin.readline)).split():
        if words[0] == "consume":
            print(json.dumps("waiting"), flush=True)
            for tag in range(int(words[1])):
                await receiver.wait("buf", tag, timeout_s=120)
            print(json.dumps("consumed"), flush=True)
        elif words[0] == "baseline":
            await loop.run_in_executor(None, _baseline_receive, baseline, int(words[1]), int(words[2]))
            print(json.dumps("received"), flush=True)
    baseline.close()
    await receiver.close()


def _baseline_receive(listener: socket.socket, size: int, count: int) -> None:
    conn, _ = listener.accept()
    with conn:
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        buffer = memoryview(bytearray(size))
        for _ in range(count):
            got = 0
            while got < size:
                n = conn.recv_into(buffer[got:])
                if n == 0:
                    raise RuntimeError("baseline sender went away")
                got += n
        conn.sendall(b"k")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        spin = sys.argv[3] if len(sys.argv) > 3 else "None"
        cpus = [int(c) for c in sys.argv[4].split(",") if c] if len(sys.argv) > 4 else []
        asyncio.run(_serve(int(sys.argv[2]), None if spin == "None" else float(spin), cpus))
    else:
        main_parser = argparse.ArgumentParser(prog="python -m loadgen.bench.transport")
        register(main_parser.add_subparsers(dest="bench", required=True))
        parsed = main_parser.parse_args()
        sys.exit(parsed.func(parsed))
