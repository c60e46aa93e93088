"""Services forked from the warm fork server behave like `python -m services.cli serve ...` processes: their
own process group, the environment and log they were given, the CLI's exit code, -signal when killed, and
a starting program's main module left alone (real processes; no NATS server is needed for these paths)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.up.forked import ForkedService
from shared.natsserver import NatsServer


def _until(check: object, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def test_a_bad_argument_is_the_clis_exit_code_and_message_in_the_log(tmp_path: Path) -> None:
    log = tmp_path / "index.log"
    proc = ForkedService(["serve", "index", "--no-such-flag"], env=dict(os.environ), log_path=log)
    assert proc.wait(60) == 2 and proc.returncode == proc.poll() == 2
    assert "unrecognized arguments: --no-such-flag" in log.read_text()


def test_a_running_service_leads_its_own_group_reads_its_env_and_dies_by_the_signal(tmp_path: Path) -> None:
    log = tmp_path / "index.log"
    env = dict(os.environ, KVPATH_NATS_URL="nats://127.0.0.1:1", KVPATH_SERVICE_ID="index-forked")
    env.pop("PYTEST_CURRENT_TEST", None)
    proc = ForkedService(["serve", "index"], env=env, log_path=log, cwd=str(tmp_path))
    try:
        assert os.getpgid(proc.pid) == os.getsid(proc.pid) == proc.pid != os.getpgid(0)
        assert proc.poll() is None
        _until(lambda: log.exists() and "name=index-forked" in log.read_text())  # retrying the given NATS URL
        assert os.readlink(f"/proc/{proc.pid}/cwd") == str(tmp_path)
        assert Path(f"/proc/{proc.pid}/comm").read_text().strip() == "kvpath-index"  # what `top` shows
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
    assert proc.wait(30) == -signal.SIGKILL


def test_a_script_without_a_main_guard_starts_services_once(tmp_path: Path) -> None:
    """The child does not run the starting program's main module again (multiprocessing's default)."""
    script = tmp_path / "starter.py"
    marker = tmp_path / "ran"
    script.write_text(
        "import os, pathlib\n"
        "from services.up.forked import ForkedService\n"
        f"pathlib.Path({str(marker)!r}).open('a').write('x')\n"
        f"log = pathlib.Path({str(tmp_path / 'l')!r})\n"
        "p = ForkedService(['serve', 'index', '--bogus'], env=dict(os.environ), log_path=log)\n"
        "raise SystemExit(p.wait(60))\n"
    )  # fmt: skip
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, str(script)], cwd=root, env=dict(os.environ, PYTHONPATH=str(root)), timeout=120
    )
    assert out.returncode == 2 and marker.read_text() == "x"


def test_a_service_in_its_starters_group_ends_when_the_starter_is_killed(tmp_path: Path) -> None:
    """`kvpath up`'s children: in its process group, and SIGTERMed when it dies (even by SIGKILL), through
    the fork server, which ends with its starter."""
    import psutil

    pid_file = tmp_path / "pid"
    script = tmp_path / "starter.py"
    script.write_text(
        "import os, pathlib, signal, time\n"
        "from services.up.forked import ForkedService\n"
        "env = dict(os.environ, KVPATH_SERVICE_ID='index-starter')\n"
        f"log = pathlib.Path({str(tmp_path / 'l')!r})\n"
        "kw = dict(env=env, log_path=log, new_session=False, death_signal=signal.SIGTERM)\n"
        "p = ForkedService(['serve', 'index'], **kw)\n"
        f"pathlib.Path({str(pid_file)!r}).write_text(f'{{p.pid}} {{os.getpgid(p.pid)}}')\n"
        "time.sleep(600)\n"
    )  # fmt: skip
    root = Path(__file__).resolve().parents[2]
    with NatsServer() as nats:  # the index serves until told to stop
        env = dict(os.environ, PYTHONPATH=str(root), KVPATH_NATS_URL=nats.url, KVPATH_NAMESPACE="forked")
        starter = subprocess.Popen([sys.executable, str(script)], cwd=root, env=env, start_new_session=True)
        log = tmp_path / "l"
        try:
            _until(lambda: pid_file.exists() and pid_file.read_text())
            child_pid, child_group = map(int, pid_file.read_text().split())
            assert child_group == starter.pid  # the starter's group, as a Popen child without a new session
            child = psutil.Process(child_pid)
            _until(lambda: log.exists() and "service ready" in log.read_text(), timeout_s=60)
            starter.kill()
            starter.wait(10)
            _until(lambda: not child.is_running() or child.status() == psutil.STATUS_ZOMBIE, timeout_s=60)
            assert "service stopped" in log.read_text()  # SIGTERM: it drained and stopped
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(starter.pid, signal.SIGKILL)


# Run in a fresh interpreter: torch.cuda's entry points are wrapped before anything of the fork server's
# preload is imported, and every call is recorded with where it came from.
_CUDA_AT_IMPORT = """
import importlib, traceback, torch
calls = []
names = ("is_available", "device_count", "init", "current_device", "get_device_name", "get_device_properties")
for name in names:
    real = getattr(torch.cuda, name)
    def wrapped(*a, _name=name, _real=real, **k):
        calls.append(_name + " from " + traceback.format_stack(limit=3)[0].strip())
        return _real(*a, **k)
    setattr(torch.cuda, name, wrapped)
from services.up.forked import PRELOAD
for module in PRELOAD:
    importlib.import_module(module)
import sys
print(len(calls), "cupy" in sys.modules)
print(*calls, sep="\\n")
"""


def test_the_fork_servers_preload_never_touches_cuda() -> None:
    """A process that initialised CUDA cannot hand it to a fork: if importing the preload (torch, the
    engine, the runner) made one CUDA call, every forked engine on a GPU host would fail its first kernel.
    No GPU here, so the calls themselves are what is checked."""
    done = subprocess.run(
        [sys.executable, "-c", _CUDA_AT_IMPORT],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert done.returncode == 0, done.stderr[-2000:]
    count, cupy_imported = done.stdout.splitlines()[0].split()
    assert count == "0", done.stdout
    assert cupy_imported == "False"  # cupy is imported where a GPU path runs, never at import
