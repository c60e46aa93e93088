"""docs/metrics.md against the code: every registered metric documented with its type and labels, and back."""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.metrics import MetricWrapperBase

REPO = Path(__file__).resolve().parents[2]
METRICS_DOC = REPO / "docs" / "metrics.md"
_ROW = re.compile(r"^\| `(kvpath_[a-z0-9_]+)` \| (counter|gauge|histogram) \|([^|]*)\|")
_SECTIONS = ("bus", "process", "router", "engine", "storage", "index", "remotekv", "cxlpool")


@dataclass(frozen=True, slots=True)
class DocumentedMetric:
    name: str  # as scraped: counters with their _total suffix
    section: str  # the service kind whose /metrics carries it; "bus": every service
    type: str
    labels: frozenset[str]


def documented_metrics(path: Path = METRICS_DOC) -> dict[str, DocumentedMetric]:
    """The rows of docs/metrics.md, under the `## <service>` heading each sits in."""
    out: dict[str, DocumentedMetric] = {}
    section = ""
    for line in path.read_text().splitlines():
        if line.startswith("## "):
            section = line[3:].split()[0]
            continue
        row = _ROW.match(line)
        if row is None:
            continue
        assert section in _SECTIONS, f"metric {row.group(1)} documented outside a service section"
        name, typ, labels = row.groups()
        assert name not in out, f"{name} documented twice"
        out[name] = DocumentedMetric(name, section, typ, frozenset(re.findall(r"`([a-z_]+)`", labels)))
    return out


def registered_metrics() -> dict[str, tuple[str, str, frozenset[str]]]:
    """name -> (module section, type, labels) of every metric object in the metrics modules."""
    modules = {"bus": "shared.telemetry", "process": "shared.service"}
    modules.update({s: f"services.{s}.metrics" for s in _SECTIONS[2:]})
    out = {}
    for section, module_name in modules.items():
        for value in vars(importlib.import_module(module_name)).values():
            if isinstance(value, MetricWrapperBase):
                name = value._name + ("_total" if value._type == "counter" else "")
                out[name] = (section, value._type, frozenset(value._labelnames))
    return out


def test_every_registered_metric_is_documented_and_every_documented_one_exists() -> None:
    documented = documented_metrics()
    registered = registered_metrics()
    assert sorted(registered.keys() - documented.keys()) == [], "metrics missing from docs/metrics.md"
    assert sorted(documented.keys() - registered.keys()) == [], (
        "docs/metrics.md names metrics no code registers"
    )


def test_documented_section_type_and_labels_match_the_code() -> None:
    registered = registered_metrics()
    for name, doc in documented_metrics().items():
        assert (doc.section, doc.type, doc.labels) == registered[name], name


def test_names_follow_the_conventions() -> None:
    for name, doc in documented_metrics().items():
        assert name.startswith(f"kvpath_{doc.section}_"), name
        if doc.type == "counter":
            assert name.endswith("_total"), name
        if doc.type == "histogram":
            assert name.endswith(("_seconds", "_size", "_bytes", "_tokens")), name
        assert not name.endswith(("_ms", "_milliseconds", "_kb", "_mb")), f"{name}: not a base unit"


def test_doc_parser_reads_sections_types_and_labels(tmp_path: Path) -> None:
    doc = tmp_path / "m.md"
    doc.write_text(
        "## router\n\n| name | type | labels | meaning |\n|---|---|---|---|\n"
        "| `kvpath_router_x_total` | counter | `a`, `b` | x |\n## index\n"
        "| `kvpath_index_y` | gauge | | y |\n"
    )
    assert documented_metrics(doc) == {
        "kvpath_router_x_total": DocumentedMetric(
            "kvpath_router_x_total", "router", "counter", frozenset("ab")
        ),
        "kvpath_index_y": DocumentedMetric("kvpath_index_y", "index", "gauge", frozenset()),
    }
