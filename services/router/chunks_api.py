"""Named held chunks over HTTP (move the query's `kv_chunk` extension), each tenant seeing its own only.

A request with `"kv_chunk": "<name>"` makes its prompt a held chunk under that name: pinned on an engine that
holds chunks, never evicted to make room for another, until it is deleted here (or its holder stops).
- `GET /v1/kv_chunks`: `{"object": "list", "data": [{"id", "object": "kv_chunk", "holder", "tokens",
  "sessions", "last_used_at"}], "unreachable": [holders that did not answer]}`;
- `DELETE /v1/kv_chunks/{name}`: the name is dropped on every holder, a chunk left without names and route
  sessions is freed at once; `{"id", "object": "kv_chunk.deleted", "deleted": true}`, or a 404 in OpenAI's
  error format when no holder had the name.
Both ask every live holder (`ChunkQuery` / `ChunkUnpin` on `route.<engine>`) with a short deadline.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import orjson
from aiohttp import web

from services.router.auth import TENANT
from shared.errors import InvalidRequestError, KvpathError, NotFoundError
from shared.protocol.movequery import (
    ChunkList,
    ChunkName,
    ChunkQuery,
    ChunkUnpin,
    HeldChunkInfo,
    check_chunk_name,
)

log = logging.getLogger(__name__)

ASK_TIMEOUT_S = 2.0


def add_routes(app: web.Application, core: Callable[[web.Request], Any]) -> None:
    """`core(request)`: the router's `RouterCore` (its bus and engine table)."""

    async def list_chunks(request: web.Request) -> web.Response:
        chunks, unreachable = await _ask_holders(core(request), ChunkQuery(tenant=request.get(TENANT, "")))
        data = [_card(name, info) for info in chunks for name in info.names]
        return _json({"object": "list", "data": data, "unreachable": unreachable})

    async def delete_chunk(request: web.Request) -> web.Response:
        try:
            name = check_chunk_name(request.match_info["name"])
        except ValueError as exc:
            return _error(InvalidRequestError(str(exc), param="name"))
        unpin = ChunkUnpin(chunk=ChunkName(name=name, tenant=request.get(TENANT, "")))
        chunks, unreachable = await _ask_holders(core(request), unpin)
        if not chunks:
            more = f" ({len(unreachable)} holders did not answer)" if unreachable else ""
            return _error(NotFoundError(f"No chunk is named '{name}'{more}", param="name"))
        return _json({"id": name, "object": "kv_chunk.deleted", "deleted": True})

    app.router.add_get("/v1/kv_chunks", list_chunks)
    app.router.add_delete("/v1/kv_chunks/{name}", delete_chunk)


async def _ask_holders(core: Any, msg: ChunkQuery | ChunkUnpin) -> tuple[list[HeldChunkInfo], list[str]]:
    """Every live holder's answer (the chunks it lists) and the holders that gave none."""
    holders = [
        state.report.service_id
        for state in core.engines.live(time.monotonic())
        if state.report.route is not None and state.report.route.hold_budget_blocks > 0
    ]
    replies = await asyncio.gather(
        *(
            core.bus.request(core.bus.subjects.route(h), msg, ChunkList, timeout_s=ASK_TIMEOUT_S)
            for h in holders
        ),
        return_exceptions=True,
    )
    chunks: list[HeldChunkInfo] = []
    unreachable: list[str] = []
    for holder, reply in zip(holders, replies, strict=True):
        if isinstance(reply, ChunkList):
            chunks += reply.chunks
        elif isinstance(reply, KvpathError):
            log.warning("holder %s did not answer %s: %s", holder, msg.KIND, reply.message)
            unreachable.append(holder)
        else:
            raise reply
    return chunks, unreachable


def _card(name: str, info: HeldChunkInfo) -> dict[str, Any]:
    return {
        "id": name,
        "object": "kv_chunk",
        "holder": info.engine_id,
        "tokens": info.num_tokens,
        "sessions": info.num_sessions,
        "last_used_at": int(info.last_used_unix_s),
    }


def _json(body: Any, status: int = 200) -> web.Response:
    return web.json_response(body, status=status, dumps=lambda o: orjson.dumps(o).decode())


def _error(exc: KvpathError) -> web.Response:
    return _json(exc.to_openai_body(), exc.http_status)
