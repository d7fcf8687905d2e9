"""Every module, function and command-line flag the docs name exists in the code: a doc that names something
renamed or removed fails here instead of misleading a reader."""
from __future__ import annotations

import ast
import builtins
import importlib
import re
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md",
        ROOT / "training" / "README.md"]
PROJECT_DIRS = ("prefixkv_core", "ui", "benchmarks", "training", "scenes", "tests", "docs", "assets", ".ci")
# names from the libraries the docs talk about, not the project's own
FOREIGN_ROOTS = {"torch", "transformers", "gr", "gradio", "np", "numpy", "F", "model", "plotly", "kaleido", "lmms_eval",
                 "accelerate", "DynamicCache", "DynamicLayer", "AttentionInterface", "AttentionMaskInterface",
                 "LlavaModel", "LlavaForConditionalGeneration", "gradio_client", "Client", "client", "pytest",
                 "playwright", "safetensors", "tqdm", "rouge_scorer", "json", "os", "dataclasses", "functools",
                 "math", "kvpress", "processor", "tokenizer", "generate", "fig", "go", "px", "PIL", "Image",
                 "handle_file"}
# names in other projects' code that the docs quote (DART's reference code)
FOREIGN_NAMES = {"max_num_trunction"}
# flags of other tools the docs mention next to ours (pip, docker, lmms-eval)
FOREIGN_FLAGS = {"--no-deps", "--build-arg", "--no-sandbox", "--include_path", "--model_args", "--tasks",
                 "--num_processes", "--batch_size", "--output_path", "--log_samples", "--limit"}


def _python_files() -> list[Path]:
    files = [ROOT / "app.py"]
    for folder in ("prefixkv_core", "ui", "benchmarks", "training", "scenes", "tests", "docs"):
        files += sorted((ROOT / folder).rglob("*.py"))
    return [f for f in files if ".venv" not in f.parts]


@lru_cache(maxsize=None)
def _tree(path: Path) -> ast.Module:
    """A project file's syntax tree, parsed once for every index below."""
    return ast.parse(path.read_text())


@lru_cache(maxsize=1)
def _defined_names() -> frozenset[str]:
    """Every function, class, method and module-level name defined in the project's Python files."""
    names: set[str] = set()
    for path in _python_files():
        tree = _tree(path)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    for leaf in ast.walk(target):
                        if isinstance(leaf, ast.Name):
                            names.add(leaf.id)
                        elif isinstance(leaf, ast.Attribute):
                            names.add(leaf.attr)
    return frozenset(names)


@lru_cache(maxsize=1)
def _code_words() -> frozenset[str]:
    """Every word of the project's code (`\\bname\\b` found in it, for a name of word characters)."""
    return frozenset(re.findall(r"\w+", _code_text()))


@lru_cache(maxsize=1)
def _code_text() -> str:
    parts = [p.read_text() for p in _python_files()]
    parts += [(ROOT / name).read_text() for name in ("Makefile", "Dockerfile", "pyproject.toml")
              if (ROOT / name).exists()]
    parts += [p.read_text() for p in sorted((ROOT / "benchmarks").rglob("*.yaml"))]  # the lmms-eval tasks
    return "\n".join(parts)


def _code_spans(text: str) -> list[str]:
    """The inline code spans of a Markdown text (fenced blocks are read line by line as spans too)."""
    spans = re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S))
    for block in re.findall(r"```[^\n]*\n(.*?)```", text, flags=re.S):
        spans += block.splitlines()
    return spans


def _doc_param():
    return [pytest.param(doc, id=str(doc.relative_to(ROOT))) for doc in DOCS if doc.exists()]


@pytest.mark.parametrize("doc", _doc_param())
def test_every_project_path_a_doc_names_exists(doc):
    text = doc.read_text()
    missing = []
    for match in re.finditer(r"(?<![\w/.-])((?:%s)/[\w./-]*\w)" % "|".join(map(re.escape, PROJECT_DIRS)), text):
        path, after = match.group(1), text[match.end():match.end() + 2]
        if any(ch in after for ch in "*<{[…"):  # a pattern (scene-*.png, budget-<r>.json), not one path
            continue
        if not (ROOT / path).exists() and not (doc.parent / path).exists():
            missing.append(path)
    assert not missing, f"{doc.name} names paths that do not exist: {sorted(set(missing))}"


