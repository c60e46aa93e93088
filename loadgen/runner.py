"""`run_replay`: the async shell around the replay engine (HTTP session, signals, result file, plots)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import secrets
import signal
import time
from collections.abc import Iterator
from typing import Any, TextIO

import aiohttp

from loadgen.client import OpenAIClient, model_card
from loadgen.config import ReplayConfig
from loadgen.plan import session_source
from loadgen.progress import Progress
from loadgen.replay import Replayer
from loadgen.result import build_result, write_result
from loadgen.trace import Trace

log = logging.getLogger(__name__)


async def run_replay(
    config: ReplayConfig,
    trace: Trace,
    *,
    stop: asyncio.Event | None = None,
    progress_stream: TextIO | None = None,
) -> dict[str, Any]:
    """Replay `trace` against `config.url`, write the result JSON (and plots) and return it.

    SIGINT / SIGTERM (or `stop`) end the run early; the partial result is still written.
    """
    salt = config.content_salt if config.content_salt >= 0 else secrets.randbits(63)
    started_at = time.time()
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else None
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, headers=headers) as http:
        card = await model_card(http, config.url, config.model)
        model = str(card["id"])
        if not config.vocab_size:
            config = dataclasses.replace(config, vocab_size=_vocab_size(card, config.min_token_id))
        source = session_source(trace, config, salt, run_tag=f"{salt & 0xFFFFFF:06x}")
        client = _client(
            http, config, model, want_token_ids=config.history == "output" and source.opts.is_token_prompt
        )
        progress = Progress(
            config.progress,
            _progress_total(config, source.size, source.calls_per_pass),
            stream=progress_stream,
        )
        replayer = Replayer(config, source, client, progress, stop or asyncio.Event())
        with _signals_call(replayer.interrupt):
            state = await replayer.run()
    result = build_result(
        config, state, model=model, trace_format=trace.format, content_salt=salt, started_at_s=started_at
    )
    write_result(config.out, result)
    if config.plot_dir:
        from loadgen.report import plot_results

        plot_results([result], config.plot_dir)
    return result


def _vocab_size(card: dict[str, Any], min_token_id: int) -> int:
    """Token ids a synthetic prompt may use: the served vocabulary above `min_token_id` (kvpath's model card
    says `vocab_size`), else the usual 32000."""
    vocab = card.get("vocab_size")
    if isinstance(vocab, int) and vocab - min_token_id >= 2:
        return vocab - min_token_id
    log.info("the server does not say its vocabulary size: token ids below %d", 32000 + min_token_id)
    return 32000


def _client(
    http: aiohttp.ClientSession, config: ReplayConfig, model: str, *, want_token_ids: bool
) -> OpenAIClient:
    return OpenAIClient(
        http,
        config.url,
        model,
        endpoint=config.endpoint,
        exact_lengths=config.exact_lengths,
        want_token_ids=want_token_ids,
        session_header=config.session_header,
        temperature=config.temperature if config.temperature >= 0 else None,
        extra_body=config.extra_body_dict(),
        timeout_s=config.request_timeout_s,
    )


def _progress_total(config: ReplayConfig, size: int, calls: int) -> int | None:
    if config.mode == "online":
        return None
    agents = config.agents or size
    return round(calls * agents / size)


@contextlib.contextmanager
def _signals_call(callback: Any) -> Iterator[None]:
    """SIGINT and SIGTERM call `callback` while inside (the default handlers come back after)."""
    loop = asyncio.get_running_loop()
    installed = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, callback)
            installed.append(sig)
        except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, or no signals
            pass
    try:
        yield
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)


def summary_lines(result: dict[str, Any]) -> list[str]:
    """A short human summary of a result."""
    s, meta = result["summary"], result["meta"]
    req, thr, hit, slo = s["requests"], s["throughput"], s["hit_rate"], s["slo"]

    def f(value: Any, spec: str = ".3f") -> str:
        return "-" if value is None else format(value, spec)

    ttft, tpot, e2e = s["ttft_s"], s["tpot_s"], s["e2e_s"]
    return [
        f"run: {meta['label']}  mode={meta['mode']}  model={meta['model']}  stop={meta['stop_reason']}"
        f"  duration={f(meta['duration_s'], '.1f')}s",
        f"requests: {req['completed']} ok, {req['failed']} failed, {req['cancelled']} cancelled, "
        f"{req['length_mismatches']} with another output length; sessions {s['sessions']}",
        f"TTFT p50/p99: {f(ttft['p50'])}/{f(ttft['p99'])} s   TTST p50: {f(s['ttst_s']['p50'])} s"
        f"   TPOT p50/p99: {f(tpot['p50'], '.4f')}/{f(tpot['p99'], '.4f')} s",
        f"E2E p50: {f(e2e['p50'])} s   JCT (all agents): {f(s['jct']['all_agents_s'], '.1f')} s",
        f"throughput: {f(thr['requests_per_s'], '.2f')} req/s,"
        f" {f(thr['input_tokens_per_s'], '.0f')} in tok/s, {f(thr['output_tokens_per_s'], '.0f')} out tok/s",
        f"hit rate: overall {f(hit['overall'])} (ideal {f(hit['ideal_overall'])}),"
        f" from turn 2 {f(hit['from_turn_2'])} (ideal {f(hit['ideal_from_turn_2'])})",
        f"SLO (TTFT<={slo['ttft_s']}s, TPOT<={slo['tpot_s']}s):"
        f" per request {f(slo['per_request_attainment'])}, per session {f(slo['per_session_attainment'])},"
        f" goodput {f(slo['goodput_requests_per_s'], '.2f')} req/s",
    ]
