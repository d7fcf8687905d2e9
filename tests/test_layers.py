"""The project's layers, read from the source: which folder may import which, and no import circles.

Every .py file of the project's code is parsed with `ast`; every import in it, at module level or inside a
function (a function-level import still ties the two modules together), becomes an edge of the module graph,
relative imports resolved; imports under `if TYPE_CHECKING:` are left out (they never run). From the bottom
up:

    scenes, texts        data only: nothing of the project but themselves
    prefixkv_core        the engine: never the app's ui, the benchmarks or the training
    ui                   the app's views and controller: the engine, never transformers itself
    benchmarks, training tools on top of the engine; training never imports benchmarks
    app.py               the entry point

`python tests/test_layers.py` prints every circle and every edge that breaks a rule.
"""
from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("prefixkv_core", "ui", "benchmarks", "training", "scenes", "texts")
SCRIPTS = ("app.py",)

# The engine's pipeline, lowest first: a module may import its own layer and the ones below, never above.
CORE_LAYERS = (
    ("prefixkv_core.errors", "prefixkv_core.limits", "prefixkv_core.models"),  # the model and its inputs
    ("prefixkv_core.report",),  # events, the record, Lorenz, metrics, the leaderboard layout
    ("prefixkv_core.kv",),  # the tracked cache, quantisation, the attention function
    ("prefixkv_core.policies",),  # what each method keeps
    ("prefixkv_core.decoding",),  # the runner: one forward over many rows, the policies around it
    ("prefixkv_core.session",),  # the engine, the session and its turn
    ("prefixkv_core",),  # the package's face, the CLI, calibration, the CLI's argument helpers, test helpers
)

# (importer's top folder, imported top folder or third-party package): a dependency that points the wrong way
FORBIDDEN = {
    ("training", "benchmarks"): "training may not import benchmarks (move what both need below them)",
    ("prefixkv_core", "ui"): "the engine may not import the app's ui",
    ("prefixkv_core", "benchmarks"): "the engine may not import the benchmarks",
    ("prefixkv_core", "training"): "the engine may not import the training",
    ("ui", "transformers"): "ui may not import transformers (the engine loads models)",
}
LEAVES = ("scenes", "texts")  # import nothing of the project but themselves


def module_files() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the project's code."""
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    for script in SCRIPTS:
        out[Path(script).stem] = ROOT / script
    return out


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def _is_type_checking(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _runtime_nodes(tree: ast.AST, annotations: bool = False):
    """Every node that can run: `if TYPE_CHECKING:` bodies are left out (annotations only, never imported)
    unless `annotations`."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        if _is_type_checking(node) and not annotations:
            todo += node.orelse
        else:
            todo += ast.iter_child_nodes(node)


def imported_names(module: str, path: Path, modules: dict[str, Path],
                   annotations: bool = False) -> list[tuple[str, int]]:
    """(dotted name, line) of everything `path` imports, relative imports made absolute; `from X import y`
    gives X.y when that is a module of the project, else X (y is a name defined in X)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = module if _is_package(path) else module.rpartition(".")[0]
    out = []
    for node in _runtime_nodes(tree, annotations):
        if isinstance(node, ast.Import):
            out += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".") if package else []
                parts = parts[:len(parts) - (node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}" if base else alias.name
                out.append((sub if sub in modules else base, node.lineno))
    return out


def _project_module(name: str, modules: dict[str, Path]) -> str | None:
    """The project module `name` refers to: itself, or the longest enclosing module (X for X.function)."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def import_graph(annotations: bool = False) -> tuple[dict[str, dict[str, int]], dict[str, set[str]]]:
    """(project edges: importer -> {imported module: first line}, third-party top-level names per importer);
    `annotations`: with the imports under `if TYPE_CHECKING:` too."""
    modules = module_files()
    edges: dict[str, dict[str, int]] = {m: {} for m in modules}
    external: dict[str, set[str]] = defaultdict(set)
    for module, path in modules.items():
        for name, line in imported_names(module, path, modules, annotations):
            target = _project_module(name, modules)
            if target is None:
                external[module].add(name.split(".")[0])
            elif target != module:
                edges[module][target] = min(line, edges[module].get(target, line))
    return edges, external


def top(module: str) -> str:
    return module.split(".")[0]


def strongly_connected(edges: dict[str, dict[str, int]]) -> list[list[str]]:
    """Tarjan's components with more than one module, each sorted (an iterative walk: no recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    counter = 0
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, {})))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def one_cycle(edges: dict[str, dict[str, int]], component: list[str]) -> list[str]:
    """A shortest circle through the component's first module, as [a, b, ..., a]."""
    members = set(component)
    start = component[0]
    paths = {start: [start]}
    queue = [start]
    while queue:
        node = queue.pop(0)
        for child in sorted(edges[node]):
            if child == start:
                return paths[node] + [start]
            if child in members and child not in paths:
                paths[child] = paths[node] + [child]
                queue.append(child)
    return component


