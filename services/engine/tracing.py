"""Per-request spans of an engine, parented on the router's request span (from the task's headers).

Choice (issue 7): prefill is traced per request, not per batch. A request's spans, children of the
router's HTTP span, are:
  `kv.load`     colocated/PE: fetching the stored prefix before scheduling (storage read, or the DE-side
                pull of the DualPath DE read path); `kv.receive` on a DE: waiting until the PE has written
                the whole prompt KV into the DE buffer.
  `prefill`     colocated/PE: queued for scheduling -> first token sampled. One `chunk` event per prefill
                step the request took part in (start, tokens, loaded tokens), so batching and chunking show.
  `decode`      colocated: first token -> finish; DE: takeover of the prefilled prompt -> finish.
The KV transfer spans live next to the bytes they move (prefill_connector, decode_connector).
Every function here returns at once while tracing is off (`seq.trace` is None).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.engine.scheduler import PrefillChunk
from services.engine.sequence import Sequence
from shared import telemetry

ROLE_DECODE = "decode"
ROLE_PREFILL = "prefill"


@dataclass(slots=True)
class SeqTrace:
    parent: Any  # OpenTelemetry context of the router's request span (None: the request is a root)
    prefill: Any = None  # open spans
    decode: Any = None


def attach(seq: Sequence, parent: Any) -> None:
    """At admission: remember where the request's spans hang (only while tracing is on)."""
    if telemetry.tracing_enabled():
        seq.trace = SeqTrace(parent)


def kv_span(seq: Sequence, role: str) -> Any:
    """Context manager around the connector's `prepare`: `kv.receive` on a DE, else `kv.load`."""
    if seq.trace is None:
        return telemetry.NO_SPAN
    name = "kv.receive" if role == ROLE_DECODE else "kv.load"
    return telemetry.span(name, parent=seq.trace.parent, attributes={"request_id": seq.request_id})


def queued(seq: Sequence, role: str) -> None:
    """The sequence joined the scheduler's queue: its prefill (DE: its decode) span starts."""
    t = seq.trace
    if t is None:
        return
    attributes = {
        "request_id": seq.request_id,
        "prompt_tokens": seq.num_prompt_tokens,
        "hit_tokens": seq.num_hit_tokens,
    }
    if role == ROLE_DECODE:
        t.decode = telemetry.start_span("decode", parent=t.parent, attributes=attributes)
    else:
        t.prefill = telemetry.start_span("prefill", parent=t.parent, attributes=attributes)


def prefill_chunk(chunk: PrefillChunk) -> None:
    t = chunk.seq.trace
    if t is not None and t.prefill is not None:
        t.prefill.add_event(
            "chunk",
            {"start": chunk.start, "num_tokens": chunk.num_tokens, "load_tokens": chunk.load_tokens},
        )


def first_token(seq: Sequence, role: str) -> None:
    """The first output token was sampled: prefill ends; a colocated engine's decode starts."""
    t = seq.trace
    if t is None:
        return
    _end_prefill(seq, t)
    if role != ROLE_PREFILL:
        t.decode = telemetry.start_span("decode", parent=t.parent, attributes={"request_id": seq.request_id})


def finished(seq: Sequence) -> None:
    """The request left the engine (any reason): end whatever is open, failures marked as errors."""
    t = seq.trace
    if t is None:
        return
    error = f"{seq.error_code}: {seq.error_message}" if seq.finish_reason == "error" else ""
    if t.prefill is not None:
        _end_prefill(seq, t, error=error)
    if t.decode is not None:
        attributes = {
            "output_tokens": len(seq.output_token_ids),
            "finish_reason": seq.finish_reason or "",
            "num_preemptions": seq.num_preemptions,
        }
        telemetry.end_span(t.decode, error=error, attributes=attributes)
        t.decode = None


def _end_prefill(seq: Sequence, t: SeqTrace, *, error: str = "") -> None:
    attributes = {
        "cached_tokens": seq.num_cached_tokens,
        "computed_tokens": max(0, seq.num_computed_tokens - seq.num_cached_tokens),
        "finish_reason": seq.finish_reason or "",
    }
    telemetry.end_span(t.prefill, error=error, attributes=attributes)
    t.prefill = None
