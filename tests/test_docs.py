"""The documentation cannot drift from the code: every registered method has a section in docs/methods.md
that names its stage and schedule and holds its knob table exactly as the registry declares it today; the README
links every page under docs/ that holds what it does not say itself, and every relative link and #section of the
docs resolves.

`python tests/test_docs.py [METHOD ...]` prints the section every method (or the ones named) needs there, ready
to paste into docs/methods.md.
"""
from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import pytest

if __name__ == "__main__":  # run as a script from anywhere: the checkout's package
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from prefixkv_core.policies import REGISTRY  # noqa: E402
from prefixkv_core.policies.knobs import knob_fields  # noqa: E402

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


# the pages the README sends a reader to: what used to be in the README lives there
DOC_PAGES = ["methods.md", "method-internals.md", "architecture.md", "app.md", "engine.md", "evaluation.md",
             "deploying.md", "security.md", "testing.md"]
ALL_DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md",
            *sorted((ROOT / "benchmarks" / "reports").glob("*.md")), ROOT / "training" / "README.md"]


def test_readme_links_the_docs_and_nothing_outside_the_repository():
    readme = (ROOT / "README.md").read_text()
    for page in DOC_PAGES:
        assert f"](docs/{page})" in readme, f"the README should link docs/{page}"
        assert (ROOT / "docs" / page).is_file()
    for doc in ALL_DOCS:
        assert "../shared" not in doc.read_text(), f"{doc.name} points outside the repository"


# the first pages stay short as the figures grow: the README sends a reader on to docs/, and benchmarks/README.md
# holds each benchmark's latest table, its earlier sittings and long tables in dated reports under benchmarks/reports/
PAGE_LINES = {"README.md": 200, "benchmarks/README.md": 500}


@pytest.mark.parametrize("page, limit", PAGE_LINES.items(), ids=list(PAGE_LINES))
def test_the_first_pages_stay_short(page, limit):
    lines = len((ROOT / page).read_text().splitlines())
    assert lines <= limit, (f"{page} is {lines} lines, more than {limit}: move earlier sittings and long tables to a "
                            "dated report under benchmarks/reports/ (or a page under docs/) and link it from the section")


SECTION_LINES = 90  # a method's section: its rule, knobs and cost; the measured tables live in the reports


@pytest.mark.parametrize("name", list(REGISTRY))
def test_a_method_s_section_stays_short(name):
    body = section(METHODS_DOC.read_text(), REGISTRY[name]) or ""
    lines = len(body.splitlines())
    assert lines <= SECTION_LINES, (f"the {name} section of docs/methods.md is {lines} lines, more than {SECTION_LINES}: "
                                    "move its measured tables to the dated report they come from and link it")


def anchors(path: Path) -> set[str]:
    """The anchors GitHub gives a Markdown file's headings (lower case, punctuation dropped, spaces to hyphens)."""
    found = set()
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    for title in re.findall(r"^#{1,6} +(.+?) *$", text, flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
        found.add(slug)
    return found


@pytest.mark.parametrize("doc", ALL_DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_in_the_docs_resolve(doc):
    """Every relative link of the README, docs/, the benchmarks' and training's READMEs and the benchmark reports
    reaches a file, and a #section of a Markdown file reaches one of its headings (a moved section fails here)."""
    for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)", doc.read_text()):
        if "://" in target or target.startswith("mailto:"):
            continue
        path = (doc.parent / target) if target else doc
        assert path.exists(), f"{doc.name} links to {target}, which does not exist"
        if anchor and path.suffix == ".md":
            assert anchor in anchors(path), f"{doc.name} links to {target}#{anchor}, a heading {target} lacks"


def test_the_engine_page_lists_the_whole_public_api():
    """docs/engine.md's "The Python API" names every name `prefixkv_core` exports (its __all__)."""
    import prefixkv_core

    text = (ROOT / "docs" / "engine.md").read_text()
    assert "## The Python API" in text, "docs/engine.md should have a 'The Python API' section"
    api = text[text.index("## The Python API"):]
    api = api[: api.index("\n## ", 1)] if "\n## " in api[1:] else api
    missing = [name for name in prefixkv_core.__all__ if f"`{name}`" not in api]
    assert not missing, f"docs/engine.md's Python API section does not name {missing}"


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
        cls = module.KeyNormPolicy
        assert "keynorm" in METHODS and REGISTRY["keynorm"] is cls
        described = {d["name"]: d for d in describe()}["keynorm"]
        assert described["knobs"]["window"] == 1 and described["schedule"] == "prompt only"
        assert make_policy("keynorm", 0.4, **parse_knobs(["keynorm.window=3"])["keynorm"]).window == 3

        budget = 0.4
        session = Engine(tiny_llama).new_session(noise_image, "what is in the picture", ["full", "keynorm"], budget,
                                                 GenerationSettings(max_new_tokens=4))
        events = [e for e in session.run() if getattr(e, "method", None) == "keynorm"]
        assert not [e.error for e in events if e.error]
        n = session.prefill.prompt_tokens
        start = next(e for e in events if e.kind == "start")
        assert start.kept_per_layer == [round(budget * n)] * tiny_llama.num_layers
        full = session.states["full"].cache
        state = session.states["keynorm"]
        for full_layer, layer in zip(full.layers, state.cache.layers):
            norms = full_layer.keys[0, :, :n].float().norm(dim=-1)  # [Hkv, N], the prompt's keys
            for head in range(norms.shape[0]):  # naive: the sink, the last token, then the smallest norms
                rest = sorted(range(1, n - 1), key=lambda j: (float(norms[head, j]), j))
                expect = sorted([0, n - 1] + rest[: round(budget * n) - 2])
                kept = [p for p in layer.positions[0, head].tolist() if p < n]
                assert kept == expect
            assert int(layer.positions[0, 0, -1]) == state.true_len - 1  # generated tokens are all kept
        assert session.results()["keynorm"]["status"] == "done"
    finally:
        unregister("keynorm")
        sys.modules.pop(module.__name__, None)
    assert "keynorm" not in METHODS


def method_section(cls) -> str:
    """What docs/methods.md must hold for a method, as the tests above check it: heading, stage and schedule,
    knob table and the paper its docstring names (title and link), ready to paste and fill in."""
    doc = " ".join((vars(cls).get("__doc__") or "").split())
    title = re.search(r'"([^"]+)"', doc)
    link = ARXIV.search(doc)
    paper = (f"**Paper:** [{title.group(1) if title else 'TITLE'}]({link.group(0) if link else 'https://arxiv.org/abs/…'})"
             if title or link else "**Paper:** [TITLE](https://arxiv.org/abs/…) (name and link it in the class docstring)")
    return (f"{heading(cls)}\n\nStage: **{cls.stage}** · Schedule: **{cls.schedule}**\n\n{knob_table(cls)}\n\n"
            f"{paper}\n\n**Rule.** …\n\n**Defaults.** …\n\n**Departures.** …\n")


if __name__ == "__main__":  # python tests/test_docs.py [METHOD ...]: the sections docs/methods.md needs
    for name in sys.argv[1:] or list(REGISTRY):
        print(method_section(REGISTRY[name]))
