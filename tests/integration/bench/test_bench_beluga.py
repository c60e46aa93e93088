"""`kvpath bench beluga --parts load`: every source loads the stored blocks (the bench checks the bytes it
read against the blocks it stored and fails otherwise) against real pool, remote store and storage
processes, and the JSON carries the load headline."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from loadgen.bench.beluga_load import SOURCES


def test_load_part_reads_every_source_and_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "beluga.json"
    cmd = [
        sys.executable, "-m", "services.cli", "bench", "beluga", "--parts", "load",
        "--load-block-sizes", "128", "--load-mib", "4", "--load-repeats", "1", "--json", str(out),
    ]  # fmt: skip
    result = subprocess.run(
        cmd, capture_output=True, text=True, timeout=150, cwd=Path(__file__).resolve().parents[3]
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    data = json.loads(out.read_text())
    rows = {r["source"]: r for r in data["load"]["results"]}
    assert set(rows) == set(SOURCES)
    assert all(r["block_size"] == 128 and r["layer_block_bytes"] == 64 << 10 for r in rows.values())
    assert all(r["bytes_per_read"] == 4 << 20 and r["gbps"] > 0 for r in rows.values())
    assert rows["memcpy"]["ratio_to_memcpy"] == 1.0
    assert data["pool_load_gbps"] == rows["pool"]["gbps"] and data["memcpy_gbps"] == rows["memcpy"]["gbps"]
    assert data["pool_cold_gbps"] == rows["pool-cold"]["gbps"]  # first loads (re-loads skip the hashing)
    assert data["rpc_rtt_p50_us"] is None and data["ttft_speedup"] is None  # parts that did not run
    assert "KV load" in result.stdout and "headline" in result.stdout
