"""`kvpath serve router`: the OpenAI-compatible API and global scheduler."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from services.router.config import RouterConfig
from shared.service import Service, serve_main


def _build(config: RouterConfig) -> Service:
    from services.router.service import RouterService

    return RouterService(config)


def main(argv: Sequence[str] | None = None) -> int:
    return serve_main(argv, name="router", config_cls=RouterConfig, build=_build, description=__doc__)


if __name__ == "__main__":
    sys.exit(main())
