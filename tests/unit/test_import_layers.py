"""The package layers import only downward: parsed from the source (every ``import`` statement,
including those inside functions), no package imports from a package that imports it.

Layers, bottom to top::

    protocol  <-  modelkit  <-  oldlogit_service  <-  rollout  <-  trainer  <-  deploy  <-  benchmarks  <-  vintage_cli

A package may import any package below it and none above (benchmarks start clusters with
``deploy``'s local Ray head); only the command line (``vintage_cli``) imports ``benchmarks``, and
nothing imports ``vintage_cli``.

Inside ``trainer`` the same rule holds between its sub-packages::

    trainer.algorithm  <-  trainer.learner  <-  trainer.driver

and inside ``trainer.driver`` between its rooms (``config`` and ``cluster`` at the bottom, ``loop``
at the top)::

    config  <-  cluster
    config  <-  records  <-  sources  <-  publication  <-  loop
                workers  <-  sources
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("protocol", "modelkit", "rollout", "oldlogit_service", "trainer", "deploy", "benchmarks", "vintage_cli")
TRAINER_ROOMS = ("trainer.algorithm", "trainer.learner", "trainer.driver")
DRIVER_ROOMS = tuple(
    f"trainer.driver.{r}" for r in ("config", "cluster", "records", "workers", "sources", "publication", "loop")
)


def module_name(path: Path) -> str:
    """Dotted module name of a file under ROOT (``a/b/__init__.py`` -> ``a.b``)."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(path: Path, names: bool = False) -> set[str]:
    """Every absolute module name ``path`` imports (relative imports resolved), at any nesting depth;
    with ``names``, also ``module.name`` for each name of a ``from module import name`` (which may be
    a submodule: ``from trainer import driver``)."""
    mod = module_name(path)
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            out.add(target)
            if names:
                out.update(f"{target}.{a.name}" if target else a.name for a in node.names)
    return out


def package_graph() -> dict[str, set[str]]:
    """``{package: {first-party packages its modules import}}`` (self-imports left out)."""
    graph: dict[str, set[str]] = {p: set() for p in PACKAGES}
    for pkg in PACKAGES:
        for f in sorted((ROOT / pkg).rglob("*.py")):
            for target in imported_modules(f):
                top = target.split(".")[0]
                if top in PACKAGES and top != pkg:
                    graph[pkg].add(top)
    return graph


def room_of(module: str, rooms: tuple[str, ...] = TRAINER_ROOMS) -> str | None:
    """The room (of ``rooms``: ``trainer``'s sub-packages by default) a dotted module name belongs
    to, or None."""
    return next((r for r in rooms if module == r or module.startswith(r + ".")), None)


