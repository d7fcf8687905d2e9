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
# flags of other tools the docs mention next to ours (pip, docker, lmms-eval)
FOREIGN_FLAGS = {"--no-deps", "--build-arg", "--no-sandbox", "--include_path", "--model_args", "--tasks",
                 "--num_processes", "--batch_size", "--output_path", "--log_samples", "--limit"}


def _python_files() -> list[Path]:
    files = [ROOT / "app.py"]
    for folder in ("prefixkv_core", "ui", "benchmarks", "training", "scenes", "tests", "docs"):
        files += sorted((ROOT / folder).rglob("*.py"))
    return [f for f in files if ".venv" not in f.parts]


@lru_cache(maxsize=1)
def _defined_names() -> frozenset[str]:
    """Every function, class, method and module-level name defined in the project's Python files."""
    names: set[str] = set()
    for path in _python_files():
        tree = ast.parse(path.read_text())
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
def _code_text() -> str:
    parts = [p.read_text() for p in _python_files()]
    parts += [(ROOT / name).read_text() for name in ("Makefile", "Dockerfile") if (ROOT / name).exists()]
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
