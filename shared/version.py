"""kvpath's version, as installed (`kvpath --version`, the router's `GET /version`)."""

from __future__ import annotations

from importlib import metadata

UNKNOWN = "0+unknown"  # running from a source tree that was never installed


def kvpath_version() -> str:
    try:
        return metadata.version("kvpath")
    except metadata.PackageNotFoundError:
        return UNKNOWN
