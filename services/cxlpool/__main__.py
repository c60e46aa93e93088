"""`kvpath serve cxlpool`: a shared KV pool (Beluga): memory every engine maps, a block table served over
CXL-RPC (shared memory) and NATS."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from services.cxlpool.config import PoolConfig
from shared.service import Service, serve_main


def _build(config: PoolConfig) -> Service:
    from services.cxlpool.service import PoolService

    return PoolService(config)


def main(argv: Sequence[str] | None = None) -> int:
    return serve_main(argv, name="cxlpool", config_cls=PoolConfig, build=_build, description=__doc__)


if __name__ == "__main__":
    sys.exit(main())
