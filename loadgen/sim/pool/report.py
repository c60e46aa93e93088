"""The sweep's table: Table 5's rows as simulated, the paper's in parentheses, then the headline ratios."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]
    return [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in (header, *rows)
    ]


def _cell(value: float | None, paper: float | None, fmt: str, unit: str = "") -> str:
    text = "-" if value is None else f"{value:{fmt}}{unit}"
    return text if paper is None else f"{text} ({paper:{fmt}})"


def _cells(row: dict[str, Any]) -> tuple[str, ...]:
    paper = row["paper"] or {}
    return (
        row["run"],
        row["system"],
        _cell(row["ttft_mean_s"], paper.get("ttft_mean_s"), ".2f", " s"),
        _cell(row["ttft_p99_s"], paper.get("ttft_p99_s"), ".2f", " s"),
        _cell(row["tpot_mean_s"], paper.get("tpot_mean_s"), ".3f", " s"),
        _cell(row["qps"], paper.get("qps"), ".2f"),
        f"{row['hit_ratio']:.0%} (HBM {row['hbm_hit_ratio']:.1%})",
    )


def _headline(result: dict[str, Any]) -> list[str]:
    paper = result["paper"]
    return [
        f"cache-hit run: TTFT -{result['sim_ttft_reduction']:.1%} (paper -{paper['ttft_reduction']:.1%}), "
        f"QPS {result['sim_qps_speedup']:.2f}x (paper {paper['qps_speedup']:.2f}x)",
        f"cache-populate run: TTFT -{result['sim_populate_ttft_reduction']:.1%} "
        f"(paper -{paper['populate_ttft_reduction']:.1%}), QPS +{result['sim_populate_qps_gain']:.1%} "
        f"(paper +{paper['populate_qps_gain']:.1%})",
    ]


def _sensitivity(result: dict[str, Any]) -> list[str]:
    sens, paper = result["sensitivity"], result["paper"]
    if not sens:
        return []
    hit = {row["system"]: row for row in result["rows"] if row["run"] == "hit"}
    mooncake, beluga = hit["vLLM+MoonCake"], hit["vLLM+Beluga"]
    return [
        f"baseline block size, cache-hit TTFT: {sens['mooncake_16']['ttft_mean_s']:.1f} s at 16 tokens vs "
        f"{mooncake['ttft_mean_s']:.1f} s at 256 (paper {paper['mooncake_16_hit_ttft_s']} s vs "
        f"{paper['mooncake_256_hit_ttft_s']} s)",
        f"Beluga interleaving, cache-hit QPS: {beluga['qps']:.2f} with vs "
        f"{sens['beluga_no_interleave']['qps']:.2f} without (paper {paper['beluga_interleave_hit_qps']} vs "
        f"{paper['beluga_no_interleave_hit_qps']})",
    ]


def format_beluga(result: dict[str, Any]) -> str:
    setup = result["setup"]
    lines = [
        f"Beluga at paper scale: {setup['servers']} servers x {setup['gpus_per_server']} GPUs "
        f"({setup['instances']} instances), {setup['clients']} closed-loop clients, {setup['requests']} "
        f"LV-Eval-like requests ({setup['documents']} documents, prompt mean "
        f"{setup['prompt_tokens_mean']:,.0f} tokens), seed {setup['seed']}; paper's Table 5 in parentheses"
    ]
    header = ("run", "system", "avg TTFT", "P99 TTFT", "avg TPOT", "QPS", "prompt hits")
    lines += _table(header, [_cells(row) for row in result["rows"]])
    lines += _headline(result) + _sensitivity(result)
    lines.append(f"({result['wall_s']:.1f} s wall)")
    return "\n".join(lines)
