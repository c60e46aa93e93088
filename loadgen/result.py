"""The result JSON of a replay (schema `kvpath.loadgen.result/1`; documented in loadgen/README.md).

{"schema": "kvpath.loadgen.result/1",
 "meta":     run description: label, url, model, trace, mode, options, stop_reason, interrupted, ...,
 "summary":  metrics over every finished request (see `loadgen.metrics.summarize`),
 "window":   online runs: the same metrics over the last steady window (null for offline runs),
 "samples":  {"itl_s": [...]} up to 20,000 inter-token gaps (evenly thinned) for plots,
 "requests": one object per request: times from the run start, token counts, status and error}
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from loadgen.config import ReplayConfig
from loadgen.metrics import summarize
from loadgen.replay import RunState
from shared.errors import InvalidRequestError

SCHEMA = "kvpath.loadgen.result/1"
MAX_ITL_SAMPLES = 20_000


def build_result(
    config: ReplayConfig,
    state: RunState,
    *,
    model: str,
    trace_format: str,
    content_salt: int,
    started_at_s: float,
) -> dict[str, Any]:
    summary = summarize(
        state.records,
        arrivals_s=state.arrivals_s,
        ttft_slo_s=config.ttft_slo_s,
        tpot_slo_s=config.tpot_slo_s,
        itl_samples=state.itl_s,
    )
    meta = {
        "label": config.label or config.url,
        "url": config.url,
        "model": model,
        "trace": config.trace,
        "format": trace_format,
        "mode": config.mode,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started_at_s)),
        "duration_s": state.duration_s,
        "stop_reason": state.stop_reason,
        "interrupted": state.stop_reason == "interrupted",
        "sessions_started": state.sessions_started,
        "sessions_finished": state.sessions_finished,
        "history_fallbacks": state.history_fallbacks,
        "content_salt": content_salt,
        "config": {k: v for k, v in dataclasses.asdict(config).items() if k != "api_key"},
    }
    return {
        "schema": SCHEMA,
        "meta": meta,
        "summary": summary,
        "window": _window(config, state),
        "samples": {"itl_s": _thinned(state.itl_s, MAX_ITL_SAMPLES)},
        "requests": [r.to_json() for r in state.records],
    }


def _window(config: ReplayConfig, state: RunState) -> dict[str, Any] | None:
    """Online runs: the summary over requests sent in the last steady window."""
    if config.mode != "online" or not state.records:
        return None
    lo = state.duration_s - config.steady_window_s
    recent = [r for r in state.records if r.t_start_s >= lo]
    window: dict[str, Any] = {"from_s": max(0.0, lo), "to_s": state.duration_s}
    window.update(
        summarize(
            recent, arrivals_s=state.arrivals_s, ttft_slo_s=config.ttft_slo_s, tpot_slo_s=config.tpot_slo_s
        )
    )
    return window


def _thinned(values: Any, limit: int) -> list[float]:
    """At most `limit` values, evenly spaced over the run."""
    arr = np.frombuffer(values, dtype=np.float64) if len(values) else np.zeros(0)
    if arr.size > limit:
        arr = arr[np.linspace(0, arr.size - 1, limit).astype(np.int64)]
    return [float(x) for x in arr]


def write_result(path: str | Path, result: dict[str, Any]) -> None:
    """Write atomically, so an interrupted write never leaves half a file."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".loadgen-", suffix=".json", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(orjson.dumps(result, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY))
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_result(path: str | Path) -> dict[str, Any]:
    try:
        data = orjson.loads(Path(path).read_bytes())
    except OSError as exc:
        raise _bad(path, f"cannot read result: {exc.strerror or exc}") from exc
    except orjson.JSONDecodeError as exc:
        raise _bad(path, f"not a JSON result file: {exc}") from None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise _bad(path, f"not a loadgen result (schema {SCHEMA!r} expected)")
    return data


def _bad(path: str | Path, message: str) -> InvalidRequestError:
    return InvalidRequestError(f"{path}: {message}", code="invalid_result")
