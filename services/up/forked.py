"""Service processes forked from a warm parent, for tests and benchmarks that start many small clusters.

A `kvpath serve <service>` process spends ~2 s of CPU importing torch and the engine before it does anything
(0.5 s for the router), and a test suite starts a few hundred of them. `ForkedService` starts the same
command in a child of multiprocessing's fork server, which imported those modules once (`PRELOAD`): the
child is a real process of its own (own pid, own session and process group, its own log file as stdout and
stderr, the environment and working directory it is given), that runs `services.cli.main(["serve", ...])`
exactly as `python -m services.cli serve ...` does, exits with its exit code (or dies by a signal, which
`returncode` reports as -signal, as `subprocess.Popen` does), and runs its `atexit` handlers on the way out.
What differs from a fresh interpreter: the imported modules' state as the fork server left it (none of
kvpath's modules keeps any at import), and no `python -m` entry (`kvpath up`, which production uses, still
starts its services as fresh interpreters).

The handle has the part of `subprocess.Popen`'s API the tests use: `pid`, `poll`, `wait`, `returncode`,
`send_signal`, `terminate`, `kill`.
"""

from __future__ import annotations

import atexit
import importlib.machinery
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from multiprocessing.context import ForkServerContext
from pathlib import Path

# what a service imports before it starts: every fork starts with these already in memory
PRELOAD = (
    "services.cli",
    "shared.service",
    "torch",
    "gpu.runner",
    "services.engine.service",
    "services.router.service",
    "services.storage.service",
    "services.index.service",
)
_context: ForkServerContext | None = None
_SKIPPED_MAIN = importlib.machinery.ModuleSpec("kvpath.__main__", None)


def context() -> ForkServerContext:
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(list(PRELOAD))  # one that fails to import is skipped
    return _context


def _run(argv: list[str], env: dict[str, str], cwd: str, log_path: str) -> None:
    """The child: its own session, its log as stdout and stderr, then the CLI; atexit handlers at the end
    (multiprocessing leaves its children with `os._exit`, which would skip them)."""
    os.setsid()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.argv = ["kvpath", *argv]
    from services.cli import main

    code: int | str | None = 0
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    finally:
        atexit._run_exitfuncs()
    sys.exit(code)


class ForkedService:
    """`kvpath <argv>` in a child of the fork server (see the module's docstring)."""

    def __init__(
        self, argv: list[str], *, env: dict[str, str], log_path: Path, cwd: str | None = None
    ) -> None:
        self.args = ["kvpath", *argv]
        self._proc = context().Process(
            target=_run, args=(argv, env, cwd or os.getcwd(), str(log_path)), daemon=True
        )
        main = sys.modules["__main__"]
        spec = getattr(main, "__spec__", None)
        # multiprocessing would import the starting program's main module in the child (it runs the code
        # of a script without a `__main__` guard again); a main named like a package's `__main__` it skips
        main.__spec__ = _SKIPPED_MAIN
        try:
            self._proc.start()
        finally:
            main.__spec__ = spec
        assert self._proc.pid is not None
        self.pid: int = self._proc.pid
        self._until_own_group()

    def _until_own_group(self, timeout_s: float = 10.0) -> None:
        """Return once the child leads its own process group (as `start_new_session` gives a Popen on
        return): `os.killpg(pid, ...)` then reaches it, and nothing of the parent's group."""
        deadline = time.monotonic() + timeout_s
        while self._proc.exitcode is None:
            try:
                if os.getpgid(self.pid) == self.pid:
                    return
            except ProcessLookupError:
                return  # already gone: poll() says how
            if time.monotonic() > deadline:
                self.kill()
                raise TimeoutError(f"forked {' '.join(self.args)} did not start within {timeout_s:.0f} s")
            time.sleep(0.001)

    @property
    def returncode(self) -> int | None:
        return self._proc.exitcode

    def poll(self) -> int | None:
        return self._proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        if self._proc.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return self._proc.exitcode

    def send_signal(self, sig: int) -> None:
        if self._proc.exitcode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)
