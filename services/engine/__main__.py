"""`kvpath serve engine`: one model replica (role colocated, prefill or decode) on one device."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from services.engine.config import EngineConfig
from shared import native_memory
from shared.service import Service, serve_main


def _build(config: EngineConfig) -> Service:
    from services.engine.service import EngineService

    return EngineService(config)


def main(argv: Sequence[str] | None = None) -> int:
    native_memory.bound()  # before torch loads: malloc arenas, mmap threshold, oneDNN's cache
    return serve_main(argv, name="engine", config_cls=EngineConfig, build=_build, description=__doc__)


if __name__ == "__main__":
    sys.exit(main())
