"""The house, checked on the source: floors, cycles, torch's one home, the rooms of a service, sizes.

Imports are read with `ast` from every module of `shared`, `gpu`, `services` and `loadgen`, including the ones
inside functions and under `TYPE_CHECKING` (a dependency is a dependency, whenever it is resolved).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FLOORS = ("shared", "gpu", "services", "loadgen")  # each may import only its own floor and those before it
HEAVY = ("torch", "cupy")  # only gpu/ imports them
# processes of their own (`kvpath serve <name>`)
SERVICES = ("router", "engine", "index", "storage", "remotekv", "cxlpool")
ROOMS = ("__main__.py", "config.py", "service.py", "handlers.py", "metrics.py")
MAX_FUNCTION_LINES = 60
MAX_MODULE_LINES = 400


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for top in FLOORS for p in sorted((REPO / top).rglob("*.py"))}


MODULES = _modules()
TREES = {name: ast.parse(path.read_text(encoding="utf-8")) for name, path in MODULES.items()}


def _imported(name: str) -> list[str]:
    """Every module name `name` imports (absolute; `from pkg import submodule` names the submodule)."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: list[str] = []
    for node in ast.walk(TREES[name]):
        if isinstance(node, ast.Import):
            out += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, *([node.module] if node.module else [])])
            subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in MODULES]
            out += subs if len(subs) == len(node.names) else [base, *subs]
    return out


def _own(module: str) -> str | None:
    """The project module an imported name resolves to (its longest known prefix), None if external."""
    while module and module not in MODULES:
        module = module.rpartition(".")[0]
    return module or None


def _graph() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = defaultdict(set)
    for name in MODULES:
        for target in _imported(name):
            own = _own(target)
            if own is not None and own != name:
                edges[name].add(own)
    return edges


GRAPH = _graph()


def test_floors_only_import_downwards() -> None:
    upward = sorted(
        f"{a} -> {b}"
        for a, targets in GRAPH.items()
        for b in targets
        if FLOORS.index(b.split(".")[0]) > FLOORS.index(a.split(".")[0])
    )
    assert not upward, "imports that run up a floor (shared -> gpu -> services -> loadgen):\n" + "\n".join(
        upward
    )


def test_no_import_cycles_anywhere() -> None:
    cycles = _cycles(GRAPH)
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(sorted(c)) for c in cycles)


def test_the_check_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_torch_and_cupy_only_in_gpu() -> None:
    outside = sorted(
        f"{name} imports {target}"
        for name in MODULES
        if not name.startswith("gpu")
        for target in _imported(name)
        if target.split(".")[0] in HEAVY
    )
    assert not outside, "\n".join(outside)


def test_services_do_not_import_each_other() -> None:
    """A service reaches another over the bus; shared libraries of the floor (policy, up) are fine."""
    crossing = sorted(
        f"{a} -> {b}"
        for a, targets in GRAPH.items()
        for b in targets
        if a.startswith("services.")
        and b.startswith("services.")
        and a.split(".")[1] in SERVICES
        and b.split(".")[1] in SERVICES
        and a.split(".")[1] != b.split(".")[1]
    )
    assert not crossing, "\n".join(crossing)


@pytest.mark.parametrize("service", SERVICES)
def test_every_service_has_the_same_rooms(service: str) -> None:
    folder = REPO / "services" / service
    missing = [room for room in ROOMS if not (folder / room).is_file()]
    assert not missing, f"services/{service} lacks {missing}"
    handlers = f"services.{service}.handlers"
    assert f"services.{service}.service" not in GRAPH[handlers], "handlers take the core, not the service"


def test_the_policies_are_pure() -> None:
    """services/policy imports no I/O, no asyncio, no bus, no service: a snapshot in, a decision out."""
    allowed_external = {"__future__", "abc", "bisect", "collections", "dataclasses", "enum", "functools"}
    allowed_external |= {"heapq", "itertools", "math", "statistics", "typing"}
    for name in [m for m in MODULES if m.startswith("services.policy")]:
        for target in _imported(name):
            own = _own(target)
            if own is None:
                assert target.split(".")[0] in allowed_external, f"{name} imports {target}"
            else:
                assert own.startswith(("services.policy", "shared.errors")), f"{name} imports {own}"


def test_sizes() -> None:
    """Modules under ~400 lines, functions under ~60 (STYLE.md: past that, split by concept)."""
    too_long = []
    for name, path in MODULES.items():
        lines = path.read_text(encoding="utf-8").count("\n")
        if lines > MAX_MODULE_LINES:
            too_long.append(f"{name}: {lines} lines")
        for node in ast.walk(TREES[name]):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    too_long.append(f"{name}.{node.name}: {length} lines")
    assert not too_long, "\n".join(too_long)


def _cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[set[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(component)
    return found
