"""Container health check: exit 0 when the kvpath service in this container answers /health with 200.

The port comes from `--port`, else `KVPATH_HTTP_PORT` (the same variable the service reads), else 8000
(the router's default). Standard library only, so it runs in any kvpath image without curl or wget.

    python /opt/kvpath/healthcheck.py [--port N] [--path /health] [--timeout-s 3]
"""

from __future__ import annotations

import argparse
import os
import sys
import urllib.error
import urllib.request
from collections.abc import Mapping

DEFAULT_PORT = 8000


def health_url(port: int | None, path: str, env: Mapping[str, str]) -> str:
    """The URL probed: 127.0.0.1 reaches a service bound to 0.0.0.0 or to loopback."""
    if port is None:
        port = int(env.get("KVPATH_HTTP_PORT") or DEFAULT_PORT)
    return f"http://127.0.0.1:{port}{path}"


def probe(url: str, timeout_s: float) -> tuple[bool, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return resp.status == 200, f"{url}: HTTP {resp.status}"
    except urllib.error.HTTPError as exc:
        return False, f"{url}: HTTP {exc.code}"
    except (OSError, ValueError) as exc:
        return False, f"{url}: {exc}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument(
        "--port", type=int, default=None, help="HTTP port (default: $KVPATH_HTTP_PORT, else 8000)"
    )
    parser.add_argument("--path", default="/health", help="path to probe")
    parser.add_argument("--timeout-s", type=float, default=3.0, help="deadline of the request")
    args = parser.parse_args(argv)
    is_ok, detail = probe(health_url(args.port, args.path, os.environ), args.timeout_s)
    print(detail)
    return 0 if is_ok else 1


if __name__ == "__main__":
    sys.exit(main())
