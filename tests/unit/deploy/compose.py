"""Loading deploy/docker-compose.yml the way docker compose reads it (merge keys, env forms, port forms)."""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from tests.unit.deploy.kvpath_cli import DEPLOY, PROJECT_IMAGE, ParsedService, parse_kvpath, split_image

COMPOSE_FILE = DEPLOY / "docker-compose.yml"
GPU_OVERRIDE = DEPLOY / "docker-compose.gpu.yml"
# ports the official images listen on (what a published port or a URL may point at)
OFFICIAL_PORTS = {
    "nats": {4222, 8222},
    "jaegertracing/all-in-one": {16686, 4317, 4318},
    "prom/prometheus": {9090},
    "grafana/grafana": {3000},
    "otel/opentelemetry-collector": {4317, 4318, 13133},
}


@dataclass(slots=True)
class Compose:
    services: dict[str, dict[str, Any]]
    volumes: dict[str, Any]
    kvpath: dict[str, ParsedService]  # compose service name -> parsed `kvpath serve ...` of its container

    def by_service(self, service: str) -> dict[str, ParsedService]:
        return {name: p for name, p in self.kvpath.items() if p.service == service}


def merge(base: Any, override: Any) -> Any:
    """Compose's merge of an override file: mappings merge key by key, anything else is replaced."""
    if isinstance(base, dict) and isinstance(override, dict):
        return {k: merge(base[k], v) if k in base else v for k, v in override.items()} | {
            k: v for k, v in base.items() if k not in override
        }
    return override


def load_compose(*paths: Path) -> Compose:
    """docker-compose.yml, with any override files (`-f a.yml -f b.yml`) merged over it in order."""
    data: dict[str, Any] = {}
    for path in paths or (COMPOSE_FILE,):
        data = merge(data, yaml.safe_load(path.read_text()))
    services = data.get("services") or {}
    kvpath = {
        name: parse_kvpath(command(svc), env=environment(svc))
        for name, svc in services.items()
        if is_project_image(svc)
    }
    return Compose(services, data.get("volumes") or {}, kvpath)


def is_project_image(svc: dict[str, Any]) -> bool:
    return split_image(str(svc.get("image", "")))[0] == PROJECT_IMAGE


def command(svc: dict[str, Any]) -> list[str]:
    cmd = svc.get("command") or []
    return shlex.split(cmd) if isinstance(cmd, str) else [str(c) for c in cmd]


def _env_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return "" if value is None else str(value)


def environment(svc: dict[str, Any]) -> dict[str, str]:
    """The `environment:` of a service as a dict, from either the mapping or the list form."""
    env = svc.get("environment") or {}
    if isinstance(env, list):
        return dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
    return {str(k): _env_value(v) for k, v in env.items()}


def depends_on(svc: dict[str, Any]) -> dict[str, str]:
    """Dependency -> condition (the list form means service_started)."""
    deps = svc.get("depends_on") or {}
    if isinstance(deps, list):
        return dict.fromkeys(deps, "service_started")
    return {name: (spec or {}).get("condition", "service_started") for name, spec in deps.items()}


def published_ports(svc: dict[str, Any]) -> list[tuple[int, int]]:
    """(host port, container port) of every published port, short or long syntax."""
    out = []
    for port in svc.get("ports") or []:
        if isinstance(port, dict):
            out.append((int(port["published"]), int(port["target"])))
            continue
        parts = str(port).split("/")[0].split(":")
        out.append((int(parts[-2]), int(parts[-1])) if len(parts) >= 2 else (int(parts[0]), int(parts[0])))
    return out


def mounts(svc: dict[str, Any]) -> list[tuple[str, str]]:
    """(source, target) of every volume entry, short or long syntax."""
    out = []
    for vol in svc.get("volumes") or []:
        if isinstance(vol, dict):
            out.append((str(vol.get("source", "")), str(vol["target"])))
        else:
            source, target = str(vol).split(":")[:2]
            out.append((source, target))
    return out


def url_host_port(url: str) -> tuple[str, int | None]:
    parts = urlsplit(url)
    return parts.hostname or "", parts.port


def healthcheck_test(svc: dict[str, Any]) -> list[str]:
    test = (svc.get("healthcheck") or {}).get("test") or []
    if isinstance(test, str):
        return ["CMD-SHELL", test]
    return [str(t) for t in test]
