"""deploy/Dockerfile and its helper scripts: what the image copies, installs, runs and probes."""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
import stat
import subprocess
import sys
import threading
import tomllib
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from shared.config import ENV_PREFIX, BaseConfig
from tests.unit.deploy.kvpath_cli import DEPLOY, REPO, field_names, image_problem

DOCKERFILE = DEPLOY / "Dockerfile"
IGNORE_FILE = DEPLOY / "Dockerfile.dockerignore"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in DOCKERFILE.read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        op, _, rest = full.partition(" ")
        out.append((op.upper(), rest.strip()))
    return out


def arg_defaults() -> dict[str, str]:
    out: dict[str, str] = {}
    for op, rest in instructions():
        if op == "ARG" and "=" in rest:
            name, value = rest.split("=", 1)
            out.setdefault(name, value)
    return out


def expand(text: str, values: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}", lambda m: values[m.group(1)], text)


def stages() -> dict[str, str]:
    """stage name -> base image or stage it starts from (ARG defaults substituted)."""
    out = {}
    for op, rest in instructions():
        if op == "FROM":
            image, _, name = rest.partition(" AS ")
            out[name.strip()] = image.strip()
    return out


def copy_sources() -> list[tuple[str, str]]:
    out = []
    for op, rest in instructions():
        if op == "COPY" and not rest.startswith("--from"):
            *sources, target = shlex.split(rest)
            out += [(s, target) for s in sources]
    return out


def is_ignored(path: str) -> bool:
    """Docker's rule: the last matching pattern wins, `!` re-includes; a directory pattern covers its files"""
    ignored = False
    for raw in IGNORE_FILE.read_text().splitlines():
        pattern = raw.strip()
        if not pattern or pattern.startswith("#"):
            continue
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").rstrip("/")
        parts = Path(path).parts
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        regex = fnmatch.translate(pattern.replace("**/", "*"))
        if any(re.match(regex, prefix) for prefix in prefixes):
            ignored = not negate
    return ignored


def test_both_variants_resolve_to_tagged_official_base_images() -> None:
    defaults = arg_defaults()
    all_stages = stages()
    assert defaults["VARIANT"] == "cpu"
    for variant in ("cpu", "cuda"):
        runtime = expand(all_stages["runtime"], {**defaults, "VARIANT": variant})
        base = expand(all_stages[runtime], defaults)
        assert image_problem(base) is None, f"{variant}: {image_problem(base)}"
    assert expand(all_stages["base-cpu"], defaults).startswith("python:3.11")
    assert expand(all_stages["base-cuda"], defaults).startswith("nvidia/cuda:")


def test_copied_sources_exist_and_pass_the_ignore_file() -> None:
    for source, _ in copy_sources():
        assert (REPO / source).exists(), f"COPY {source}: missing in the repository"
        assert not is_ignored(source.rstrip("/")), f"COPY {source}: excluded by {IGNORE_FILE.name}"
    for junk in (".venv", ".git", "tests", "shared/__pycache__/x.pyc", "kvpath.egg-info"):
        assert is_ignored(junk), f"{junk} must not be sent to the builder"


def test_image_installs_every_package_of_the_project() -> None:
    copied = {s.rstrip("/") for s, _ in copy_sources()}
    packages = [p.rstrip("*") for p in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]]
    assert set(packages) <= copied, f"packages not copied into the image: {set(packages) - copied}"
    assert {"pyproject.toml", "README.md", "constraints/"} <= {s for s, _ in copy_sources()}


def test_torch_comes_from_the_pytorch_index_under_the_constraints() -> None:
    defaults = arg_defaults()
    assert (REPO / defaults["CONSTRAINTS"]).is_file()
    runs = " ".join(rest for op, rest in instructions() if op == "RUN")
    assert '-c "${CONSTRAINTS}" --index-url "${TORCH_INDEX_URL}" torch' in runs
    urls = [
        rest.split("=", 1)[1] for op, rest in instructions() if op == "ARG" and "TORCH_INDEX_URL=" in rest
    ]
    assert urls[0] == "https://download.pytorch.org/whl/cpu", "the cpu stage's torch index"
    assert re.fullmatch(r"https://download\.pytorch\.org/whl/cu\d+", urls[1]), "the cuda stage's torch index"
    assert "gpu" in PYPROJECT["project"]["optional-dependencies"], "the cuda variant installs the gpu extra"


