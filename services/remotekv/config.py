"""Remote KV store configuration."""

from __future__ import annotations

from dataclasses import dataclass

from shared.config import BaseConfig, check, doc
from shared.transport.config import BACKENDS

DEFAULT_CHUNK_TOKENS = 256  # LMCache's default chunk: the super block the baseline stores and hits


@dataclass(slots=True)
class RemoteKvConfig(BaseConfig):
    capacity_bytes: int = doc(1 << 30, "DRAM the store holds super blocks in (LRU eviction beyond)")
    chunk_tokens: int = doc(DEFAULT_CHUNK_TOKENS, "tokens per super block; engines must use the same")
    kv_bind_host: str = doc("127.0.0.1", "address the store's KV data-plane receiver listens on")
    kv_backends: list[str] = doc(list(BACKENDS), "KV data-plane backends the store may use")  # noqa: RUF009
    max_keys_per_request: int = doc(4096, "most super blocks one PUT, COMMIT, GET or EXIST may name")
    max_concurrent_gets: int = doc(64, "GETs writing super blocks out at once (more wait on the bus)")
    max_timeout_s: float = doc(60.0, "longest deadline a request may ask for (PUT reservations, GET writes)")
    reap_interval_s: float = doc(0.5, "how often reservations past their deadline are given back")

    def validate(self) -> None:
        BaseConfig.validate(self)
        check(self.capacity_bytes >= 4096, "capacity_bytes", self.capacity_bytes, "must be >= 4096")
        check(self.chunk_tokens >= 1, "chunk_tokens", self.chunk_tokens, "must be >= 1")
        unknown = sorted(set(self.kv_backends) - set(BACKENDS))
        check(not unknown and bool(self.kv_backends), "kv_backends", self.kv_backends, f"some of {BACKENDS}")
        for name in ("max_keys_per_request", "max_concurrent_gets"):
            check(getattr(self, name) >= 1, name, getattr(self, name), "must be >= 1")
        for name in ("max_timeout_s", "reap_interval_s"):
            check(getattr(self, name) > 0, name, getattr(self, name), "must be > 0")
