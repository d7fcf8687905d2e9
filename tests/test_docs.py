"""The documentation cannot drift from the code: every registered method has a section in docs/methods.md
that names its stage and schedule and holds its knob table exactly as the registry declares it today, and the README
links both documents.

`python tests/test_docs.py` prints the knob table of every method, ready to paste into docs/methods.md.
"""
from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import pytest

from prefixkv_core.policies import REGISTRY
from prefixkv_core.policies.knobs import knob_fields

ROOT = Path(__file__).resolve().parent.parent
METHODS_DOC = ROOT / "docs" / "methods.md"
ARCHITECTURE_DOC = ROOT / "docs" / "architecture.md"


def format_default(value) -> str:
    """A knob default as the CLI accepts it (METHOD.KNOB=VALUE): true/false, numbers, words; none for None."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (tuple, list)):
        return ",".join(format_default(v) for v in value)
    return str(value)


def knob_table(cls) -> str:
    """The Markdown knob table of one policy class, generated from its knob() declarations."""
    rows = knob_fields(cls)
    if not rows:
        return "Knobs: none."
    lines = ["| knob | default | accepts | what it sets |", "|---|---|---|---|"]
    for name, default, info in rows:
        accepts = "true or false" if isinstance(default, bool) and info.choices is None else info.accepted()
        if not info.editable:
            accepts += " (set by code, not offered in the app)"
        cells = [f"`{name}`", f"`{format_default(default)}`", accepts, info.help]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines)


def heading(cls) -> str:
    return f"## {cls.label} (`{cls.name}`)"


def section(text: str, cls) -> str | None:
    """The text of a method's section: from its heading to the next level-2 heading."""
    start = text.find(heading(cls) + "\n")
    if start < 0:
        return None
    rest = text[start + len(heading(cls)):]
    nxt = re.search(r"^## ", rest, flags=re.M)
    return rest[: nxt.start()] if nxt else rest


@pytest.mark.parametrize("name", list(REGISTRY))
def test_every_method_is_documented_with_its_current_knobs(name):
    cls = REGISTRY[name]
    text = METHODS_DOC.read_text()
    body = section(text, cls)
    assert body is not None, f"docs/methods.md has no section headed {heading(cls)!r}"
    table = knob_table(cls)
    assert table in body, f"the knob table of {name} in docs/methods.md is out of date; it should read:\n{table}"
    assert f"Schedule: **{cls.schedule}**" in body, f"the {name} section should say 'Schedule: **{cls.schedule}**'"
    assert f"Stage: **{cls.stage}**" in body, f"the {name} section should say 'Stage: **{cls.stage}**'"


ARXIV = re.compile(r"https://arxiv\.org/abs/\d{4}\.\d{4,5}")


@pytest.mark.parametrize("name", list(REGISTRY))
def test_every_policy_docstring_names_and_links_its_paper(name):
    """As kvpress's presses do: the class docstring names the paper and links it, the same paper (title and
    arXiv link) as the method's **Paper:** line in docs/methods.md."""
    cls = REGISTRY[name]
    doc = " ".join((vars(cls).get("__doc__") or "").split())  # the class's own (a dataclass makes one up)
    links = ARXIV.findall(doc)
    assert links, f"{cls.__name__}'s docstring should link its paper (https://arxiv.org/abs/...)"
    body = section(METHODS_DOC.read_text(), cls)
    paper = re.search(r"\*\*Paper:\*\*[^\[]*\[([^\]]+)\]\((https://arxiv\.org/abs/[^)]+)\)", body or "")
    assert paper, f"the {name} section of docs/methods.md has no **Paper:** link"
    title, link = " ".join(paper.group(1).split()), paper.group(2)
    assert link in links, f"{cls.__name__}'s docstring links {links}, docs/methods.md {link}"
    assert title in doc, f"{cls.__name__}'s docstring should name its paper: {title!r}"


def test_every_documented_method_is_registered():
    documented = re.findall(r"^## .+ \(`([a-z0-9_]+)`\)$", METHODS_DOC.read_text(), flags=re.M)
    assert sorted(documented) == sorted(REGISTRY), "docs/methods.md documents a method the registry lacks"


def test_readme_links_the_docs_and_nothing_outside_the_repository():
    readme = (ROOT / "README.md").read_text()
    assert "docs/methods.md" in readme and "docs/architecture.md" in readme
    assert ARCHITECTURE_DOC.is_file()
    for doc in (readme, METHODS_DOC.read_text(), ARCHITECTURE_DOC.read_text()):
        assert "../shared" not in doc


def test_relative_links_in_the_docs_resolve():
    for doc in (METHODS_DOC, ARCHITECTURE_DOC):
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
            if "://" in target:
                continue
            assert (doc.parent / target).exists(), f"{doc.name} links to {target}, which does not exist"


def example_code() -> str:
    """The Python block of 'How to add a method' in docs/architecture.md."""
    text = ARCHITECTURE_DOC.read_text()
    part = text[text.index("## How to add a method"):]
    match = re.search(r"```python\n(.*?)```", part, flags=re.S)
    assert match, "docs/architecture.md: 'How to add a method' has no python block"
    return match.group(1)


def test_the_documented_example_method_runs_everywhere(tiny_llama, noise_image):
    from prefixkv_core import Engine, GenerationSettings
    from prefixkv_core.policies import METHODS, describe, make_policy, parse_knobs, unregister

    module = types.ModuleType("docs_example")  # the example runs as a module of its own, as user code would
    sys.modules[module.__name__] = module
    try:
        exec(compile(example_code(), "docs/architecture.md", "exec", dont_inherit=True), module.__dict__)
        cls = module.StridedPolicy
        assert "strided" in METHODS and REGISTRY["strided"] is cls
        described = {d["name"]: d for d in describe()}["strided"]
        assert described["knobs"] == {"offset": 0} and described["schedule"] == "prompt only"
        assert make_policy("strided", 0.4, **parse_knobs(["strided.offset=3"])["strided"]).offset == 3

        budget = 0.4
        session = Engine(tiny_llama).new_session(noise_image, "what is in the picture", ["full", "strided"], budget,
                                                 GenerationSettings(max_new_tokens=4))
        events = [e for e in session.run() if getattr(e, "method", None) == "strided"]
        assert not [e.error for e in events if e.error]
        n = session.prefill.prompt_tokens
        start = next(e for e in events if e.kind == "start")
        assert start.kept_per_layer == [round(budget * n)] * tiny_llama.num_layers
        state = session.states["strided"]
        for layer in state.cache.layers:  # the protected tokens survive; generated tokens are all kept
            pos = layer.positions[0, 0]
            assert int(pos[0]) == 0 and bool((pos == n - 1).any()) and int(pos[-1]) == state.true_len - 1
            assert all(p % 2 == 0 for p in pos.tolist() if p < n - 1)  # r = 0.4: every other prompt token
        assert session.results()["strided"]["status"] == "done"
    finally:
        unregister("strided")
        sys.modules.pop(module.__name__, None)
    assert "strided" not in METHODS


if __name__ == "__main__":
    for cls in REGISTRY.values():
        print(heading(cls), f"\n\nSchedule: **{cls.schedule}**\n\n{knob_table(cls)}\n")