@pytest.mark.parametrize("doc", _doc_param())
def test_every_module_a_doc_names_imports(doc):
    missing = []
    for dotted in sorted(set(re.findall(r"\b((?:prefixkv_core|ui|benchmarks|training|scenes)(?:\.\w+)+)", doc.read_text()))):
        if dotted.endswith((".py", ".md", ".json")) or re.search(r"\.(py|md|json|csv|png|pdf)$", dotted):
            continue
        if not _resolves(dotted):
            missing.append(dotted)
    assert not missing, f"{doc.name} names modules or attributes that do not exist: {missing}"


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def _names_in_code_blocks(text: str) -> set[str]:
    """What a doc's own Python examples define or import (an example method's class, its imports)."""
    names: set[str] = set()
    for block in re.findall(r"```python\n(.*?)```", text, flags=re.S):
        try:
            tree = ast.parse(block)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
    return names


@pytest.mark.parametrize("doc", _doc_param())
def test_every_function_a_doc_names_is_defined(doc):
    defined = _defined_names() | _names_in_code_blocks(doc.read_text()) | set(dir(builtins))
    missing = []
    for span in _code_spans(doc.read_text()):
        for call in re.findall(r"(?<![\w.])((?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*)\(", span):
            parts = call.split(".")
            if parts[0] in FOREIGN_ROOTS or parts[-1] in FOREIGN_ROOTS:
                continue
            if parts[-1] in defined:
                continue
            missing.append(call)
    assert not missing, f"{doc.name} names functions defined nowhere in the project: {sorted(set(missing))}"


@pytest.mark.parametrize("doc", _doc_param())
def test_every_flag_a_doc_gives_our_commands_exists(doc):
    """Flags on lines that run the project's own commands (app.py, the CLI, the benchmarks, training)."""
    code = _code_text()
    missing = []
    for span in _code_spans(doc.read_text()):
        if not re.search(r"app\.py|prefixkv_core|benchmarks/|training/|^\s*--", span):
            continue
        for flag in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", span):
            if flag not in FOREIGN_FLAGS and f'"{flag}' not in code and f"'{flag}" not in code:
                missing.append(flag)
    assert not missing, f"{doc.name} gives flags no command of the project takes: {sorted(set(missing))}"


# -- names qualified by their class or module ---------------------------------------------------------------

@lru_cache(maxsize=1)
def _classes() -> dict[str, tuple[set[str], list[str]]]:
    """Every class the project defines: name -> (its members: methods, class attributes, fields and the attributes
    its methods set on self, its base classes' names). Classes of the same name are merged."""
    found: dict[str, tuple[set[str], list[str]]] = {}
    for path in _python_files():
        for node in ast.walk(_tree(path)):
            if not isinstance(node, ast.ClassDef):
                continue
            members, bases = found.setdefault(node.name, (set(), []))
            bases += [ast.unparse(b).split(".")[-1].split("[")[0] for b in node.bases]
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    members.add(item.name)
                elif isinstance(item, ast.Assign):
                    members.update(t.id for t in item.targets if isinstance(t, ast.Name))
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    members.add(item.target.id)
            for sub in ast.walk(node):
                if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id == "self" \
                        and isinstance(sub.ctx, ast.Store):
                    members.add(sub.attr)
    return found


PACKAGES = {"prefixkv_core", "ui", "benchmarks", "training", "scenes", "texts", "tests", "docs", "assets"}
FILE_SUFFIXES = {"py", "md", "json", "jsonl", "csv", "tex", "html", "png", "pdf", "svg", "txt", "pt", "safetensors",
                 "rank"}


def _class_has(name: str, member: str, seen: frozenset[str] = frozenset()) -> bool:
    """Whether the project's class `name` (or a base class) has `member`; True when a base is not the project's
    (the member may come from a library class, such as transformers' DynamicCache)."""
    classes = _classes()
    members, bases = classes[name]
    if member in members:
        return True
    for base in bases:
        if base in seen or base in ("object", "Protocol", "Generic"):
            continue
        if base not in classes or _class_has(base, member, seen | {name}):
            return True
    return False


@lru_cache(maxsize=1)
def _modules() -> dict[str, set[str]]:
    """A project module's short name (its file's stem, or a package's folder) -> every name defined in it: at
    module level, and the members of its classes (`record.lock` names a record's attribute)."""
    found: dict[str, set[str]] = {}
    for path in _python_files():
        stem = path.parent.name if path.name == "__init__.py" else path.stem
        names = found.setdefault(stem, set())
        tree = _tree(path)
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names.update(t.id for t in targets if isinstance(t, ast.Name))
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names.update((a.asname or a.name).split(".")[0] for a in node.names)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                names |= _classes()[node.name][0]
    return found


