"""Components meet only in the base: no module of a component imports another component.

Read from the source (ast), every import counted: top-level, inside a
function (lazy) and under ``TYPE_CHECKING``. A component may import itself,
the base (``kvmesh.<module>`` that is not a component) and ``kvmesh.proto``.
The issue-14 rule that matters most, client/ and coordinator/ import nothing
from worker/ and worker/ nothing from coordinator/, is never waived.

One edge is allowed, by design and one way (`BUILT_ON`): the gateway is built
on the coordinator's pure core (its index and routing policies, which import
neither Ray nor gRPC), because it hosts that index for its engines in its own
process. It may import those modules and no other of the coordinator's, and
the coordinator never imports the gateway. A new edge fails, and so does an
allowed one that is gone (take it off the list).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
COMPONENTS = ("client", "coordinator", "worker", "gateway", "connector")
APP = "app"  # above every component: it may import them all, nothing imports it
SHARED = ("proto",)  # generated wire types every component may speak
NEVER = {
    ("client", "worker"),
    ("coordinator", "worker"),
    ("worker", "coordinator"),
    ("coordinator", "gateway"),
}

BUILT_ON: dict[tuple[str, str], frozenset[str]] = {
    # The gateway routes real engines' traffic itself: it keeps a `GlobalIndex` of its
    # engines' blocks (fed by kvmesh.engine_subscriber) and picks with the coordinator's
    # policies, in its own process. Moving that core into the base would make the base the
    # coordinator; a gateway going through the coordinator actor would add a Ray hop per
    # request. So the gateway is built on it, and on nothing else of the coordinator.
    ("gateway", "coordinator"): frozenset(
        {"kvmesh.coordinator.index", "kvmesh.coordinator.policies"}
    ),
}
SHELLS = ("ray", "grpc")
"""What a pure core imports none of: the runtimes of the thin shells (actors, servicers)."""


def imported_modules(source: str, module: str) -> set[str]:
    """Every module `source` (the text of `module`, dotted) imports, relative ones resolved."""
    found: set[str] = set()
    package = module.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                anchor = ".".join(parts[: len(parts) - node.level + 1])
                base = f"{anchor}.{base}" if base else anchor
            found.add(base)
            if component_of(base) is None:  # `from kvmesh import worker`: named through its parent
                found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def component_of(module: str) -> str | None:
    """The component (or the app) a dotted module belongs to, None for the base and the rest."""
    parts = module.split(".")
    if len(parts) >= 2 and parts[0] == "kvmesh" and parts[1] in (*COMPONENTS, APP):
        return parts[1]
    return None


def foreign_imports(source: str, module: str) -> set[tuple[str, str]]:
    """(imported component, imported module) for each import of another component."""
    own = component_of(module)
    out: set[tuple[str, str]] = set()
    for name in imported_modules(source, module):
        other = component_of(name)
        if other is not None and other != own and other not in SHARED:
            out.add((other, name))
    return out


def edges_in_tree() -> dict[tuple[str, str], set[str]]:
    """(importer, imported) component -> the importing files and the modules they import."""
    edges: dict[tuple[str, str], set[str]] = {}
    for component in COMPONENTS:
        for path in sorted((ROOT / component).rglob("*.py")):
            rel = path.relative_to(ROOT).with_suffix("")
            module = "kvmesh." + ".".join(rel.parts)
            for other, name in foreign_imports(path.read_text(encoding="utf-8"), module):
                edges.setdefault((component, other), set()).add(f"{rel}.py -> {name}")
    return edges


@pytest.mark.parametrize(
    ("module", "source", "expected"),
    [
        (
            "kvmesh.client.mesh",
            "def f():\n    from kvmesh.worker.actor import WorkerActor\n",
            {("worker", "kvmesh.worker.actor")},
        ),
        (
            "kvmesh.coordinator.actor",
            "import kvmesh.worker.peers\n",
            {("worker", "kvmesh.worker.peers")},
        ),
        (
            "kvmesh.worker.links",
            "from kvmesh import coordinator\n",
            {("coordinator", "kvmesh.coordinator")},
        ),
        (
            "kvmesh.worker.links",
            "from ..coordinator import actor\n",
            {("coordinator", "kvmesh.coordinator")},
        ),
        (
            "kvmesh.worker.actor",
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kvmesh.gateway.app import App\n",
            {("gateway", "kvmesh.gateway.app")},
        ),
    ],
)
def test_the_reader_sees_lazy_relative_and_type_only_imports_of_another_component(
    module: str, source: str, expected: set[tuple[str, str]]
) -> None:
    assert expected <= foreign_imports(source, module)


def test_the_base_its_own_component_and_proto_are_not_foreign() -> None:
    source = (
        "from kvmesh.requests import GenerateRequest\nfrom kvmesh.proto import kvmesh_pb2\n"
        "from kvmesh.worker.page_pool import PagePool\nfrom . import serving\n"
    )
    assert foreign_imports(source, "kvmesh.worker.actor") == set()


def test_client_and_coordinator_import_nothing_from_worker_nor_worker_from_coordinator() -> None:
    edges = edges_in_tree()
    broken = {edge: sorted(edges[edge]) for edge in NEVER if edge in edges}
    assert not broken, f"components must meet only in the base (kvmesh/*.py): {broken}"


def test_no_component_imports_another_beyond_the_one_it_is_built_on() -> None:
    edges = edges_in_tree()
    new = {edge: sorted(files) for edge, files in edges.items() if edge not in BUILT_ON}
    assert not new, f"a component imports another; move what they share to the base: {new}"
    gone = sorted(edge for edge in BUILT_ON if edge not in edges)
    assert not gone, f"these edges are gone: take them off BUILT_ON: {gone}"


def test_a_component_built_on_another_imports_only_that_ones_pure_core() -> None:
    edges = edges_in_tree()
    beyond = {
        edge: sorted(f for f in edges.get(edge, ()) if f.rsplit(" -> ", 1)[1] not in core)
        for edge, core in BUILT_ON.items()
    }
    beyond = {edge: files for edge, files in beyond.items() if files}
    assert not beyond, f"only the pure core may be imported across a BUILT_ON edge: {beyond}"


def module_path(module: str) -> Path:
    """The source file of a dotted module of a component (``kvmesh.coordinator.index``)."""
    return ROOT.joinpath(*module.split(".")[1:]).with_suffix(".py")


def core_closure(roots: frozenset[str]) -> set[str]:
    """`roots` and every module of their own component they import, transitively."""
    seen: set[str] = set()
    todo = list(roots)
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        source = module_path(module).read_text(encoding="utf-8")
        own = component_of(module)
        todo += [
            name
            for name in imported_modules(source, module)
            if component_of(name) == own and module_path(name).is_file()
        ]
    return seen


def test_the_core_a_component_is_built_on_imports_neither_ray_nor_grpc() -> None:
    shells = {
        module: sorted(
            name
            for name in imported_modules(module_path(module).read_text(encoding="utf-8"), module)
            if name.split(".")[0] in SHELLS
        )
        for core in BUILT_ON.values()
        for module in core_closure(core)
    }
    shells = {module: names for module, names in shells.items() if names}
    assert not shells, f"a core other components are built on imports a shell runtime: {shells}"


def test_the_reader_follows_a_core_into_what_it_imports_of_its_own_component() -> None:
    closure = core_closure(frozenset({"kvmesh.coordinator.index"}))
    assert "kvmesh.coordinator.index_store" in closure
    assert "kvmesh.coordinator.actor" not in closure


def test_the_base_imports_no_component_and_not_the_app() -> None:
    upward = {
        f"kvmesh/{path.name} -> {name}"
        for path in sorted((ROOT / "kvmesh").glob("*.py"))
        for name in imported_modules(path.read_text(encoding="utf-8"), f"kvmesh.{path.stem}")
        if component_of(name) not in (None, *SHARED)
    }
    assert not upward, f"the base (kvmesh/*.py) imports nothing above it: {sorted(upward)}"


def test_the_reader_sees_an_import_of_the_app() -> None:
    source = "def f():\n    from kvmesh.app.launch import start_workers\n"
    assert foreign_imports(source, "kvmesh.client.mesh") == {("app", "kvmesh.app.launch")}
