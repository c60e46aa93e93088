"""The open-files limit: a process started under a low soft limit raises it to the hard one."""

from __future__ import annotations

import resource
import subprocess
import sys

import pytest

_PROBE = """
import resource, sys
from services import cli
try:
    cli.main(sys.argv[1:])
except SystemExit:
    pass
print(*resource.getrlimit(resource.RLIMIT_NOFILE))
"""


def _under_soft_limit(soft: int, hard: int) -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.parametrize("argv", [["--version"], ["serve", "router", "--help"]], ids=["kvpath", "serve"])
def test_kvpath_raises_a_low_soft_limit_to_the_hard_one(argv: list[str]) -> None:
    """`kvpath` (and `kvpath up`'s children, which inherit it) and a service started alone (`kvpath serve`,
    as a Kubernetes pod runs it) under the 256 / 4,096 a container might give them."""
    _, hard_now = resource.getrlimit(resource.RLIMIT_NOFILE)
    hard = 4096 if hard_now == resource.RLIM_INFINITY else min(4096, hard_now)
    if hard <= 256:
        pytest.skip(f"this process's hard limit on open files is {hard_now}")
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, *argv],
        preexec_fn=lambda: _under_soft_limit(256, hard),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert out.splitlines()[-1] == f"{hard} {hard}"
