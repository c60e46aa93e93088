"""`kvpath bench transport`'s arithmetic: the fixed cost per write is the intercept of time per write
against bytes, and `--repeats` reports each column's median per size."""

from __future__ import annotations

import pytest

from loadgen.bench.transport import fixed_cost_us, median_rows


def _row(size: int, shm: float, socket: float = 2.0) -> dict[str, float | int]:
    return {"size_bytes": size, "messages": 8, "blocks_per_write": 1, "shm": shm, "socket": socket}


def test_fixed_cost_is_the_intercept_of_seconds_per_write_against_bytes() -> None:
    # 20 us per write plus 1 ns per byte: 16 KiB in 36.384 us, 64 KiB in 85.536 us
    rows = [_row(s, s / ((20e-6 + s * 1e-9) * 1e9)) for s in (16 << 10, 64 << 10, 256 << 10)]
    assert fixed_cost_us(rows, "shm") == pytest.approx(20.0, rel=1e-6)
    assert fixed_cost_us(rows[:1], "shm") is None  # one size: no line to fit


def test_repeats_report_each_columns_median_per_size() -> None:
    runs = [
        [_row(16 << 10, 0.8, 2.0), _row(64 << 10, 3.0, 2.5)],
        [_row(16 << 10, 0.2, 1.0), _row(64 << 10, 0.5, 3.5)],  # a run that found the host slow
        [_row(16 << 10, 0.7, 3.0), _row(64 << 10, 2.9, 1.5)],
    ]
    rows = median_rows(runs, ["shm"])
    medians = [(r["size_bytes"], r["shm"], r["socket"]) for r in rows]
    assert medians == [(16 << 10, 0.7, 2.0), (64 << 10, 2.9, 2.5)]
    assert median_rows(runs[:1], ["shm"]) == runs[0]
