"""`kvpath bench tracing` pieces: the OTLP sink counts what a real exporter sends; the summary math."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Iterator

import pytest

from loadgen.bench.tracing import OtlpSink, add_args, format_summary, summarize
from shared import telemetry


@pytest.fixture(autouse=True)
def tracing_off(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv(telemetry.TRACE_DIR_ENV, raising=False)
    telemetry.shutdown_tracing()
    yield
    telemetry.shutdown_tracing()


async def test_sink_counts_spans_from_the_otlp_exporter(monkeypatch: pytest.MonkeyPatch) -> None:
    sink = OtlpSink()
    await sink.start()
    try:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", sink.url)
        assert telemetry.setup_tracing("kvpath-benchtest")
        with telemetry.span("a"), telemetry.span("b"):
            pass
        with telemetry.span("a"):
            pass
        assert await asyncio.to_thread(telemetry.force_flush, 10.0)
    finally:
        await sink.stop()
    assert sink.num_spans == 3 and sink.span_names == {"a": 2, "b": 1}
    assert sink.num_exports >= 1 and sink.num_bytes > 0


def test_summary_medians_and_losses() -> None:
    parser = argparse.ArgumentParser()
    add_args(parser)
    args = parser.parse_args(["--blocks", "1", "--repeats", "3", "--requests", "10", "--concurrency", "2"])

    def row(tps: float, cpu_ms: float = 10.0) -> dict[str, float]:
        return {"output_tokens_per_s": tps, "requests_per_s": tps / 64, "ttft_p50_ms": 100.0,
                "itl_p50_ms": 5.0, "num_failed": 0.0, "cpu_ms_per_request": cpu_ms}  # fmt: skip

    runs = {"off": [row(100), row(200), row(110)], "on": [row(99, 9), row(150, 11), row(110, 11)]}
    sink = OtlpSink(num_exports=2, num_spans=320, num_bytes=1000)
    result = summarize(runs, sink, args)
    assert result["medians"]["off"]["output_tokens_per_s"] == 110
    assert result["medians"]["on"]["output_tokens_per_s"] == 110
    assert result["throughput_loss"] == 0.0 and result["meets_target"]
    assert result["paired_losses"] == pytest.approx([0.01, 0.25, 0.0])
    assert result["paired_loss_median"] == pytest.approx(0.01)
    assert result["cpu_overhead"] == pytest.approx(0.1)
    assert result["sink"]["spans_per_request"] == 320 / (3 * 10 + 2)
    text = format_summary(result)
    assert "0.0% (within the 5% target)" in text and "median of the per-repetition losses 1.0%" in text
    assert "cluster CPU per request with tracing on: +10.0%" in text
