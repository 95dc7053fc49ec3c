"""The package's import graph, read from the source (every `import`, also those inside functions):
no module imports one of a higher layer (DESIGN.md's table), and no import circle."""

import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "speedtronic"

LAYERS = {  # a module imports only modules of its own layer or below
    0: {"config", "files", "optional", "paths", "errors"},
    1: {"registry", "model", "module_utils", "data", "hf_datasets", "tokens", "precision"},
    2: {
        "optimizers",
        "schedules",
        "checkpoint",
        "profiling",
        "hooks",
        "progress",
        "plotting",
        "integrations",
        "shapes",
        "scheduling",
        "generation",
    },
    3: {"trainer", "evaluation", "parallel", "distributed", "hf"},
    4: {"runtime", "widgets"},
    5: {"cli", "__main__", "__init__", "showdoc"},
}
# Imports that break the rules and are being removed elsewhere; each one still present is allowed,
# one that is gone must leave this tuple (so it cannot come back unnoticed).
KNOWN_EXCEPTIONS: tuple[tuple[str, str], ...] = ()


def module_name(path: Path, package: Path) -> str:
    "`speedtronic/distributed/hub.py` -> `distributed.hub`; the package itself is `__init__`."
    parts = list(path.relative_to(package).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts.pop()
    return ".".join(parts)


def imported_modules(path: Path, package: Path) -> set[str]:
    "The package modules `path` imports anywhere in its body (relative and absolute imports)."
    # the package `path` is in
    package_parts = list(path.relative_to(package).with_suffix("").parts)[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                target = package_parts[: len(package_parts) - (node.level - 1)] + (
                    node.module.split(".") if node.module else []
                )
            elif node.module and node.module.split(".")[0] == "speedtronic":
                target = node.module.split(".")[1:]
            else:
                continue
            names = [target + [a.name] for a in node.names] if not node.module else [target]
            found.update(".".join(t) or "__init__" for t in names)
        elif isinstance(node, ast.Import):
            found.update(
                ".".join(a.name.split(".")[1:]) or "__init__"
                for a in node.names
                if a.name.split(".")[0] == "speedtronic"
            )
    return found


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """module -> modules of the package it imports (a name that is no module, `from . import x` of a
    function, is dropped)."""
    modules = {module_name(p, package): p for p in package.rglob("*.py") if p.name != "_modidx.py"}
    graph = {}
    for name, path in modules.items():
        targets = set()
        for t in imported_modules(path, package):
            while t and t not in modules:
                t = t.rpartition(".")[0]  # `distributed.hub.HubClient` -> `distributed.hub`
            if t and t != name:
                targets.add(t)
        graph[name] = targets
    return graph


def layer_of(module: str) -> int:
    top = module.split(".")[0]
    for layer, names in LAYERS.items():
        if top in names:
            return layer
    raise AssertionError(
        f"speedtronic.{module} has no layer: add it to LAYERS in {Path(__file__).name} (and "
        "DESIGN.md)"
    )


def _top(module: str) -> str:
    return module.split(".")[0]


def upward_imports(graph: dict[str, set[str]], allowed=KNOWN_EXCEPTIONS) -> list[str]:
    return sorted(
        f"{a} (layer {layer_of(a)}) imports {b} (layer {layer_of(b)})"
        for a, targets in graph.items()
        for b in targets
        if layer_of(b) > layer_of(a) and (_top(a), _top(b)) not in allowed
    )


def circles(graph: dict[str, set[str]], allowed=KNOWN_EXCEPTIONS) -> list[list[str]]:
    "The import circles (strongly connected groups of more than one module), Tarjan's algorithm."
    edges = {
        a: {b for b in targets if (_top(a), _top(b)) not in allowed} for a, targets in graph.items()
    }
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_the_graph_is_read():
    graph = import_graph()
    assert "plotting" in graph["widgets"] and "plotting" in graph["progress"]
    assert {"profiling", "plotting", "parallel"} <= graph["trainer"]
    # relative imports inside the subpackage
    assert "distributed.tensors" in graph["distributed.hub"]


def test_no_import_circle():
    assert circles(import_graph()) == []


def test_no_upward_import():
    assert upward_imports(import_graph()) == []


def test_known_exceptions_still_exist():
    graph = import_graph()
    gone = [
        (a, b)
        for a, b in KNOWN_EXCEPTIONS
        if not any(_top(t) == b for m, ts in graph.items() if _top(m) == a for t in ts)
    ]
    assert not gone, f"fixed: remove {gone} from KNOWN_EXCEPTIONS"


def test_a_circle_is_found():
    "The checks themselves: a two-module circle, a longer one, and an upward import are reported."
    graph = {
        "progress": {"widgets"},
        "widgets": {"progress", "schedules"},
        "schedules": set(),
        "config": set(),
    }
    assert circles(graph) == [["progress", "widgets"]]
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}}, allowed=()) == [["a", "b", "c"]]
    assert upward_imports(graph) == ["progress (layer 2) imports widgets (layer 4)"]


def test_data_imports_no_datasets_chapter():
    """`data` imports `hf_datasets` nowhere, not even inside a function: `hf_datasets` builds on
    `data`, and `data` reaches its reader only by the name in `SOURCE_READERS`."""
    tree = ast.parse((PACKAGE / "data.py").read_text(encoding="utf-8"))
    found = [
        ast.unparse(n)
        for n in ast.walk(tree)
        if isinstance(n, (ast.Import, ast.ImportFrom)) and "hf_datasets" in ast.unparse(n)
    ]
    assert found == []
    assert "hf_datasets" not in import_graph()["data"]
    assert "data" in import_graph()["hf_datasets"]


def test_importing_data_loads_no_datasets_library():
    "`datasets` (and the chapter that reads it) load only when a run asks for `data.hf_dataset`."
    code = (
        "import sys, speedtronic.data as d; "
        "print(sorted(m for m in ('datasets', 'speedtronic.hf_datasets') if m in sys.modules)); "
        "d.source_reader('hf_dataset'); print('speedtronic.hf_datasets' in sys.modules)"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True
    ).stdout.split()
    assert out == ["[]", "True"]
