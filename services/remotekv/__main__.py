"""`kvpath serve remotekv --capacity-bytes N`: a remote-memory KV store (super blocks in DRAM; baseline)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from services.remotekv.config import RemoteKvConfig
from shared.service import Service, serve_main


def _build(config: RemoteKvConfig) -> Service:
    from services.remotekv.service import RemoteKvService

    return RemoteKvService(config)


def main(argv: Sequence[str] | None = None) -> int:
    return serve_main(argv, name="remotekv", config_cls=RemoteKvConfig, build=_build, description=__doc__)


if __name__ == "__main__":
    sys.exit(main())
