"""Live progress on stderr: a tqdm bar on a terminal, plain lines otherwise (`--progress`).

Shows requests done and failed, requests in flight, the median TTFT of the last 200 requests and the output
token throughput of the last 10 seconds.
"""

from __future__ import annotations

import statistics
import sys
from collections import deque
from typing import Any, TextIO

from loadgen.metrics import CallRecord

_RECENT = 200
_RATE_WINDOW_S = 10.0


class Progress:
    def __init__(self, mode: str, total: int | None, *, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        if mode == "auto":
            mode = "bar" if self.stream.isatty() else "plain"
        self.mode = mode
        self.done = 0
        self.failed = 0
        self.inflight = 0
        self.sessions = 0
        self._ttfts: deque[float] = deque(maxlen=_RECENT)
        self._tokens: deque[tuple[float, int]] = deque()
        self._bar: Any = None
        if mode == "bar":
            from tqdm import tqdm

            self._bar = tqdm(total=total, unit="req", file=self.stream, dynamic_ncols=True, mininterval=0.5)

    def on_send(self) -> None:
        self.inflight += 1

    def on_record(self, record: CallRecord, now_s: float) -> None:
        self.inflight -= 1
        if record.ok:
            self.done += 1
            if record.ttft_s is not None:
                self._ttfts.append(record.ttft_s)
            self._tokens.append((now_s, record.output_tokens))
        else:
            self.failed += 1
        if self._bar is not None:
            self._bar.update(1)

    def status(self, now_s: float) -> str:
        while self._tokens and self._tokens[0][0] < now_s - _RATE_WINDOW_S:
            self._tokens.popleft()
        span = min(_RATE_WINDOW_S, max(now_s, 1e-9))
        rate = sum(n for _, n in self._tokens) / span
        ttft = f"{statistics.median(self._ttfts):.3f}s" if self._ttfts else "-"
        return (
            f"done={self.done} failed={self.failed} inflight={self.inflight} sessions={self.sessions} "
            f"ttft_p50={ttft} out_tok/s={rate:.0f}"
        )

    def tick(self, now_s: float) -> None:
        if self.mode == "bar" and self._bar is not None:
            self._bar.set_postfix_str(self.status(now_s), refresh=True)
        elif self.mode == "plain":
            print(f"loadgen t={now_s:.1f}s {self.status(now_s)}", file=self.stream, flush=True)

    def close(self, now_s: float) -> None:
        if self._bar is not None:
            self._bar.set_postfix_str(self.status(now_s), refresh=False)
            self._bar.close()
        elif self.mode == "plain":
            self.tick(now_s)
