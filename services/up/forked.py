"""Service processes forked from a warm parent: `kvpath up`'s engines, and every service of the tests and
benchmarks that start many small clusters one service at a time (`process.ServiceStack`).

A `kvpath serve <service>` process spends ~2 s of CPU importing torch and the engine before it does anything
(0.5 s for the router), and a test suite starts a few hundred of them. `ForkedService` starts the same
command in a child of multiprocessing's fork server, which imported those modules once (`PRELOAD`): the
child is a real process of its own (own pid, own session and process group, its own log file as stdout and
stderr, the environment and working directory it is given), that runs `services.cli.main(["serve", ...])`
exactly as `python -m services.cli serve ...` does, exits with its exit code (or dies by a signal, which
`returncode` reports as -signal, as `subprocess.Popen` does), and runs its `atexit` handlers on the way out.
What differs from a fresh interpreter: the imported modules' state as the fork server left it (none of
kvpath's modules keeps any at import; nothing it imports touches CUDA, which a fork could not inherit), no
`python -m` entry, and an RSS that counts the fork server's pages it shares (why `kvpath up` forks only its
engines). `KVPATH_FRESH_PROCESSES=1` starts fresh interpreters everywhere.

The handle has the part of `subprocess.Popen`'s API the tests use: `pid`, `poll`, `wait`, `returncode`,
`send_signal`, `terminate`, `kill`.
"""

from __future__ import annotations

import atexit
import ctypes
import importlib
import importlib.machinery
import multiprocessing
import multiprocessing.forkserver
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
    "services.up.fork_server_exit",
)
PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15
ENTRY = "services.cli"  # the module whose main(argv) a forked child runs, as `python -m services.cli` does
FRESH_ENV = "KVPATH_FRESH_PROCESSES"  # set: each service a fresh `python -m services.cli serve` interpreter
_context: ForkServerContext | None = None
_SKIPPED_MAIN = importlib.machinery.ModuleSpec("kvpath.__main__", None)


def context() -> ForkServerContext:
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(list(PRELOAD))  # one that fails to import is skipped
    return _context


def start_fork_server() -> None:
    """Start the fork server now (it imports `PRELOAD` in the background); the first fork waits for it."""
    from multiprocessing import forkserver

    context()
    forkserver.ensure_running()


def stop_fork_server() -> None:
    """End the fork server and multiprocessing's resource tracker and reap them (else, once this process
    exits, they are left to the host's init to reap). Forked children that still run are not touched."""
    from multiprocessing import forkserver, resource_tracker

    for helper in (forkserver._forkserver, resource_tracker._resource_tracker):
        stop = getattr(helper, "_stop", None)
        if stop is not None:
            stop()


def _run(
    argv: list[str], env: dict[str, str], cwd: str, log_path: str, new_session: bool, death_signal: int
) -> None:
    """The child: its own session (or the fork server's process group, which is its starter's), the signal
    it gets when the fork server ends (it ends with its starter), its log as stdout and stderr, then the
    CLI; atexit handlers at the end (multiprocessing leaves its children with `os._exit`, skipping them)."""
    if new_session:
        os.setsid()
    # the fork server ends when every holder of its "alive" pipe's write end has: its starter and, as
    # multiprocessing leaves it, each child; a child that lets go of it lets the fork server end with the
    # starter, and `death_signal` then reach the child
    server = multiprocessing.forkserver._forkserver
    alive_fd = getattr(server, "_forkserver_alive_fd", None)
    if alive_fd is not None:
        os.close(alive_fd)
        server._forkserver_alive_fd = None  # type: ignore[attr-defined]
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    # `top` and `ps -o comm` tell the services apart (their command line is the fork server's)
    libc.prctl(PR_SET_NAME, f"kvpath-{argv[1] if len(argv) > 1 else argv[0]}"[:15].encode())
    if death_signal:
        libc.prctl(PR_SET_PDEATHSIG, death_signal)
        if os.getppid() == 1:  # the fork server (and so its starter) ended before the prctl
            os.kill(os.getpid(), death_signal)
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
    main = importlib.import_module(ENTRY).main  # by name: the CLI imports `kvpath up`, which imports this

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
        self,
        argv: list[str],
        *,
        env: dict[str, str],
        log_path: Path | str,
        cwd: str | None = None,
        new_session: bool = True,
        death_signal: int = 0,
    ) -> None:
        """`new_session`: the child leads its own session and process group (Popen's `start_new_session`);
        else it stays in the starter's group. `death_signal`: what the child gets when its starter ends
        (PR_SET_PDEATHSIG); 0: none."""
        self.args = ["kvpath", *argv]
        run_args = (argv, env, cwd or os.getcwd(), str(log_path), new_session, death_signal)
        self._proc = context().Process(target=_run, args=run_args, daemon=True)
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
        if new_session:
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
