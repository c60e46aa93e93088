"""deploy/docker-compose.yml, checked against the real CLI parsers and config classes (no Docker here)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit.deploy.compose import (
    COMPOSE_FILE,
    GPU_OVERRIDE,
    OFFICIAL_PORTS,
    Compose,
    depends_on,
    environment,
    healthcheck_test,
    is_project_image,
    load_compose,
    mounts,
    published_ports,
    url_host_port,
)
from tests.unit.deploy.kvpath_cli import (
    CORE_SERVICES,
    DEPLOY,
    REPO,
    ManifestError,
    image_problem,
    loopback_binds,
    parse_kvpath,
    split_image,
)

CONDITIONS = ("service_started", "service_healthy", "service_completed_successfully")
HEALTHCHECK_SCRIPT = "/opt/kvpath/healthcheck.py"


@pytest.fixture(scope="module", params=["cpu", "gpu"])
def compose(request: pytest.FixtureRequest) -> Compose:
    """The dev cluster as `docker compose` sees it, alone and with the GPU override file."""
    return load_compose(COMPOSE_FILE) if request.param == "cpu" else load_compose(COMPOSE_FILE, GPU_OVERRIDE)


def test_cluster_runs_the_dualpath_topology(compose: Compose) -> None:
    assert {p.service for p in compose.kvpath.values()} >= set(CORE_SERVICES)
    (router,) = compose.by_service("router").values()
    assert router.config.policy == "dualpath"
    engines = {(p.config.role, p.config.node) for p in compose.by_service("engine").values()}
    assert engines == {("prefill", 0), ("decode", 1)}
    storage_nodes = sorted(p.config.node for p in compose.by_service("storage").values())
    assert storage_nodes == [0, 1], "one storage service per node"
    images = {split_image(str(s.get("image")))[0] for s in compose.services.values()}
    assert {"nats", "otel/opentelemetry-collector", "jaegertracing/all-in-one"} <= images
    assert {"prom/prometheus", "grafana/grafana"} <= images


def test_kvpath_services_bind_all_interfaces_on_fixed_ports_with_fixed_ids(compose: Compose) -> None:
    ids = []
    for name, parsed in compose.kvpath.items():
        env = environment(compose.services[name])
        assert loopback_binds(parsed.config) == [], f"{name}: bind every interface in a container"
        assert parsed.config.http_port > 0, f"{name}: a fixed port for healthchecks and Prometheus"
        assert env.get("KVPATH_SERVICE_ID"), f"{name}: KVPATH_SERVICE_ID must be fixed"
        assert {"KVPATH_NATS_URL", "KVPATH_NAMESPACE"} <= env.keys(), name
        ids.append(parsed.config.service_id)
    assert len(ids) == len(set(ids)), f"duplicate service ids: {ids}"


def test_cluster_wide_settings_agree(compose: Compose) -> None:
    configs = [p.config for p in compose.kvpath.values()]
    assert len({(c.nats_url, c.namespace, c.jetstream_replicas) for c in configs}) == 1
    seeds = [url_host_port(url) for url in configs[0].nats_url.split(",")]
    assert len(seeds) == 3 and configs[0].jetstream_replicas == 3, "a 3-node cluster, replicated 3 ways"
    names = set()
    for host, port in seeds:
        nats = compose.services[host]
        command = nats["command"]
        assert split_image(nats["image"])[0] == "nats" and "-js" in command, "NATS with JetStream"
        assert port == 4222 and command[command.index("--cluster_name") + 1] == "kvpath"
        routes = command[command.index("--routes") + 1].split(",")
        assert {url_host_port(r)[0] for r in routes} == {h for h, _ in seeds} - {host}, f"{host}: routes"
        names.add(command[command.index("--name") + 1])
    assert len(names) == 3, "JetStream needs a distinct server name per node"
    engines = [p.config for p in compose.kvpath.values() if p.service == "engine"]
    # the router takes the KV format from the engines: they must agree among themselves
    assert len({(c.block_size, c.dtype) for c in engines}) == 1, "engines must agree on the KV format"
    sized = [p.config for p in compose.kvpath.values() if p.service in ("router", "engine")]
    assert len({c.model for c in sized}) == 1, "router and engines must serve the same model"


def test_images_are_the_project_image_or_tagged_official_images(compose: Compose) -> None:
    for name, svc in compose.services.items():
        assert "image" in svc, name
        assert image_problem(svc["image"]) is None, f"{name}: {image_problem(svc['image'])}"
    builds = [svc["build"] for svc in compose.services.values() if is_project_image(svc) and "build" in svc]
    assert builds, "the project image is built by compose"
    for build in builds:
        context = (DEPLOY / build["context"]).resolve()
        assert context == REPO, "build context is the repository root"
        assert (context / build["dockerfile"]).is_file()
    tags = {
        (split_image(svc["image"])[1], svc["build"].get("args", {}).get("VARIANT", "cpu"))
        for svc in compose.services.values()
        if is_project_image(svc)
    }
    assert len(tags) == 1, f"every kvpath container runs the same image: {tags}"
    ((tag, variant),) = tags
    assert variant in ("cpu", "cuda") and tag.endswith(variant), f"image {tag} built as VARIANT={variant}"


def test_gpu_override_gives_each_engine_a_gpu() -> None:
    compose = load_compose(COMPOSE_FILE, GPU_OVERRIDE)
    for name, parsed in compose.kvpath.items():
        devices = compose.services[name].get("deploy", {}).get("resources", {}).get("reservations", {})
        gpus = [d for d in devices.get("devices", []) if "gpu" in d.get("capabilities", [])]
        assert bool(gpus) == (parsed.service == "engine"), name
        if parsed.service == "engine":
            assert parsed.config.device == "cuda", name


def test_depends_on_names_existing_services_with_healthchecks(compose: Compose) -> None:
    for name, svc in compose.services.items():
        for dep, condition in depends_on(svc).items():
            assert dep in compose.services, f"{name} depends on unknown service {dep}"
            assert condition in CONDITIONS, f"{name} -> {dep}: {condition}"
            if condition == "service_healthy":
                test = healthcheck_test(compose.services[dep])
                assert test and test[0] in ("CMD", "CMD-SHELL"), f"{name} waits for {dep}'s healthcheck"
    _assert_acyclic({n: set(depends_on(s)) for n, s in compose.services.items()})


def _assert_acyclic(graph: dict[str, set[str]]) -> None:
    done: set[str] = set()

    def visit(node: str, path: tuple[str, ...]) -> None:
        assert node not in path, f"depends_on cycle: {' -> '.join((*path, node))}"
        if node not in done:
            for dep in graph.get(node, ()):
                visit(dep, (*path, node))
            done.add(node)

    for node in graph:
        visit(node, ())


def test_kvpath_services_start_after_their_dependencies_are_healthy(compose: Compose) -> None:
    for name in compose.kvpath:
        for node in ("nats-0", "nats-1", "nats-2"):
            assert depends_on(compose.services[name]).get(node) == "service_healthy", name
    (router,) = compose.by_service("router")
    router_deps = depends_on(compose.services[router])
    for engine in compose.by_service("engine"):
        assert router_deps.get(engine) == "service_healthy", f"router waits for {engine}"
    for engine, parsed in compose.by_service("engine").items():
        deps = depends_on(compose.services[engine])
        (storage,) = [
            s for s, p in compose.by_service("storage").items() if p.config.node == parsed.config.node
        ]
        assert deps.get(storage) == "service_healthy", f"{engine} waits for its node's storage"


def test_healthchecks_probe_the_port_the_service_listens_on(compose: Compose) -> None:
    for name, parsed in compose.kvpath.items():
        svc = compose.services[name]
        test = healthcheck_test(svc)
        assert test[:3] == ["CMD", "python", HEALTHCHECK_SCRIPT], f"{name}: {test}"
        if "--port" in test:
            assert int(test[test.index("--port") + 1]) == parsed.config.http_port, name
        else:  # the script probes $KVPATH_HTTP_PORT
            assert int(environment(svc)["KVPATH_HTTP_PORT"]) == parsed.config.http_port, name


def test_published_ports_point_at_listening_ports(compose: Compose) -> None:
    host_ports = []
    for name, svc in compose.services.items():
        for host, target in published_ports(svc):
            host_ports.append(host)
            if name in compose.kvpath:
                assert target == compose.kvpath[name].config.http_port, f"{name}: {host}:{target}"
            else:
                repo = split_image(svc["image"])[0]
                assert target in OFFICIAL_PORTS.get(repo, set()), (
                    f"{name}: {repo} does not listen on {target}"
                )
    assert len(host_ports) == len(set(host_ports)), f"host ports published twice: {host_ports}"
    (router,) = compose.by_service("router")
    assert (8000, 8000) in published_ports(compose.services[router])


def test_storage_services_share_one_named_volume_as_their_root(compose: Compose) -> None:
    volumes = set()
    for name, parsed in compose.by_service("storage").items():
        targets = {target: source for source, target in mounts(compose.services[name])}
        assert parsed.config.root in targets, f"{name}: --root {parsed.config.root} is not a mount"
        volumes.add(targets[parsed.config.root])
        assert parsed.config.is_shared_root, f"{name}: several nodes share the root"
    (volume,) = volumes
    assert volume in compose.volumes, "a named volume declared at top level"


def test_engines_join_their_node_storage_ipc_namespace(compose: Compose) -> None:
    storage_by_node = {p.config.node: n for n, p in compose.by_service("storage").items()}
    assert len(storage_by_node) == len(compose.by_service("storage")), "one storage service per node"
    for name, parsed in compose.by_service("engine").items():
        storage = storage_by_node.get(parsed.config.node)
        assert storage is not None, f"{name}: no storage service on node {parsed.config.node}"
        assert compose.services[name].get("ipc") == f"service:{storage}", name
        assert compose.services[storage].get("ipc") == "shareable", storage
        assert compose.services[storage].get("shm_size"), f"{storage}: /dev/shm holds the node buffer"
        # peers reach the engine's KV receiver at the host name it announces
        assert compose.services[name].get("hostname") == name, f"{name}: hostname resolvable by peers"


def test_mounted_files_and_named_volumes_exist(compose: Compose) -> None:
    for name, svc in compose.services.items():
        for source, target in mounts(svc):
            if source.startswith((".", "/")):
                assert (DEPLOY / source).exists(), f"{name}: {source} -> {target} does not exist"
            else:
                assert source in compose.volumes, f"{name}: undeclared volume {source}"


def test_kvpath_services_export_traces_to_the_collector(compose: Compose) -> None:
    import yaml

    collector = next(
        (n for n, s in compose.services.items() if "opentelemetry-collector" in s["image"]), None
    )
    assert collector is not None
    config_file = dict((t, s) for s, t in mounts(compose.services[collector]))["/etc/otelcol/config.yaml"]
    receivers = yaml.safe_load((DEPLOY / config_file).read_text())["receivers"]
    http_port = int(receivers["otlp"]["protocols"]["http"]["endpoint"].rsplit(":", 1)[1])
    for name in compose.kvpath:
        endpoint = environment(compose.services[name]).get("OTEL_EXPORTER_OTLP_ENDPOINT", "")
        assert url_host_port(endpoint) == (collector, http_port), f"{name}: {endpoint!r}"


@pytest.mark.parametrize(
    ("argv", "env", "why"),
    [
        (["serve", "enigne"], {}, "invalid choice"),
        (["serve", "engine", "--rolle", "prefill"], {}, "unrecognized arguments"),
        (["serve", "engine", "--role", "verifier"], {}, "role"),
        (["serve", "storage", "--node", "0"], {"KVPATH_NODES": "1"}, "KVPATH_NODES"),
        (["serve", "router", "--config", "/etc/kvpath/kvpath.yaml"], {}, "not a mounted config file"),
        (["up"], {}, "kvpath serve"),
    ],
)
def test_the_checker_rejects_what_kvpath_would_reject(argv: list[str], env: dict[str, str], why: str) -> None:
    with pytest.raises(ManifestError, match=why):
        parse_kvpath(argv, env=env)


def test_the_checker_builds_the_config_kvpath_would(tmp_path: Path) -> None:
    config_file = tmp_path / "kvpath.yaml"
    config_file.write_text("common: {namespace: fromyaml}\nstorage: {root: /y, http_port: 9100}\n")
    parsed = parse_kvpath(
        ["serve", "storage", "--config", "/etc/k.yaml", "--root", "/flag"],
        env={"KVPATH_NODE": "3", "KVPATH_HTTP_PORT": "9101"},
        config_files={"/etc/k.yaml": config_file},
    )
    assert parsed.service == "storage"
    assert (parsed.config.namespace, parsed.config.root) == ("fromyaml", "/flag")
    assert (parsed.config.node, parsed.config.http_port) == (3, 9101)