def describe_cycle(edges: dict[str, dict[str, int]], cycle: list[str]) -> str:
    steps = [f"{a} (line {edges[a][b]}) -> {b}" for a, b in zip(cycle, cycle[1:])]
    return "\n    ".join(steps)


def cycles(edges: dict[str, dict[str, int]]) -> list[list[str]]:
    """One circle per strongly connected group of modules."""
    return [one_cycle(edges, component) for component in strongly_connected(edges)]


def core_layer(module: str) -> int | None:
    """The index in CORE_LAYERS of an engine module (the longest matching prefix), None outside the engine."""
    best, found = -1, None
    for i, prefixes in enumerate(CORE_LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, found = len(prefix), i
    return found


def upward_core_imports(edges: dict[str, dict[str, int]]) -> list[str]:
    out = []
    for module, targets in sorted(edges.items()):
        here = core_layer(module)
        for target, line in sorted(targets.items()):
            there = core_layer(target)
            if here is not None and there is not None and there > here and target != "prefixkv_core":
                out.append(f"{module} (line {line}) imports {target}, a layer above it ({CORE_LAYERS[there][0]})")
    return out


def violations(edges: dict[str, dict[str, int]], external: dict[str, set[str]]) -> list[str]:
    out = []
    for module, targets in sorted(edges.items()):
        for target, line in sorted(targets.items()):
            rule = FORBIDDEN.get((top(module), top(target)))
            if rule:
                out.append(f"{module} (line {line}) imports {target}: {rule}")
            if top(module) in LEAVES and top(target) != top(module):
                out.append(f"{module} (line {line}) imports {target}: {top(module)} imports nothing of the "
                           "project but itself")
        for package in sorted(external.get(module, ())):
            rule = FORBIDDEN.get((top(module), package))
            if rule:
                out.append(f"{module} imports {package}: {rule}")
    return out


# -- the tests ----------------------------------------------------------------------------------------------

def test_the_graph_sees_every_layer():
    """A sanity check of the parser: known edges are found, relative and function-level ones included."""
    edges, external = import_graph()
    assert "prefixkv_core.policies" in edges["prefixkv_core.method_args"]  # from .policies import ...
    assert "scenes" in edges["training.data"]  # from scenes import ...
    assert "training.grid_stages" in edges["training.train_embedded"]  # inside main()
    assert "torch" in external["prefixkv_core.report.lorenz"]


@pytest.mark.parametrize("annotations", [False, True], ids=["runtime", "with-annotation-imports"])
def test_no_import_cycles(annotations):
    """No circle at run time, nor through the imports kept for annotations (a reader and a type checker follow
    those too)."""
    edges, _ = import_graph(annotations)
    found = cycles(edges)
    assert not found, "import cycles:\n  " + "\n  ".join(describe_cycle(edges, c) for c in found)


def test_the_engine_imports_only_down_its_pipeline():
    edges, _ = import_graph()
    found = upward_core_imports(edges)
    assert not found, "engine imports against its pipeline:\n  " + "\n  ".join(found)


def test_no_layer_imports_upward():
    edges, external = import_graph()
    found = violations(edges, external)
    assert not found, "imports against the layers:\n  " + "\n  ".join(found)


if __name__ == "__main__":
    graph, third_party = import_graph()
    for circle in cycles(graph):
        print("cycle:\n    " + describe_cycle(graph, circle))
    for problem in violations(graph, third_party):
        print(problem)
    sys.exit(0)
