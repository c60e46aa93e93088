"""`kvpath serve index`: the metadata index (block hash -> locations, prefix match over KV events)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from services.index.config import IndexConfig
from shared.service import Service, serve_main


def _build(config: IndexConfig) -> Service:
    from services.index.service import IndexService

    return IndexService(config)


def main(argv: Sequence[str] | None = None) -> int:
    return serve_main(argv, name="index", config_cls=IndexConfig, build=_build, description=__doc__)


if __name__ == "__main__":
    sys.exit(main())
