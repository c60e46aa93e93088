"""The PNG of `kvpath bench movequery --png FILE`: the microbenchmark's measured against predicted times, and
the fan-in's TTFT per primitive against N (one line style per memory configuration).

matplotlib is imported when a plot is asked for (as `loadgen/bench/ampd.py` does), so the bench runs
without it otherwise.
"""

from __future__ import annotations

from typing import Any

COLORS = {"route": "tab:blue", "fetch": "tab:orange", "local": "tab:green", "auto": "tab:red"}


def plot(report: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    _route_panel(axes[0], report.get("route", []))
    _chunk_panel(axes[1], report.get("fetch", []), report.get("local", []))
    _fanin_panel(axes[2], report.get("fanin", []))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _route_panel(ax: Any, rows: list[dict[str, Any]]) -> None:
    """One layer's route exchange against M_q: measured (dots), predicted (lines), per backend and chunk."""
    series: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in rows:
        series.setdefault((r["backend"], r["chunk"]), []).append(r)
    for (backend, chunk), points in sorted(series.items()):
        points.sort(key=lambda r: r["rows"])
        xs = [r["rows"] for r in points]
        (line,) = ax.plot(xs, [r["predicted_s"] * 1e3 for r in points], "-", lw=1)
        label = f"{backend} chunk {chunk}"
        ax.plot(xs, [r["s"] * 1e3 for r in points], "o", ms=3, color=line.get_color(), label=label)
    ax.set(xscale="log", yscale="log", xlabel="M_q (query rows)", ylabel="ms")
    ax.set_title("route exchange, one layer: measured (dots) vs model (lines)", fontsize=9)
    _legend(ax, ncol=2)


def _chunk_panel(ax: Any, fetch: list[dict[str, Any]], local: list[dict[str, Any]]) -> None:
    """Fetch (per backend) and local against the chunk's length, measured (dots) and predicted (lines)."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in fetch:
        groups.setdefault(f"fetch {r['backend']}", []).append(r)
    groups["local"] = list(local)
    for name, points in groups.items():
        points = sorted(points, key=lambda r: r["chunk"])
        if not points:
            continue
        xs = [r["chunk"] for r in points]
        (dots,) = ax.plot(xs, [r["s"] * 1e3 for r in points], "o", ms=4, label=f"{name} measured")
        predicted = [(r["chunk"], r["predicted_s"] * 1e3) for r in points if r["predicted_s"] is not None]
        if predicted:
            ax.plot(*zip(*predicted, strict=True), "-", lw=1, color=dots.get_color(), label=f"{name} model")
    ax.set(xscale="log", yscale="log", xlabel="chunk tokens", ylabel="ms")
    chunks = sorted({r["chunk"] for points in groups.values() for r in points})
    ax.set_xticks(chunks, [str(c) for c in chunks])
    ax.minorticks_off()
    ax.set_title("whole chunk: fetch (pull + splice) and local (recompute)", fontsize=9)
    _legend(ax)


def _fanin_panel(ax: Any, rows: list[dict[str, Any]]) -> None:
    """Fan-in TTFT p50 against N per primitive; solid: default caches, dashed: memory-bound requesters."""
    configs = sorted({r.get("kv_blocks", 0) for r in rows})
    for kv_blocks in configs:
        style = "-" if kv_blocks == 0 else "--"
        for primitive, color in COLORS.items():
            points = sorted(
                (r["n"], r["ttft_p50_s"])
                for r in rows
                if r["primitive"] == primitive and r.get("kv_blocks", 0) == kv_blocks
            )
            if not points:
                continue
            memory = "default cache" if kv_blocks == 0 else f"{kv_blocks} blocks/requester"
            xs, ys = zip(*points, strict=True)
            ax.plot(xs, ys, style, marker="o", ms=3, color=color, label=f"{primitive}, {memory}")
    ax.set(xlabel="N sub-agents", ylabel="TTFT p50 (s)")
    ax.set_title("fan-in: TTFT per primitive", fontsize=9)
    _legend(ax)


def _legend(ax: Any, ncol: int = 1) -> None:
    if ax.get_legend_handles_labels()[0]:  # a panel without data (no microbenchmark, no fan-in) has none
        ax.legend(fontsize=6, ncol=ncol)