@pytest.mark.parametrize("doc", _doc_param())
def test_every_class_or_module_member_a_doc_names_exists(doc):
    """`Session.run`, `RowStepper.advance`, `runner.forward_rows`: the member belongs to that class (or a base) or
    that module, not merely to something somewhere (a method moved to another class fails here)."""
    classes, modules = _classes(), _modules()
    local = _names_in_code_blocks(doc.read_text())
    missing = []
    for span in _code_spans(doc.read_text()):
        for owner, member in re.findall(r"(?<![\w.])([A-Za-z_]\w*)\.([A-Za-z_]\w*)\b(?!\.\w)", span):
            if owner in FOREIGN_ROOTS or owner in local or owner in PACKAGES or member in FILE_SUFFIXES:
                continue
            if owner in classes:
                if not _class_has(owner, member):
                    missing.append(f"{owner}.{member}")
            elif owner in modules and owner not in ("self", "policy", "view", "state", "layer", "cache", "context"):
                if member not in modules[owner]:
                    missing.append(f"{owner}.{member}")
    assert not missing, f"{doc.name} names members their class or module does not have: {sorted(set(missing))}"


@lru_cache(maxsize=None)
def _test_functions(path: Path) -> set[str]:
    return {node.name for node in ast.walk(_tree(path))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}


@pytest.mark.parametrize("doc", _doc_param())
def test_every_test_a_doc_cites_exists(doc):
    """`tests/test_x.py::test_y` names a test of that file; a bare `test_y` in backticks a test of some file."""
    text = doc.read_text()
    missing = []
    for path, name in re.findall(r"(tests/\w+\.py)::(\w+)", text):
        if not (ROOT / path).exists() or name not in _test_functions(ROOT / path):
            missing.append(f"{path}::{name}")
    every = set().union(*(_test_functions(p) for p in sorted((ROOT / "tests").glob("test_*.py"))))
    for span in _code_spans(text):
        for name in re.findall(r"^(test_\w+)(?:\(\))?$", span.strip()):
            if name not in every:
                missing.append(name)
    assert not missing, f"{doc.name} cites tests that do not exist: {sorted(set(missing))}"


@pytest.mark.parametrize("doc", _doc_param())
def test_every_snake_case_name_a_doc_gives_occurs_in_the_code(doc):
    """A name in backticks such as `question_start`, a private helper, `kept_per_layer` or `SPARE_ENTRIES` (a
    function, an attribute, a knob, a JSON key, a constant, an environment variable) occurs somewhere in the
    project's code: a renamed or removed one fails here."""
    words = _code_words()
    local = _names_in_code_blocks(doc.read_text())
    missing = []
    for span in _code_spans(doc.read_text()):
        name = re.fullmatch(r"(_[A-Za-z][A-Za-z0-9_]*|[a-z][a-z0-9]*(?:_[a-z0-9]+)+|[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+)"
                            r"(?:\(\))?", span.strip())
        if name and name.group(1) not in local | FOREIGN_NAMES and name.group(1) not in words:
            missing.append(name.group(1))
    assert not missing, f"{doc.name} names identifiers that occur nowhere in the code: {sorted(set(missing))}"


@pytest.mark.parametrize("doc", _doc_param())
def test_every_name_a_doc_places_in_a_file_is_defined_there(doc):
    """"`ui/inputs.py` `guard_input`, `check_request`": the names after a Python file are defined in that file."""
    missing = []
    text = doc.read_text()
    pattern = r"`((?:%s)/[\w/]+\.py)`((?:,? (?:/ )?`[A-Za-z_]\w*`)+)" % "|".join(map(re.escape, PROJECT_DIRS))
    for match in re.finditer(pattern, text):
        path = ROOT / match.group(1)
        if not path.exists():
            continue  # the path test reports it
        tree = _tree(path)
        defined = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
        defined |= {t.id for n in ast.walk(tree) if isinstance(n, ast.Assign) for t in n.targets
                    if isinstance(t, ast.Name)}
        missing += [f"{match.group(1)} {name}" for name in re.findall(r"`(\w+)`", match.group(2)) if name not in defined]
    assert not missing, f"{doc.name} places names in files that do not define them: {sorted(set(missing))}"
