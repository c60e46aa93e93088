"""Prometheus scrape config, OpenTelemetry collector config and the Grafana dashboard of the dev cluster."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from tests.unit.deploy.compose import OFFICIAL_PORTS, Compose, load_compose, mounts, url_host_port
from tests.unit.deploy.kvpath_cli import DEPLOY, metrics_modules, registered_metric_names, split_image

PROMETHEUS = DEPLOY / "prometheus" / "prometheus.yml"
COLLECTOR = DEPLOY / "otel" / "collector.yaml"
DATASOURCES = DEPLOY / "grafana" / "provisioning" / "datasources" / "datasources.yaml"
PROVIDERS = DEPLOY / "grafana" / "provisioning" / "dashboards" / "dashboards.yaml"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "kvpath.json"
METRIC = re.compile(r"\bkvpath_[a-z0-9_]+\b")
# what issue 7 asks the dashboard to show (families; each must be queried by some panel)
REQUIRED_FAMILIES = (
    "kvpath_router_time_to_first_token_seconds",
    "kvpath_router_inter_token_latency_seconds",
    "kvpath_router_e2e_request_latency_seconds",
    "kvpath_router_requests_running",
    "kvpath_router_requests_queued",
    "kvpath_router_prompt_tokens_total",
    "kvpath_router_cached_tokens_total",
    "kvpath_engine_decode_batch_size",
    "kvpath_engine_kv_blocks_used",
    "kvpath_engine_kv_blocks_total",
    "kvpath_engine_prefill_step_seconds",
    "kvpath_engine_decode_step_seconds",
    "kvpath_storage_read_bytes_total",
    "kvpath_storage_write_bytes_total",
    "kvpath_storage_read_requests_pending",
    "kvpath_bus_messages_total",
    "kvpath_bus_errors_total",
)


@pytest.fixture(scope="module")
def compose() -> Compose:
    return load_compose()


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels") or [])


def _queries(dashboard: dict[str, Any]) -> list[str]:
    return [t["expr"] for p in _panels(dashboard["panels"]) for t in p.get("targets") or []]


def test_prometheus_scrapes_every_kvpath_service_at_its_port(compose: Compose) -> None:
    config = yaml.safe_load(PROMETHEUS.read_text())
    targets = []
    for job in config["scrape_configs"]:
        assert job.get("metrics_path", "/metrics") == "/metrics", job["job_name"]
        for static in job["static_configs"]:
            targets += [t.rsplit(":", 1) for t in static["targets"]]
    scraped = {host: int(port) for host, port in targets if host not in ("127.0.0.1", "localhost")}
    for host in scraped:
        assert host in compose.services, f"Prometheus target {host} is not a compose service"
    expected = {name: p.config.http_port for name, p in compose.kvpath.items()}
    assert scraped == expected, "every kvpath service scraped once, at its HTTP port"
    (prom,) = [s for s in compose.services.values() if "prom/prometheus" in s["image"]]
    assert ("./prometheus/prometheus.yml", "/etc/prometheus/prometheus.yml") in mounts(prom)


def test_scrape_labels_match_the_services_node_and_role(compose: Compose) -> None:
    config = yaml.safe_load(PROMETHEUS.read_text())
    for job in config["scrape_configs"]:
        for static in job["static_configs"]:
            labels = static.get("labels") or {}
            for target in static["targets"]:
                parsed = compose.kvpath.get(target.rsplit(":", 1)[0])
                if parsed is None:
                    continue
                assert labels.get("service_id") == parsed.config.service_id, target
                if "node" in labels:
                    assert int(labels["node"]) == parsed.config.node, target
                if "role" in labels:
                    assert labels["role"] == parsed.config.role, target


def test_collector_pipeline_forwards_otlp_to_jaeger(compose: Compose) -> None:
    config = yaml.safe_load(COLLECTOR.read_text())
    service = config["service"]
    for ext in service.get("extensions", []):
        assert ext in config["extensions"], ext
    for name, pipeline in service["pipelines"].items():
        for kind in ("receivers", "processors", "exporters"):
            for component in pipeline.get(kind, []):
                assert component in config[kind], f"pipeline {name}: undefined {kind[:-1]} {component}"
    for name, exporter in config["exporters"].items():
        host, port = exporter["endpoint"].rsplit(":", 1)
        assert host in compose.services, f"exporter {name}: {host} is not a compose service"
        assert "jaeger" in compose.services[host]["image"] and port == "4317"


def test_grafana_datasources_reach_compose_services(compose: Compose, dashboard: dict[str, Any]) -> None:
    sources = yaml.safe_load(DATASOURCES.read_text())["datasources"]
    for source in sources:
        host, port = url_host_port(source["url"])
        assert host in compose.services, source["name"]
        assert port in OFFICIAL_PORTS[split_image(compose.services[host]["image"])[0]], source["name"]
    uids = {s["uid"] for s in sources}
    used = {
        p["datasource"]["uid"]
        for p in _panels(dashboard["panels"])
        if p["type"] != "row" and isinstance(p.get("datasource"), dict)
    }
    assert used and used <= uids, f"dashboard uses datasources {used - uids} that are not provisioned"


def test_grafana_loads_the_dashboard_directory(compose: Compose) -> None:
    (grafana,) = [s for s in compose.services.values() if "grafana/grafana" in s["image"]]
    targets = dict(mounts(grafana))
    assert targets["./grafana/provisioning"] == "/etc/grafana/provisioning"
    providers = yaml.safe_load(PROVIDERS.read_text())["providers"]
    assert [p["options"]["path"] for p in providers] == [targets["./grafana/dashboards"]]


def test_dashboard_is_well_formed(dashboard: dict[str, Any]) -> None:
    panels = list(_panels(dashboard["panels"]))
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids are unique"
    for panel in panels:
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24, panel["title"]
        if panel["type"] != "row":
            refs = [t["refId"] for t in panel["targets"]]
            assert refs and len(refs) == len(set(refs)), panel["title"]


def test_every_queried_metric_exists_in_the_code(dashboard: dict[str, Any]) -> None:
    known = registered_metric_names()
    queried = {m for expr in _queries(dashboard) for m in METRIC.findall(expr)}
    missing = sorted(queried - known)
    assert not missing, f"dashboard queries metrics no module registers ({metrics_modules()}): {missing}"


def test_dashboard_covers_the_documented_signals(dashboard: dict[str, Any]) -> None:
    text = "\n".join(_queries(dashboard))
    assert [f for f in REQUIRED_FAMILIES if f not in text] == []


def test_dashboard_has_panels_for_every_service_that_exports_metrics(dashboard: dict[str, Any]) -> None:
    """When a service grows metrics (say the index), the dashboard must show at least one of them."""
    kinds = {m.split("_")[1] for m in registered_metric_names() if m.startswith("kvpath_")}
    queried = {m.split("_")[1] for expr in _queries(dashboard) for m in METRIC.findall(expr)}
    assert kinds - queried == set(), f"no dashboard panel for kvpath_<{kinds - queried}>_* metrics"
