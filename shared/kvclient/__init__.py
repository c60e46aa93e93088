"""What engines and the router call to use the KV tiers: index lookups, storage reads/writes, KV events.

    IndexClient(bus).match(hashes)                -> MatchResult (longest stored prefix, per tier)
    StorageClient(bus, node, layout, fingerprint)   the node's storage service:
        read(request_id, hashes, deadline_s=)     -> ReadLease (zero-copy views into the node buffer)
        stage(n) -> StagedBlocks; write(staged, hashes, parents)   persist blocks from the staging segment
    KvEventPublisher(bus, source)                   BlockStored / BlockRemoved / Cleared events
    ensure_kv_events_stream(bus)                    create the stream idempotently (whoever starts first)

KV bytes never travel over NATS: reads land in the node's shared-memory buffer and the reply names the
offset; writes name offsets in a staging segment the client owns and the storage service maps by name.
Every call has a deadline and raises `shared.errors` types (ServiceUnavailableError when nobody answers,
DeadlineExceededError on expiry), so callers can fall back to recomputing.
"""

from shared.kvclient.events import KvEventPublisher, ensure_kv_events_stream
from shared.kvclient.index import IndexClient, MatchResult
from shared.kvclient.storage import ReadLease, StagedBlocks, StorageClient, WriteResult

__all__ = [
    "IndexClient",
    "KvEventPublisher",
    "MatchResult",
    "ReadLease",
    "StagedBlocks",
    "StorageClient",
    "WriteResult",
    "ensure_kv_events_stream",
]
