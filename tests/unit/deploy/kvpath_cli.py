"""What the deploy tests check manifests against: the project's real CLI parsers, config classes and metrics.

A container's command line is parsed exactly the way `kvpath` parses it (services/cli.py's parser picks the
service, then a parser built with shared.config.add_config_args on that service's config class takes the
flags), and the config is then built and validated with shared.config.build_config from the container's
environment and mounted YAML. So an unknown flag, a missing service, a bad value or a misspelled KVPATH_*
variable in a manifest fails the tests.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import io
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from shared.config import ENV_PREFIX, BaseConfig, add_config_args, build_config
from shared.errors import KvpathError

REPO = Path(__file__).resolve().parents[3]
DEPLOY = REPO / "deploy"
PROJECT_IMAGE = "kvpath"
# the services a dev cluster or a Kubernetes deployment of the DualPath topology must run
CORE_SERVICES = ("router", "engine", "storage", "index")
# official images the manifests may use besides the project's own (always with an explicit tag)
OFFICIAL_IMAGES = frozenset(
    {
        "nats",
        "otel/opentelemetry-collector",
        "otel/opentelemetry-collector-contrib",
        "jaegertracing/all-in-one",
        "jaegertracing/jaeger",
        "prom/prometheus",
        "grafana/grafana",
        "python",
        "nvidia/cuda",
    }
)

T = TypeVar("T")


class ManifestError(AssertionError):
    """A manifest names a flag, service, variable, image, port or file that does not exist."""


@dataclass(slots=True)
class ParsedService:
    service: str  # router | engine | storage | index
    config: Any  # the service's config dataclass, built and validated
    argv: list[str]


def split_image(image: str) -> tuple[str, str]:
    """(repository, tag or @digest); the tag is '' when the reference has none."""
    if "@" in image:
        name, digest = image.split("@", 1)
        repo, tag = split_image(name)
        return repo, tag or "@" + digest
    head, _, last = image.rpartition("/")
    if ":" in last:
        last, tag = last.split(":", 1)
        return (f"{head}/{last}" if head else last), tag
    return image, ""


def image_problem(image: str) -> str | None:
    """Why `image` is not allowed, or None: the project image or a known official image, explicitly tagged."""
    repo, tag = split_image(image)
    if (
        repo != PROJECT_IMAGE
        and repo.removeprefix("docker.io/").removeprefix("library/") not in OFFICIAL_IMAGES
    ):
        return f"image {image!r} is neither the project image {PROJECT_IMAGE!r} nor a known official image"
    if not tag or tag == "latest":
        return f"image {image!r} needs an explicit tag (not latest)"
    return None


def service_modules() -> dict[str, str]:
    from services import cli

    return dict(cli.SERVICE_MODULES)


def config_class(service: str) -> type[BaseConfig]:
    """The config dataclass `kvpath serve <service>` builds: the one BaseConfig subclass its module uses."""
    module = importlib.import_module(service_modules()[service])
    found = {
        v
        for v in vars(module).values()
        if isinstance(v, type) and issubclass(v, BaseConfig) and v is not BaseConfig
    }
    if len(found) != 1:
        raise ManifestError(f"cannot tell the config class of service {service!r}: {sorted(map(str, found))}")
    return found.pop()


def field_names(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def env_problems(service: str, env: Mapping[str, str]) -> list[str]:
    """Every KVPATH_* variable must name a field of the service's config (build_config ignores others)."""
    names = field_names(config_class(service))
    return [
        f"{service}: {key} is not a config field of {config_class(service).__name__}"
        for key in env
        if key.startswith(ENV_PREFIX) and key[len(ENV_PREFIX) :].lower() not in names
    ]


def loopback_binds(config: Any) -> list[str]:
    """Listening addresses of `config` (http_host, *bind_host) that other containers could not reach."""
    return [
        f"{f.name}={getattr(config, f.name)!r}"
        for f in dataclasses.fields(config)
        if (f.name == "http_host" or f.name.endswith("bind_host"))
        and getattr(config, f.name) not in ("0.0.0.0", "::", "")
    ]


def _argparse(call: Callable[[], T], what: str) -> T:
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return call()
    except SystemExit:
        raise ManifestError(f"{what}: {err.getvalue().strip()}") from None


def service_parser(service: str) -> argparse.ArgumentParser:
    """The parser of `kvpath serve <service>` (as in shared.service.serve_main): --config + config flags."""
    parser = argparse.ArgumentParser(prog=f"kvpath serve {service}")
    parser.add_argument("--config")
    add_config_args(parser, config_class(service))
    return parser


def parse_kvpath(
    argv: Sequence[str], *, env: Mapping[str, str], config_files: Mapping[str, Path] | None = None
) -> ParsedService:
    """Parse `kvpath <argv>` and build the service's config from the flags, `env` and the YAML `--config`.

    `config_files` maps a path inside the container to the local file mounted there.
    """
    from services import cli

    argv = list(argv)
    what = "kvpath " + " ".join(argv)
    if argv[:1] != ["serve"]:
        raise ManifestError(f"{what}: a kvpath container must run `kvpath serve <service>`")
    top, _ = _argparse(lambda: cli.build_parser().parse_known_args(argv[:2]), what)
    service = str(top.service)
    args = _argparse(lambda: service_parser(service).parse_args(argv[2:]), what)
    yaml_path = None
    if args.config:
        yaml_path = (config_files or {}).get(args.config)
        if yaml_path is None:
            raise ManifestError(f"{what}: --config {args.config} is not a mounted config file")
    problems = env_problems(service, env)
    if problems:
        raise ManifestError("; ".join(problems))
    cls = config_class(service)
    overrides = {k: v for k, v in vars(args).items() if k in field_names(cls)}
    try:
        config = build_config(cls, section=service, yaml_path=yaml_path, env=env, overrides=overrides)
    except KvpathError as exc:
        raise ManifestError(f"{what}: {exc.message}") from None
    return ParsedService(service, config, argv)


# ------------------------------------------------------------------------------------------- metrics

_SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "gaugehistogram": ("_bucket", "_gsum", "_gcount"),
    "summary": ("", "_sum", "_count", "_created"),
    "info": ("_info",),
}


def metrics_modules() -> list[str]:
    """shared.telemetry (bus metrics) and every services/<name>/metrics.py."""
    names = ["shared.telemetry"]
    for path in sorted((REPO / "services").glob("*/metrics.py")):
        names.append(f"services.{path.parent.name}.metrics")
    return names


def registered_metric_names() -> set[str]:
    """Every series name the services' metrics modules export (families expanded by type suffix)."""
    from prometheus_client import REGISTRY

    for name in metrics_modules():
        importlib.import_module(name)
    out: set[str] = set()
    for family in REGISTRY.collect():
        out.update(family.name + suffix for suffix in _SUFFIXES.get(family.type, ("",)))
        out.update(sample.name for sample in family.samples)
    return out
