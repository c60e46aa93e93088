"""Index snapshots as one file under the data dir: live (hash, mask) arrays plus JSON metadata.

Written to a temporary file, fsynced and renamed, so a crash leaves the previous snapshot intact.
Restart = load the snapshot, then replay the KV-events stream from `applied_stream_seq + 1`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

SNAPSHOT_NAME = "index-snapshot.npz"
FORMAT_VERSION = 1


def save(path: Path, arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> int:
    """Write the snapshot (arrays `keys` and `values`) atomically; return its size in bytes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    meta_bytes = json.dumps({"format_version": FORMAT_VERSION, **meta}).encode()
    with open(tmp, "wb") as f:
        np.savez(
            f, meta=np.frombuffer(meta_bytes, dtype=np.uint8), keys=arrays["keys"], values=arrays["values"]
        )
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path.stat().st_size


def load(path: Path) -> tuple[dict[str, np.ndarray], dict[str, Any]] | None:
    """(arrays, metadata), or None when there is no snapshot. Raises ValueError on an unreadable one."""
    if not path.exists():
        return None
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {name: data[name] for name in data.files if name != "meta"}
            meta = json.loads(data["meta"].tobytes())
    except (OSError, KeyError, ValueError) as exc:
        raise ValueError(f"unreadable index snapshot {path}: {exc}") from exc
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"index snapshot {path} has format {meta.get('format_version')}, need {FORMAT_VERSION}"
        )
    return arrays, meta
