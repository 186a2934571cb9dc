"""The shape of the source tree: modules a reader can take in whole, layers that do not loop.

- No module under src/megalab is longer than `MAX_LINES`.
- The import graph, counting every import at any depth (inside functions and `TYPE_CHECKING`
  blocks too), has no cycle: no strongly connected component of more than one module (and so
  none holding both modules of a pair in `SEPARATED`, pairs that once imported each other).
- No module imports one of a higher layer (`LAYERS`, lowest first), except the imports listed
  in `UPWARD_IMPORTS`, each with its reason.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from conftest import ROOT

PACKAGE = ROOT / "src" / "megalab"
MAX_LINES = 700
# Modules over the limit until they are split (none now): each listed one must still be over
# the limit, so that the set only shrinks.
OVER_LIMIT_FOR_NOW: set[str] = set()
# A module that imports from the other must not be imported back, directly or through others.
SEPARATED = [
    ("megalab.efficiency", "megalab.reporting"),
    ("megalab.data.cache", "megalab.data.download"),
    ("megalab.nn.attention", "megalab.kernels.attention"),
]

# The layers, lowest first: a module may import its own layer and those below. A module is of
# the layer of the longest name it falls within (`megalab.data.cli` is a shim, not data); every
# module has one. The library, then the reporting on runs, then the command-line programs
# (`megalab.cli`, the entry points), then the commands' old module paths, kept as shims that
# forward to them; the package `megalab` itself (the public API) is the top.
SHIMS = (
    "megalab.train",
    "megalab.eval",
    "megalab.generate",
    "megalab.translate",
    "megalab.sweep",
    "megalab.export",
    "megalab.curves",
    "megalab.eval_runs",
    "megalab.tables",
    "megalab.data.cli",
)
LAYERS: list[tuple[str, ...]] = [
    ("megalab.utils", "megalab.version", "megalab.config_schema"),
    ("megalab.kernels",),
    ("megalab.nn",),
    # FSDP2 sharding of a backbone's blocks is model code the tasks call in `configure_model`.
    ("megalab.models", "megalab.parallel.fsdp2"),
    ("megalab.data", "megalab.batch", "megalab.testing"),
    ("megalab.tasks", "megalab.optim", "megalab.generation"),
    ("megalab.parallel", "megalab.memory", "megalab.memory_probe", "megalab.efficiency"),
    (
        "megalab.callbacks",
        "megalab.loggers",
        "megalab.run_loading",
        "megalab.long_context",
        "megalab.pretrained",
    ),
    ("megalab.reporting",),
    ("megalab.cli",),
    SHIMS,
]
# (importer, imported): a module or a package (all its modules); the reason it stays. None now:
# an import that must run upward is listed here with its reason.
UPWARD_IMPORTS: dict[tuple[str, str], str] = {}


def _sources() -> Iterator[Path]:
    return (p for p in sorted(PACKAGE.rglob("*.py")) if "__pycache__" not in p.parts)


def _lines(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").splitlines())


def test_no_module_is_longer_than_the_limit() -> None:
    lengths = {p.relative_to(PACKAGE).as_posix(): _lines(p) for p in _sources()}
    long = {name: n for name, n in lengths.items() if n > MAX_LINES}
    new = {name: n for name, n in long.items() if name not in OVER_LIMIT_FOR_NOW}
    assert not new, f"modules over {MAX_LINES} lines, split them: {new}"
    shrunk = sorted(OVER_LIMIT_FOR_NOW - set(long))
    assert not shrunk, f"{shrunk} no longer over {MAX_LINES} lines: drop them from the set"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """megalab module -> the megalab modules it imports anywhere in its code.

    `from a import b` counts as importing `a`, and `a.b` where that is a module.
    """
    paths = {_module_name(p): p for p in _sources()}
    graph: dict[str, set[str]] = {name: set() for name in paths}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
                targets = [base, *(f"{base}.{alias.name}" for alias in node.names)]
            else:
                continue
            graph[name].update(t for t in targets if t in paths and t != name)
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of `graph` (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    components.append(component)
    return components


def test_strongly_connected_finds_cycles_only() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    found = sorted(sorted(c) for c in strongly_connected(graph))
    assert found == [["a", "b", "c"], ["d"], ["e"]]


def _within(name: str, module: str) -> bool:
    """`name` is `module` or, where `module` is a package, one of its modules."""
    return name == module or name.startswith(module + ".")


def test_the_import_graph_has_no_cycle() -> None:
    cycles = [sorted(c) for c in strongly_connected(import_graph()) if len(c) > 1]
    assert not cycles, f"import cycles (move what the modules share down a layer): {cycles}"


def layer(name: str) -> int:
    """The index of `name`'s layer in `LAYERS` (that of the longest member it falls within);
    `megalab` on top, -1 for a module of no layer."""
    if name == "megalab":
        return len(LAYERS)
    found = [(len(m), i) for i, members in enumerate(LAYERS) for m in members if _within(name, m)]
    return max(found)[1] if found else -1


def test_layer_finds_the_layers() -> None:
    assert layer("megalab.utils.errors") == 0
    assert layer("megalab.nn.norms") == layer("megalab.nn") == 2
    assert layer("megalab.parallel.fsdp2") == 3 < layer("megalab.parallel.chunk")
    assert layer("megalab.models") == layer("megalab.models.megalodon") == 3
    assert layer("megalab.reporting.stats") < layer("megalab.cli.tables")
    assert layer("megalab.cli.eval") < layer("megalab.eval") < layer("megalab")
    assert layer("megalab.data.cli") == layer("megalab.train") > layer("megalab.data.cache")
    assert layer("megalab.utilsx") == -1  # a prefix of a name is not its package


def test_every_module_has_a_layer() -> None:
    unplaced = sorted(name for name in import_graph() if name != "megalab" and layer(name) < 0)
    assert not unplaced, f"modules of no layer (add them to LAYERS): {unplaced}"


def test_no_module_imports_a_higher_layer() -> None:
    graph = import_graph()
    for a, b in UPWARD_IMPORTS:
        assert any(_within(m, a) for m in graph), f"{a} is gone: update UPWARD_IMPORTS"
        assert any(_within(m, b) for m in graph), f"{b} is gone: update UPWARD_IMPORTS"
    upward = sorted(
        (name, t) for name, targets in graph.items() for t in targets if layer(t) > layer(name)
    )
    listed = {
        (name, t)
        for name, t in upward
        for a, b in UPWARD_IMPORTS
        if _within(name, a) and _within(t, b)
    }
    new = [pair for pair in upward if pair not in listed]
    assert not new, f"imports of a higher layer (move the code down a layer): {new}"
    used = {
        (a, b)
        for a, b in UPWARD_IMPORTS
        for name, t in listed
        if _within(name, a) and _within(t, b)
    }
    stale = sorted(set(UPWARD_IMPORTS) - used)
    assert not stale, f"{stale} no longer import upward: drop them from UPWARD_IMPORTS"


def test_separated_modules_do_not_import_each_other() -> None:
    graph = import_graph()
    for pair in SEPARATED:
        assert all(name in graph for name in pair), f"{pair}: a module is gone, update the list"
    cycles = [c for c in strongly_connected(graph) if len(c) > 1]
    joined = [
        (a, b, sorted(c))
        for a, b in SEPARATED
        for c in cycles
        if any(_within(m, a) for m in c) and any(_within(m, b) for m in c)
    ]
    assert not joined, f"import cycles join modules kept apart: {joined}"
