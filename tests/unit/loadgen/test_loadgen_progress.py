"""The live progress display: a tqdm bar or plain lines, with done/failed counts, TTFT and throughput."""

from __future__ import annotations

import io

from loadgen.metrics import CallRecord
from loadgen.progress import Progress


def finished(ttft: float, ok: bool = True) -> CallRecord:
    r = CallRecord(
        "s", 0, 0.0, 1.0, 4, t_first_s=1.0 + ttft, t_last_token_s=1.5, t_end_s=1.5, output_tokens=4
    )
    if not ok:
        r.error = "boom"
    return r


def test_plain_lines() -> None:
    out = io.StringIO()
    progress = Progress("plain", None, stream=out)
    for ttft in (0.1, 0.3, 0.2):
        progress.on_send()
        progress.on_record(finished(ttft), now_s=2.0)
    progress.on_send()
    progress.on_record(finished(0.0, ok=False), now_s=2.0)
    progress.tick(2.0)
    line = out.getvalue().strip()
    assert line.startswith("loadgen t=2.0s")
    assert "done=3 failed=1 inflight=0" in line and "ttft_p50=0.200s" in line and "out_tok/s=6" in line


def test_bar_and_auto_mode() -> None:
    out = io.StringIO()
    progress = Progress("bar", 2, stream=out)
    progress.on_send()
    progress.on_record(finished(0.5), now_s=1.0)
    progress.tick(1.0)
    progress.close(1.0)
    text = out.getvalue()
    assert "1/2" in text and "ttft_p50=0.500s" in text
    assert Progress("auto", None, stream=io.StringIO()).mode == "plain"  # not a terminal
