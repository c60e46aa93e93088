"""Kubernetes manifests (deploy/k8s): the raw base always; base and overlays as rendered by
`kubectl kustomize` when kubectl is installed. No cluster is needed."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from shared.config import BaseConfig
from tests.unit.deploy.k8s import (
    BASE,
    K8S,
    POD_INDEX_LABEL,
    KvpathContainer,
    Manifests,
    kubectl,
    kvpath_containers,
    load_kustomization,
    load_raw_base,
    port_number,
    render,
    split_image,
)
from tests.unit.deploy.kvpath_cli import (
    CORE_SERVICES,
    ManifestError,
    config_class,
    field_names,
    image_problem,
    loopback_binds,
    parse_kvpath,
    service_modules,
)

VARIANTS = ("raw-base", "base", "overlays/gpu", "overlays/single-host")


@dataclass(slots=True)
class Deployment:
    variant: str
    manifests: Manifests
    kvpath: list[KvpathContainer]

    def by_service(self, service: str) -> list[KvpathContainer]:
        return [c for c in self.kvpath if c.parsed.service == service]


@pytest.fixture(scope="module", params=VARIANTS)
def deployment(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Deployment:
    variant = request.param
    if variant == "raw-base":
        manifests = load_raw_base()
    elif kubectl() is None:
        pytest.skip("kubectl (with its built-in kustomize) is not installed")
    else:
        manifests = render(K8S / variant)
    return Deployment(variant, manifests, kvpath_containers(manifests, tmp_path_factory.mktemp("cm")))


def test_kustomizations_reference_existing_files() -> None:
    directories = [p.parent for p in sorted(K8S.rglob("kustomization.yaml"))]
    assert {BASE, K8S / "overlays" / "gpu", K8S / "overlays" / "single-host"} <= set(directories)
    for directory in directories:
        kust = load_kustomization(directory)
        for res in kust.get("resources") or []:
            target = directory / res
            assert target.is_file() or (target / "kustomization.yaml").is_file(), f"{directory}: {res}"
        for patch in kust.get("patches") or []:
            assert "path" not in patch or (directory / patch["path"]).is_file(), f"{directory}: {patch}"
        for gen in kust.get("configMapGenerator") or []:
            for entry in gen.get("files") or []:
                assert (directory / entry.rpartition("=")[2]).is_file(), f"{directory}: {entry}"


def test_kvpath_config_file_holds_only_real_settings() -> None:
    data = yaml.safe_load((BASE / "kvpath.yaml").read_text())
    assert set(data) <= {"common", *service_modules()}, f"unknown sections: {set(data)}"
    assert set(data["common"]) <= field_names(BaseConfig), "common: keys every service has"
    assert set(data) >= {"common", *CORE_SERVICES}


def test_every_kvpath_container_parses_with_the_real_cli(deployment: Deployment) -> None:
    assert {c.parsed.service for c in deployment.kvpath} >= set(CORE_SERVICES)
    (router,) = deployment.by_service("router")
    assert router.parsed.config.policy == "dualpath"
    roles = {c.parsed.config.role for c in deployment.by_service("engine")}
    assert roles == {"prefill", "decode"}
    ids = [c.parsed.config.service_id for c in deployment.kvpath]
    assert len(ids) == len(set(ids)) and all(ids), f"service ids must be set and distinct: {ids}"


def test_images_are_the_project_image_or_tagged_official_images(deployment: Deployment) -> None:
    for workload in deployment.manifests.workloads:
        for container in workload.pod["containers"] + (workload.pod.get("initContainers") or []):
            problem = image_problem(container["image"])
            assert problem is None, f"{workload.name}/{container['name']}: {problem}"


def test_probes_and_ports_point_at_the_service_port(deployment: Deployment) -> None:
    for c in deployment.kvpath:
        config = c.parsed.config
        assert loopback_binds(config) == [], f"{c.name}: bind every interface in a container"
        ports = [p["containerPort"] for p in c.container.get("ports") or []]
        assert config.http_port in ports, f"{c.name}: listens on {config.http_port}, declares {ports}"
        for kind in ("readinessProbe", "livenessProbe", "startupProbe"):
            probe = c.container.get(kind)
            if probe is None and kind == "startupProbe":
                continue
            assert probe is not None, f"{c.name}: no {kind}"
            want = "/ready" if kind == "readinessProbe" else "/health"  # ready: send traffic; health: alive
            assert probe["httpGet"]["path"] == want, f"{c.name}: {kind}"
            assert port_number(c.container, probe["httpGet"]["port"]) == config.http_port, f"{c.name}: {kind}"


def _pods_selected(deployment: Deployment, selector: dict[str, str]) -> list[Any]:
    return [w for w in deployment.manifests.workloads if selector.items() <= w.labels.items()]


def test_services_select_pods_and_their_ports(deployment: Deployment) -> None:
    for svc in deployment.manifests.of_kind("Service"):
        name, selector = svc["metadata"]["name"], svc["spec"].get("selector") or {}
        workloads = _pods_selected(deployment, selector)
        assert selector and workloads, f"Service {name} selects no workload ({selector})"
        for port in svc["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            found = [
                port_number(c, target)
                for w in workloads
                for c in w.pod["containers"]
                if any(p["containerPort"] == port_number(c, target) for p in c.get("ports") or [])
            ]
            assert found, f"Service {name}: no selected container listens on {target}"
    services = {s["metadata"]["name"]: s for s in deployment.manifests.of_kind("Service")}
    for workload in deployment.manifests.workloads:
        if workload.kind == "StatefulSet":
            headless = services.get(workload.spec["serviceName"])
            assert headless is not None and headless["spec"].get("clusterIP") == "None", workload.name


def test_volumes_claims_and_config_maps_exist(deployment: Deployment) -> None:
    claims = {c["metadata"]["name"] for c in deployment.manifests.of_kind("PersistentVolumeClaim")}
    for workload in deployment.manifests.workloads:
        volumes = {v["name"]: v for v in workload.pod.get("volumes") or []}
        templates = {t["metadata"]["name"] for t in workload.spec.get("volumeClaimTemplates") or []}
        for container in workload.pod["containers"]:
            for mount in container.get("volumeMounts") or []:
                assert mount["name"] in volumes or mount["name"] in templates, f"{workload.name}: {mount}"
        for volume in volumes.values():
            if "persistentVolumeClaim" in volume:
                assert volume["persistentVolumeClaim"]["claimName"] in claims, f"{workload.name}: {volume}"
            if "configMap" in volume:
                assert volume["configMap"]["name"] in deployment.manifests.configmaps, workload.name


def _mount_of(workload: Any, container: dict[str, Any], path: str) -> dict[str, Any] | None:
    volumes = {v["name"]: v for v in workload.pod.get("volumes") or []}
    for mount in container.get("volumeMounts") or []:
        if mount["mountPath"] == path:
            return volumes.get(mount["name"])
    return None


def test_node_pods_share_shm_and_node_number(deployment: Deployment) -> None:
    for engine in deployment.by_service("engine"):
        pod = [c for c in deployment.kvpath if c.workload is engine.workload]
        (storage,) = [c for c in pod if c.parsed.service == "storage"]
        assert storage.parsed.config.node == engine.parsed.config.node == engine.workload.first_ordinal
        assert engine.env.get("KVPATH_NODE") is not None, "node from the pod ordinal"
        assert storage.env.get("KVPATH_NODE") is not None, "node from the pod ordinal"
        shm = [_mount_of(engine.workload, c.container, "/dev/shm") for c in (engine, storage)]
        assert shm[0] is not None and shm[0] is shm[1], f"{engine.name}: share the pod's /dev/shm volume"
        assert shm[0]["emptyDir"]["medium"] == "Memory"
        # peers reach the engine KV receiver at the name it announces: its FQDN under the headless Service
        assert engine.workload.pod.get("setHostnameAsFQDN") is True, engine.name
    nodes = [c.parsed.config.node for c in deployment.by_service("storage")]
    assert len(nodes) == len(set(nodes)), f"one storage service per node: {nodes}"
    ranges = []
    for workload in {id(c.workload): c.workload for c in deployment.by_service("storage")}.values():
        start = workload.first_ordinal
        assert start is not None, f"{workload.name}: node numbers come from StatefulSet ordinals"
        ranges.append(range(start, start + workload.replicas))
    ranges.sort(key=lambda r: r.start)
    for a, b in itertools.pairwise(ranges):
        assert a.stop <= b.start, f"node numbers overlap: {a} and {b}"


def test_storage_services_share_one_claim_as_their_root(deployment: Deployment) -> None:
    claims = set()
    for storage in deployment.by_service("storage"):
        volume = _mount_of(storage.workload, storage.container, storage.parsed.config.root)
        assert volume is not None, f"{storage.name}: root {storage.parsed.config.root} is not mounted"
        claims.add(volume["persistentVolumeClaim"]["claimName"])
        assert storage.parsed.config.is_shared_root
    (claim,) = claims
    (pvc,) = [
        p for p in deployment.manifests.of_kind("PersistentVolumeClaim") if p["metadata"]["name"] == claim
    ]
    expected = "ReadWriteOnce" if deployment.variant.endswith("single-host") else "ReadWriteMany"
    assert pvc["spec"]["accessModes"] == [expected]


def test_prometheus_annotations_reach_every_metrics_port(deployment: Deployment) -> None:
    for workload in {id(c.workload): c.workload for c in deployment.kvpath}.values():
        notes = workload.annotations
        assert notes.get("prometheus.io/scrape") == "true", workload.name
        assert notes.get("prometheus.io/path", "/metrics") == "/metrics", workload.name
        pod = [c for c in deployment.kvpath if c.workload is workload]
        if "prometheus.io/port" in notes:
            (only,) = pod
            assert int(notes["prometheus.io/port"]) == only.parsed.config.http_port, workload.name
        else:  # every declared port is scraped: declare only the HTTP (metrics) ports
            for c in pod:
                declared = [p["containerPort"] for p in c.container.get("ports") or []]
                assert declared == [c.parsed.config.http_port], c.name


def test_every_container_requests_resources(deployment: Deployment) -> None:
    for workload in deployment.manifests.workloads:
        for container in workload.pod["containers"]:
            requests = (container.get("resources") or {}).get("requests") or {}
            assert {"cpu", "memory"} <= requests.keys(), f"{workload.name}/{container['name']}"


def test_cluster_wide_settings_agree(deployment: Deployment) -> None:
    configs = [c.parsed.config for c in deployment.kvpath]
    assert len({(c.nats_url, c.namespace, c.jetstream_replicas) for c in configs}) == 1
    services = {s["metadata"]["name"]: s for s in deployment.manifests.of_kind("Service")}
    seeds = [url.removeprefix("nats://") for url in configs[0].nats_url.split(",")]
    pods = set()
    for seed in seeds:  # <pod>.<headless service>:<port>, one per StatefulSet pod
        host, _, port = seed.partition(":")
        pod, _, service = host.partition(".")
        assert service in services and int(port) in [p["port"] for p in services[service]["spec"]["ports"]]
        (nats,) = _pods_selected(deployment, services[service]["spec"]["selector"])
        assert nats.spec["serviceName"] == service and pod.rsplit("-", 1)[0] == nats.name
        pods.add(int(pod.rsplit("-", 1)[1]))
    assert split_image(nats.pod["containers"][0]["image"])[0] == "nats"
    args = nats.pod["containers"][0]["args"]
    assert "-js" in args and args[args.index("--cluster_name") + 1] == "kvpath", "clustered JetStream"
    assert pods == set(range(nats.replicas)) and nats.replicas == 3 == configs[0].jetstream_replicas
    routes = args[args.index("--routes") + 1].split(",")
    assert {r.removeprefix("nats://").split(".")[0] for r in routes} == {f"nats-{i}" for i in pods}
    (pdb,) = deployment.manifests.of_kind("PodDisruptionBudget")
    assert (
        pdb["spec"]["minAvailable"] == 2
        and pdb["spec"]["selector"]["matchLabels"].items() <= nats.labels.items()
    )
    engines = [c.parsed.config for c in deployment.kvpath if c.parsed.service == "engine"]
    assert len({(c.block_size, c.dtype) for c in engines}) == 1, "engines must agree on the KV format"
    sized = [c.parsed.config for c in deployment.kvpath if c.parsed.service in ("router", "engine")]
    assert len({c.model for c in sized}) == 1


def test_gpu_overlay_gives_each_engine_a_gpu(deployment: Deployment) -> None:
    if deployment.variant != "overlays/gpu":
        pytest.skip("GPU overlay only")
    for c in deployment.kvpath:
        limits = (c.container.get("resources") or {}).get("limits") or {}
        is_engine = c.parsed.service == "engine"
        assert (int(limits.get("nvidia.com/gpu", 0)) >= 1) == is_engine, c.name
        assert c.parsed.config.device.startswith("cuda") if is_engine else True, c.name
        assert split_image(c.container["image"])[1].endswith("cuda"), c.name


def test_the_checker_rejects_a_pod_index_outside_a_statefulset(tmp_path: Path) -> None:
    manifests = load_raw_base()
    (router,) = [w for w in manifests.workloads if w.labels.get("app.kubernetes.io/name") == "kvpath-router"]
    router.pod["containers"][0]["env"].append(
        {
            "name": "KVPATH_NODE",
            "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{POD_INDEX_LABEL}']"}},
        }
    )
    with pytest.raises(ManifestError, match="only StatefulSet"):
        kvpath_containers(manifests, tmp_path)


def test_config_sections_build_valid_configs(tmp_path: Path) -> None:
    path = BASE / "kvpath.yaml"
    for service in CORE_SERVICES:
        parsed = parse_kvpath(
            ["serve", service, "--config", "/c.yaml"], env={}, config_files={"/c.yaml": path}
        )
        assert isinstance(parsed.config, config_class(service))
