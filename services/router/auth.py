"""API keys of the OpenAI API: who may call it, and which tenant a call belongs to.

Keys come from `api_key_file` (one per line: `<key>` or `<key> <tenant>`; `#` comments) and `api_keys`
(each `<key>` or `<key>:<tenant>`, for development: flags and environment variables are visible to other users
of the host). A key without a tenant is its own tenant. With no key configured the API is open (the default
of a local `kvpath up`). Checking a key costs the same whatever it is: every configured key is compared, as
SHA-256 digests with `hmac.compare_digest`, with no early exit, so timing says nothing about how much of a
guess was right. `/health`, `/ready`, `/metrics` and `/version` stay open (probes and scrapers carry no key).

The tenant salts the request's KV block hashes (`services/router/kv_plan.py`): requests of different tenants
never share cached KV, and `cached_tokens` cannot tell one tenant what another sent.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web
from aiohttp.typedefs import Middleware

from shared.errors import AuthenticationError, ConfigError

log = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/health", "/ready", "/metrics", "/version"})
TENANT = web.RequestKey("tenant", str)  # the caller's tenant ("" when the API is open)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(slots=True, frozen=True)
class _Key:
    digest: bytes
    tenant: str


class ApiKeys:
    def __init__(self, entries: Iterable[tuple[str, str]]) -> None:
        self._keys: list[_Key] = []
        for key, tenant in entries:
            if len(key) < 8:
                raise ConfigError("an API key must have at least 8 characters", param="api_keys")
            self._keys.append(_Key(_digest(key), tenant or "key-" + _digest(key).hex()[:16]))

    @classmethod
    def load(cls, keys: Iterable[str], key_file: str) -> ApiKeys:
        entries = [_split(item, ":") for item in keys if item]
        if key_file:
            try:
                lines = Path(key_file).read_text().splitlines()
            except OSError as exc:
                raise ConfigError(f"api_key_file: cannot read {key_file}: {exc.strerror}") from exc
            for line in lines:
                line = line.split("#", 1)[0].strip()
                if line:
                    entries.append(_split(line, None))
        return cls(entries)

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def tenant_of(self, authorization: str | None) -> str:
        """The tenant of a request's `Authorization: Bearer <key>`; raises AuthenticationError."""
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise AuthenticationError(
                "You didn't provide an API key: send it as 'Authorization: Bearer YOUR_KEY'"
            )
        digest = _digest(key.strip())
        found = ""
        for candidate in self._keys:  # every key, no early exit: the time does not depend on the match
            if hmac.compare_digest(candidate.digest, digest):
                found = candidate.tenant
        if not found:
            raise AuthenticationError("Incorrect API key provided")
        return found

    def middleware(self) -> Middleware:
        @web.middleware
        async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
            if request.path in OPEN_PATHS:
                return await handler(request)
            if self.enabled:
                try:
                    request[TENANT] = self.tenant_of(request.headers.get("Authorization"))
                except AuthenticationError as exc:
                    return web.json_response(
                        exc.to_openai_body(), status=exc.http_status, headers={"WWW-Authenticate": "Bearer"}
                    )
            else:
                request[TENANT] = ""
            return await handler(request)

        return check


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def _split(item: str, sep: str | None) -> tuple[str, str]:
    parts = item.split(sep, 1) if sep else item.split(None, 1)
    return parts[0].strip(), (parts[1].strip() if len(parts) > 1 else "")