def test_entrypoint_is_the_kvpath_console_script_run_by_a_non_root_user() -> None:
    ops = dict(instructions())
    assert json.loads(ops["ENTRYPOINT"]) == ["kvpath"]
    assert PYPROJECT["project"]["scripts"]["kvpath"] == "services.cli:main"
    user = ops["USER"].split(":")[0]
    assert user.isdigit() and int(user) != 0, "numeric non-root user (runAsNonRoot can verify it)"


def test_the_image_installs_the_commands_of_higher_floors() -> None:
    """`kvpath loadgen` and `kvpath bench` exist only as entry points of the installed distribution."""
    plugins = PYPROJECT["project"]["entry-points"]["kvpath.commands"]
    assert plugins == {"loadgen": "loadgen.cli:register", "bench": "loadgen.bench:register"}
    copied = {rest.split()[0] for op, rest in instructions() if op == "COPY"}
    assert "loadgen/" in copied
    runs = " ".join(rest for op, rest in instructions() if op == "RUN")
    assert "pip install --no-deps ." in runs, "installed (with its entry points), not just put on the path"


def test_healthcheck_runs_the_copied_script() -> None:
    ops = dict(instructions())
    cmd = json.loads(ops["HEALTHCHECK"].split(" CMD ", 1)[1])
    script = cmd[1]
    assert (str(DEPLOY.relative_to(REPO) / "healthcheck.py"), script) in copy_sources()


def test_image_environment_names_real_settings() -> None:
    from gpu.model_spec import CACHE_ENV

    envs = [rest for op, rest in instructions() if op == "ENV"]
    names = {m.group(1) for text in envs for m in re.finditer(r"(\w+)=", text)}
    allowed = field_names(BaseConfig) | {CACHE_ENV[len(ENV_PREFIX) :].lower()}
    bad = [n for n in names if n.startswith(ENV_PREFIX) and n[len(ENV_PREFIX) :].lower() not in allowed]
    assert bad == []
    assert {"KVPATH_HTTP_HOST", CACHE_ENV} <= names


def test_pyproject_deps_lists_dependencies_and_extras(tmp_path: Path) -> None:
    script = DEPLOY / "pyproject_deps.py"
    out = subprocess.run(
        [sys.executable, str(script), str(REPO / "pyproject.toml"), "gpu"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout.splitlines()
    project = PYPROJECT["project"]
    assert out == project["dependencies"] + project["optional-dependencies"]["gpu"]
    bad = subprocess.run(
        [sys.executable, str(script), str(REPO / "pyproject.toml"), "nosuchextra"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert bad.returncode == 1 and "nosuchextra" in bad.stderr


class _Health(BaseHTTPRequestHandler):
    status = 200

    def do_GET(self) -> None:
        self.send_response(self.status if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def health_server() -> Iterator[ThreadingHTTPServer]:
    _Health.status = 200
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join(5)


def _healthcheck(*args: str, env: dict[str, str] | None = None) -> int:
    run = subprocess.run(
        [sys.executable, str(DEPLOY / "healthcheck.py"), *args],
        capture_output=True,
        timeout=30,
        env=env,
    )
    return run.returncode


def test_healthcheck_script_follows_the_service_health(health_server: ThreadingHTTPServer) -> None:
    port = str(health_server.server_address[1])
    assert _healthcheck("--port", port) == 0
    assert _healthcheck(env={"KVPATH_HTTP_PORT": port}) == 0
    _Health.status = 503
    assert _healthcheck("--port", port) == 1
    assert _healthcheck("--port", port, "--path", "/nope") == 1
    health_server.shutdown()
    health_server.server_close()
    assert _healthcheck("--port", port, "--timeout-s", "1") == 1


def test_embedded_models_are_baked_readable_for_the_service_user(tmp_path: Path) -> None:
    """Run the image's model-baking commands: the non-root user must be able to read what root wrote."""
    (run,) = [rest for op, rest in instructions() if op == "RUN" and "resolve_model" in rest]
    bake = run[run.index("python -c") :].replace("python -c", shlex.quote(sys.executable) + " -c", 1)
    cache = tmp_path / "models"
    env = {"KVPATH_MODEL_CACHE": str(cache), "PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}
    subprocess.run(["sh", "-c", bake], env=env, cwd="/", check=True, timeout=120)
    paths = [cache, *cache.rglob("*")]
    assert any(p.name == "config.json" for p in paths), "tiny and tiny-mla written"
    for path in paths:
        mode = path.stat().st_mode
        assert mode & stat.S_IROTH, f"{path} unreadable for uid 10001"
        assert not path.is_dir() or mode & stat.S_IXOTH, f"{path} not searchable for uid 10001"
