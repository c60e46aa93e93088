"""Imported by the fork server alone (the last of `forked.PRELOAD`): the fork server ends at once when its
starter has, instead of spending ~2 s tearing down the torch-laden interpreter while the starter's
shutdown waits on it (and the resource tracker waits on it). Forked children inherit the handler and
skip it: it acts only in the process that imported this module."""

from __future__ import annotations

import atexit
import os

_PID = os.getpid()


def _exit_now() -> None:
    if os.getpid() == _PID:
        os._exit(0)


atexit.register(_exit_now)
