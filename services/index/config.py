"""Metadata index configuration."""

from __future__ import annotations

from dataclasses import dataclass

from shared.config import BaseConfig, check, doc


@dataclass(slots=True)
class IndexConfig(BaseConfig):
    data_dir: str = doc("", "directory for index snapshots; empty: no snapshots (restart replays the stream)")
    snapshot_every_events: int = doc(20_000, "take a snapshot after this many stream messages since the last")
    snapshot_every_s: float = doc(
        60.0, "also take one when this many seconds passed since the last and any message came (0: never)"
    )
    purge_after_snapshot: bool = doc(True, "purge stream messages a snapshot covers (needs data_dir)")
    snapshot_on_stop: bool = doc(True, "take a snapshot on a graceful stop (needs data_dir)")
    replay_timeout_s: float = doc(120.0, "catching up with the stream on start may take at most this long")
    fetch_batch: int = doc(512, "KV events fetched from the stream per request")
    fetch_wait_s: float = doc(0.5, "how long one fetch waits for new events")
    max_match_blocks: int = doc(131_072, "most block hashes one match request may carry")
    initial_capacity: int = doc(1 << 16, "initial slots of the hash table (it grows by doubling)")
    stream_max_bytes: int = doc(
        -1, "size limit of the KV-events stream when this service creates it; -1: none"
    )

    def validate(self) -> None:
        BaseConfig.validate(self)
        for name in ("snapshot_every_events", "fetch_batch", "max_match_blocks", "initial_capacity"):
            check(getattr(self, name) >= 1, name, getattr(self, name), "must be >= 1")
        check(self.snapshot_every_s >= 0, "snapshot_every_s", self.snapshot_every_s, "must be >= 0")
        for name in ("replay_timeout_s", "fetch_wait_s"):
            check(getattr(self, name) > 0, name, getattr(self, name), "must be > 0")
