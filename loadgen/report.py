"""Reports from result JSONs: `compare` (side by side with ratios) and PNG plots (matplotlib, Agg)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

_SKIP = ("hit_rate.per_turn",)


def flatten(summary: dict[str, Any], prefix: str = "") -> dict[str, float | None]:
    """Numeric leaves of a summary as dotted keys (`ttft_s.p50`), in order; lists are skipped."""
    out: dict[str, float | None] = {}
    for key, value in summary.items():
        name = f"{prefix}{key}"
        if name in _SKIP:
            continue
        if isinstance(value, dict):
            out.update(flatten(value, name + "."))
        elif value is None or (isinstance(value, int | float) and not isinstance(value, bool)):
            out[name] = None if value is None else float(value)
    return out


def compare_rows(a: dict[str, Any], b: dict[str, Any], section: str = "summary") -> list[dict[str, Any]]:
    """One row per metric present in either result: values and the ratio b / a (None when undefined)."""
    fa, fb = flatten(a.get(section) or {}), flatten(b.get(section) or {})
    rows = []
    for key in [*fa, *(k for k in fb if k not in fa)]:
        va, vb = fa.get(key), fb.get(key)
        ratio = vb / va if va not in (None, 0.0) and vb is not None else None
        rows.append({"metric": key, "a": va, "b": vb, "ratio": ratio})
    return rows


def _fmt(value: float | None) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if value == int(value) and abs(value) < 1e12:
        return str(int(value))
    return f"{value:.4g}"


def format_compare(a: dict[str, Any], b: dict[str, Any], section: str = "summary") -> str:
    rows = compare_rows(a, b, section)
    label_a = str(a.get("meta", {}).get("label", "A"))
    label_b = str(b.get("meta", {}).get("label", "B"))
    width = max([len("metric"), *(len(r["metric"]) for r in rows)])
    col = max(12, len(label_a), len(label_b))
    lines = [f"A: {label_a}", f"B: {label_b}", ""]
    lines.append(f"{'metric':<{width}}  {'A':>{col}}  {'B':>{col}}  {'B/A':>8}")
    lines.append("-" * (width + 2 * col + 14))
    for r in rows:
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.3f}"
        lines.append(f"{r['metric']:<{width}}  {_fmt(r['a']):>{col}}  {_fmt(r['b']):>{col}}  {ratio:>8}")
    return "\n".join(lines)


def _cdf(ax: Any, values: Sequence[float], label: str) -> None:
    data = np.sort(np.asarray([v for v in values if v is not None], dtype=np.float64))
    if data.size:
        ax.plot(data, np.arange(1, data.size + 1) / data.size, label=label)


def plot_results(results: Sequence[dict[str, Any]], out_dir: str | Path) -> list[Path]:
    """Latency CDFs, TTFT over time, hit rate per turn and throughput over time; one line per result."""
    import matplotlib

    matplotlib.use("Agg")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    runs = [(str(r.get("meta", {}).get("label", f"run {i}")), r) for i, r in enumerate(results)]
    paths = [
        _plot_cdfs(runs, out / "latency_cdf.png"),
        _plot_ttft_over_time(runs, out / "ttft_over_time.png"),
    ]
    if any(len(r["summary"]["hit_rate"]["per_turn"]) > 1 for _, r in runs):  # per turn: multi-turn only
        paths.append(_plot_hit_rate(runs, out / "hit_rate_per_turn.png"))
    paths.append(_plot_throughput(runs, out / "throughput_over_time.png"))
    return paths


Runs = Sequence[tuple[str, dict[str, Any]]]


def _metric_values(res: dict[str, Any], metric: str) -> list[float]:
    if metric == "itl_s":
        return list(res.get("samples", {}).get("itl_s", []))
    if metric == "queue_s":
        return [q["t_start_s"] - q["t_ready_s"] for q in res["requests"]]
    return [q[metric] for q in res["requests"] if q.get("error") is None and q.get(metric) is not None]


def _plot_cdfs(runs: Runs, path: Path) -> Path:
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(2, 3, figsize=(14, 8))
    for ax, metric in zip(
        axes.flat, ("ttft_s", "ttst_s", "tpot_s", "itl_s", "e2e_s", "queue_s"), strict=True
    ):
        for label, res in runs:
            _cdf(ax, _metric_values(res, metric), label)
        # few ticks in compact notation: client queueing spans microseconds to seconds, whose long
        # labels otherwise run into each other
        ax.xaxis.set_major_locator(MaxNLocator(nbins=5))
        ax.ticklabel_format(axis="x", style="sci", scilimits=(-2, 3))
        ax.set_xlabel(f"{metric[:-2].upper()} (s)")
        ax.set_ylabel("CDF")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    return _save(fig, path)


def _plot_ttft_over_time(runs: Runs, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 5))
    for label, res in runs:
        done = sorted((q["t_start_s"], q["ttft_s"]) for q in res["requests"] if q.get("ttft_s") is not None)
        if done:
            t, v = np.array(done).T
            ax.scatter(t, v, s=4, alpha=0.4)
            window = max(1, len(v) // 50)
            ax.plot(t, np.convolve(v, np.ones(window) / window, mode="same"), label=f"{label} (moving mean)")
    return _finish(fig, ax, path, "request sent at (s)", "TTFT (s)")


def _plot_hit_rate(runs: Runs, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 5))
    for label, res in runs:
        turns = res["summary"]["hit_rate"]["per_turn"]
        xs = [p["turn"] for p in turns]
        ax.plot(xs, [_nan(p["hit_rate"]) for p in turns], marker=".", label=f"{label} measured")
        ax.plot(xs, [_nan(p["ideal_hit_rate"]) for p in turns], linestyle="--", label=f"{label} ideal")
    ax.set_ylim(0, 1.02)
    return _finish(fig, ax, path, "turn", "cached prompt tokens / prompt tokens")


def _plot_throughput(runs: Runs, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 5))
    for label, res in runs:
        ends = [(q["t_end_s"], q["output_tokens"]) for q in res["requests"] if q.get("t_end_s") is not None]
        if ends:
            t, n = np.array(ends, dtype=np.float64).T
            bins = np.arange(0, math.ceil(t.max()) + 2)
            tokens, _ = np.histogram(t, bins=bins, weights=n)
            ax.step(bins[:-1], tokens, where="post", label=label)
    return _finish(fig, ax, path, "time (s)", "output tokens / s (finished requests)")


def _finish(fig: Any, ax: Any, path: Path, xlabel: str, ylabel: str) -> Path:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    return _save(fig, path)


def _nan(value: float | None) -> float:
    return math.nan if value is None else value


def _save(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
