"""Loading the Kubernetes manifests (raw kustomize base, or rendered by `kubectl kustomize`) for the tests.

Each kvpath container's args are parsed with the real `kvpath` parsers; its environment is resolved the way
the kubelet does (`$(VAR)` references, downward-API fields of the first pod) and its `--config` file is found
through the container's volume mounts in the ConfigMap that backs them.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tests.unit.deploy.kvpath_cli import (
    DEPLOY,
    PROJECT_IMAGE,
    ManifestError,
    ParsedService,
    parse_kvpath,
    split_image,
)

K8S = DEPLOY / "k8s"
BASE = K8S / "base"
POD_INDEX_LABEL = "apps.kubernetes.io/pod-index"
WORKLOAD_KINDS = ("Deployment", "StatefulSet", "DaemonSet", "Job")
_VAR_REF = re.compile(r"\$\((\w+)\)")


@dataclass(slots=True)
class Workload:
    kind: str
    name: str
    spec: dict[str, Any]  # the workload's spec
    pod: dict[str, Any]  # spec.template.spec
    labels: dict[str, str]  # pod template labels
    annotations: dict[str, str]  # pod template annotations

    @property
    def first_ordinal(self) -> int | None:
        if self.kind != "StatefulSet":
            return None
        return int((self.spec.get("ordinals") or {}).get("start", 0))

    @property
    def replicas(self) -> int:
        return int(self.spec.get("replicas", 1))

    @property
    def pod_name(self) -> str:
        ordinal = self.first_ordinal
        return f"{self.name}-{ordinal}" if ordinal is not None else f"{self.name}-5d4f8-x2k9p"


@dataclass(slots=True)
class KvpathContainer:
    workload: Workload
    container: dict[str, Any]
    env: dict[str, str]
    parsed: ParsedService

    @property
    def name(self) -> str:
        return f"{self.workload.name}/{self.container['name']}"


@dataclass(slots=True)
class Manifests:
    objects: list[dict[str, Any]]
    configmaps: dict[str, dict[str, str]]  # ConfigMap name -> key -> content
    workloads: list[Workload] = field(default_factory=list)

    def __post_init__(self) -> None:
        for obj in self.objects:
            if obj.get("kind") in WORKLOAD_KINDS:
                template = obj["spec"]["template"]
                meta = template.get("metadata") or {}
                self.workloads.append(
                    Workload(
                        obj["kind"],
                        obj["metadata"]["name"],
                        obj["spec"],
                        template["spec"],
                        dict(meta.get("labels") or {}),
                        dict(meta.get("annotations") or {}),
                    )
                )
            if obj.get("kind") == "ConfigMap":
                self.configmaps[obj["metadata"]["name"]] = dict(obj.get("data") or {})

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [o for o in self.objects if o.get("kind") == kind]


def load_kustomization(directory: Path) -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((directory / "kustomization.yaml").read_text())
    return data


def load_raw_base() -> Manifests:
    """The base's resource files as written, with configMapGenerator files as ConfigMaps (unhashed names)."""
    kust = load_kustomization(BASE)
    objects = [
        doc for res in kust["resources"] for doc in yaml.safe_load_all((BASE / res).read_text()) if doc
    ]
    configmaps = {}
    for gen in kust.get("configMapGenerator") or []:
        files = {}
        for entry in gen.get("files") or []:
            key, _, path = entry.rpartition("=")
            files[key or Path(path).name] = (BASE / path).read_text()
        configmaps[gen["name"]] = files
    return Manifests(objects, configmaps)


def kubectl() -> str | None:
    return shutil.which("kubectl")


def render(directory: Path) -> Manifests:
    """`kubectl kustomize <directory>` (the kustomize built into kubectl; needs no cluster)."""
    exe = kubectl()
    assert exe is not None
    out = subprocess.run([exe, "kustomize", str(directory)], capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        raise ManifestError(f"kubectl kustomize {directory}: {out.stderr.strip()}")
    return Manifests([d for d in yaml.safe_load_all(out.stdout) if d], {})


def resolve_env(workload: Workload, container: dict[str, Any]) -> dict[str, str]:
    """The container's environment as the kubelet would set it in the workload's first pod."""
    env: dict[str, str] = {}
    if container.get("envFrom"):
        raise ManifestError(f"{workload.name}: envFrom is not checked by these tests; use env")
    for item in container.get("env") or []:
        if "value" in item:
            env[item["name"]] = _expand(workload, str(item["value"]), env)
        else:
            env[item["name"]] = _field_value(workload, item["valueFrom"]["fieldRef"]["fieldPath"])
    return env


def _expand(workload: Workload, value: str, env: dict[str, str]) -> str:
    def sub(match: re.Match[str]) -> str:
        if match.group(1) not in env:
            raise ManifestError(f"{workload.name}: $({match.group(1)}) is not defined before its use")
        return env[match.group(1)]

    return _VAR_REF.sub(sub, value)


def _field_value(workload: Workload, path: str) -> str:
    label = re.fullmatch(r"metadata\.labels\['([^']+)'\]", path)
    if label and label.group(1) == POD_INDEX_LABEL:
        if workload.first_ordinal is None:
            raise ManifestError(f"{workload.name}: only StatefulSet pods have the {POD_INDEX_LABEL} label")
        return str(workload.first_ordinal)
    if label:
        if label.group(1) not in workload.labels:
            raise ManifestError(f"{workload.name}: env from missing pod label {label.group(1)}")
        return workload.labels[label.group(1)]
    known = {"metadata.name": workload.pod_name, "metadata.namespace": "kvpath", "status.podIP": "10.1.2.3"}
    if path not in known:
        raise ManifestError(f"{workload.name}: unexpected downward-API field {path}")
    return known[path]


def config_files(m: Manifests, workload: Workload, container: dict[str, Any], tmp: Path) -> dict[str, Path]:
    """Container path -> local copy of every ConfigMap file mounted into the container."""
    volumes = {v["name"]: v for v in workload.pod.get("volumes") or []}
    out = {}
    for mount in container.get("volumeMounts") or []:
        config_map = (volumes.get(mount["name"]) or {}).get("configMap")
        if not config_map:
            continue
        data = m.configmaps.get(config_map["name"])
        if data is None:
            raise ManifestError(f"{workload.name}: ConfigMap {config_map['name']} does not exist")
        for key, text in data.items():
            local = tmp / config_map["name"] / key
            local.parent.mkdir(parents=True, exist_ok=True)
            local.write_text(text)
            out[f"{mount['mountPath'].rstrip('/')}/{key}"] = local
    return out


def kvpath_containers(m: Manifests, tmp: Path) -> list[KvpathContainer]:
    out = []
    for workload in m.workloads:
        for container in workload.pod["containers"]:
            if split_image(container["image"])[0] != PROJECT_IMAGE:
                continue
            if container.get("command") not in (None, ["kvpath"]):
                raise ManifestError(f"{workload.name}: kvpath containers keep the image entrypoint")
            env = resolve_env(workload, container)
            files = config_files(m, workload, container, tmp)
            parsed = parse_kvpath([str(a) for a in container.get("args") or []], env=env, config_files=files)
            out.append(KvpathContainer(workload, container, env, parsed))
    return out


def port_number(container: dict[str, Any], port: int | str) -> int | None:
    """A probe's or Service's port: a number, or the name of one of the container's ports."""
    if isinstance(port, int) or str(port).isdigit():
        return int(port)
    for p in container.get("ports") or []:
        if p.get("name") == port:
            return int(p["containerPort"])
    return None