def trainer_room_graph(rooms: tuple[str, ...] = TRAINER_ROOMS) -> dict[str, set[str]]:
    """``{room: {other rooms its modules import}}`` for ``trainer``'s sub-packages or the driver's rooms."""
    graph: dict[str, set[str]] = {r: set() for r in rooms}
    for room in rooms:
        for f in sorted((ROOT / room.replace(".", "/")).rglob("*.py")):
            for target in imported_modules(f, names=True):
                other = room_of(target, rooms)
                if other is not None and other != room:
                    graph[room].add(other)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_imports_are_resolved_from_source(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    f = pkg / "mod.py"
    f.write_text("import a.b\nfrom . import sib\nfrom .x import y\ndef g():\n    from c import d\n")
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        assert imported_modules(f) == {"a.b", "pkg", "pkg.x", "c"}
        assert imported_modules(f, names=True) == {"a.b", "pkg", "pkg.sib", "pkg.x", "pkg.x.y", "c", "c.d"}
    finally:
        ROOT = saved


def test_cycle_finder_on_a_hand_made_graph():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(g) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_package_imports_a_package_that_imports_it():
    graph = package_graph()
    assert cycles(graph) == []
    mutual = sorted((a, b) for a in graph for b in graph[a] if a in graph[b])
    assert mutual == []


@pytest.mark.parametrize(
    "pkg, allowed",
    [
        ("protocol", set()),
        ("modelkit", {"protocol"}),
        ("rollout", {"protocol", "modelkit", "oldlogit_service"}),
        ("oldlogit_service", {"protocol", "modelkit"}),
        ("trainer", {"protocol", "modelkit", "rollout", "oldlogit_service"}),
        ("deploy", {"protocol", "modelkit", "rollout", "oldlogit_service", "trainer"}),
        ("benchmarks", {"protocol", "modelkit", "rollout", "oldlogit_service", "trainer", "deploy"}),
    ],
)
def test_each_package_imports_only_its_lower_layers(pkg, allowed):
    extra = package_graph()[pkg] - allowed
    assert extra == set(), f"{pkg} imports from higher layers: {sorted(extra)}"


def test_only_the_command_line_imports_benchmarks_and_nothing_imports_it():
    graph = package_graph()
    assert sorted(p for p in graph if "benchmarks" in graph[p]) == ["vintage_cli"]
    assert sorted(p for p in graph if "vintage_cli" in graph[p]) == []


def test_every_trainer_module_is_in_a_sub_package():
    """``trainer`` holds only its sub-packages (and its own ``__init__``), so the room checks see every module."""
    loose = sorted(
        str(f.relative_to(ROOT))
        for f in (ROOT / "trainer").rglob("*.py")
        if f != ROOT / "trainer" / "__init__.py" and room_of(module_name(f)) is None
    )
    assert loose == []


def test_no_cycle_between_the_trainer_sub_packages():
    graph = trainer_room_graph()
    assert cycles(graph) == []
    mutual = sorted((a, b) for a in graph for b in graph[a] if a in graph[b])
    assert mutual == []


@pytest.mark.parametrize(
    "room, allowed",
    [
        ("trainer.algorithm", set()),
        ("trainer.learner", {"trainer.algorithm"}),
        ("trainer.driver", {"trainer.algorithm", "trainer.learner"}),
    ],
)
def test_each_trainer_sub_package_imports_only_the_ones_below(room, allowed):
    extra = trainer_room_graph()[room] - allowed
    assert extra == set(), f"{room} imports from higher sub-packages: {sorted(extra)}"


def test_every_driver_module_is_in_a_room():
    loose = sorted(
        str(f.relative_to(ROOT))
        for f in (ROOT / "trainer" / "driver").rglob("*.py")
        if f != ROOT / "trainer" / "driver" / "__init__.py" and room_of(module_name(f), DRIVER_ROOMS) is None
    )
    assert loose == []


def _below(*rooms: str) -> set[str]:
    return {f"trainer.driver.{r}" for r in rooms}


@pytest.mark.parametrize(
    "room, allowed",
    [
        ("config", set()),
        ("cluster", _below("config")),
        ("records", _below("config")),
        ("workers", set()),
        ("sources", _below("config", "records", "workers")),
        ("publication", _below("config", "records", "workers", "sources")),
        ("loop", _below("config", "cluster", "records", "workers", "sources", "publication")),
    ],
)
def test_each_driver_room_imports_only_the_rooms_below(room, allowed):
    graph = trainer_room_graph(DRIVER_ROOMS)
    assert cycles(graph) == []
    extra = graph[f"trainer.driver.{room}"] - allowed
    assert extra == set(), f"trainer.driver.{room} imports from rooms above it: {sorted(extra)}"


def module_graph() -> dict[str, set[str]]:
    """``{module: {first-party modules it imports}}`` over every package. ``from pkg import mod``
    counts as an import of ``pkg.mod`` only when ``mod`` is a module (not of ``pkg``'s
    ``__init__``), so a package that re-exports its modules is not a cycle with them."""
    files = {module_name(f): f for pkg in PACKAGES for f in sorted((ROOT / pkg).rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for mod, f in files.items():
        targets = {t for t in imported_modules(f, names=True) if t in files and t != mod}
        graph[mod] = {t for t in targets if not any(o.startswith(t + ".") for o in targets)}
    return graph


def test_no_module_imports_a_module_that_imports_it():
    """No file cycle anywhere, lazy and type-checking imports included."""
    assert cycles(module_graph()) == []


def test_the_test_fixtures_import_no_ray():
    """Unit tests pay no Ray import: conftest (and what it imports) leaves ``ray`` unimported."""
    import subprocess
    import sys

    code = (
        "import sys; sys.path[:0] = [sys.argv[1], sys.argv[1] + '/tests']; import conftest; "
        "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))"
    )
    out = subprocess.run([sys.executable, "-c", code, str(ROOT)], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
