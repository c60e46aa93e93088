"""`kvpath serve storage --node N --root DIR`: one node's storage service (block files <-> node buffer)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from services.storage.config import StorageConfig
from shared.service import Service, serve_main


def _build(config: StorageConfig) -> Service:
    from services.storage.service import StorageService

    return StorageService(config)


def main(argv: Sequence[str] | None = None) -> int:
    return serve_main(argv, name="storage", config_cls=StorageConfig, build=_build, description=__doc__)


if __name__ == "__main__":
    sys.exit(main())
