"""Does the model see? Accuracy per question type on held-out synthetic scenes, through the engine.

    python -m benchmarks.vision_accuracy --scenes 100                       # full cache only
    python -m benchmarks.vision_accuracy --scenes 30 --methods full,prefixkv,snapkv --budgets 0.2,0.5
    python -m benchmarks.vision_accuracy --scenes 40 --methods all --budgets 0.05,0.1,0.2,0.3,0.5 \
        --query-agnostic --budget-of-image --checkpoint runs/qa.jsonl       # the table that tells methods apart

Every QA pair of the first --scenes seeds of the TEST split (scenes/, disjoint from the
training seeds) is asked as the first turn of its own session (image + question), greedy decoding, a
few new tokens. An answer is correct when its normalised text (lowercase, punctuation dropped) equals
the reference or starts with it as whole words. --describe N also asks N scenes for a description and
reports which share of their objects ("red circle") it names. Writes <out>.json and <out>.md, plus
<out>.html/.png (accuracy vs budget per method) when budgets are given. A method without a budget (its
policy's `uses_budget` is false: Full, the reference, keeps everything; ZipVL sets its own share by τ) is
asked once per question and reported at budget 1 (full@1, zipvl@1). --equal-memory holds the
prompt-only methods at r·N_t while decoding (the engine's "equal_memory" budget mode). --query-agnostic
compresses the image before the question is fed: with the question in view, the KV-cache methods keep the
one-word answers at every budget because the first answer token comes from the full prefill; asked after the
image was compressed, they differ. Each budget then gets a line naming the methods whose accuracy is not above
the control's (--control, Random by default), and those above it by no more than chance gives (a one-sided paired
sign test over the same questions, p >= 0.05). --control-seeds N asks the controls that draw at random (Random,
Random drop) with N seeds instead: chance is then their spread over the draws, and each method is tested against
the control of its own kind (the KV-cache methods against Random, the image-token reductions against Random
drop) with a one-sided z-test against the control's per-question rates (benchmarks/chance.py). Every answer
records the share of Full's KV bytes the method held (measured); the tables show it beside r, the figure puts
each method at it, and a table compares the methods at equal real memory (interpolated). --checkpoint appends every scene and budget's answers to a JSON-lines
file as they finish and skips those already there, so a long run can stop and resume.

Image-token reductions (FastV, VisionZip) read the budget r as a share of the prompt's cache by default
(`budget_of=cache`); the share of the image tokens they actually keep (`image_kept_share`, their R) is
recorded per answer and shown beside r in the tables. --budget-of-image also runs every method with a
`budget_of` knob with `budget_of=image` (r = the share of image tokens kept, the papers' convention), as rows
of their own ("fastv[image]"). --knob METHOD.KNOB=VALUE sets a method's knob (e.g. fastv.rank=random).

--controls N adds two checks with the full cache: the same colour and shape questions over a blank grey
image (a model that reads the image stays at chance there), and N freeform images (scenes.freeform: one
turned shape of any size, anywhere, on a background colour outside the generator's palette) asked for
the shape's colour in phrasings the model was never trained on (scenes.phrasings.HELD_OUT).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import defaultdict
from pathlib import Path

from tqdm import tqdm

from benchmarks import accuracy_leaderboard, chance
from prefixkv_core import Engine, GenerationSettings
from prefixkv_core.method_args import add_model_args
from prefixkv_core.models import load_model
from prefixkv_core.policies import REGISTRY, knob_fields, parse_knobs, resolve_methods, role_method, split_draw
from scenes import QTYPES, render_scene, split_seeds
from scenes.freeform import render_freeform
from prefixkv_core.report.metrics import rouge_l
from scenes.grading import is_correct, normalise
from scenes.phrasings import HELD_OUT

DESCRIBE_PROMPT = "Describe the image."
NO_BUDGET = 1.0  # the budget a method without one is reported at: whatever r is, it keeps what it keeps
IMAGE_SUFFIX = "[image]"  # a method run with budget_of=image, in the tables (--budget-of-image)


def has_budget_of(method: str) -> bool:
    """Whether the method reads its budget as a share of the cache or of the image tokens (a `budget_of` knob)."""
    return any(name == "budget_of" for name, _, _ in knob_fields(REGISTRY[method]))


def uses_budget(method: str) -> bool:
    return REGISTRY[method.removesuffix(IMAGE_SUFFIX)].uses_budget


def reported_budget(method: str, budget: float) -> float:
    return budget if uses_budget(method) else NO_BUDGET


def named_share(description: str, scene) -> float:
    """Share of the scene's objects named as "<colour> <shape>" in the description."""
    text = normalise(description)
    return sum(f"{o.colour} {o.shape}" in text for o in scene.objects) / len(scene.objects)


def ask(engine: Engine, image, prompt: str, methods: list[str], budget: float, max_new: int,
        budget_mode: str = "published", knobs: dict | None = None, query_agnostic: bool = False) -> dict[str, str]:
    return {m: text for m, (text, *_) in ask_with_share(engine, image, prompt, methods, budget, max_new, budget_mode,
                                                        knobs, query_agnostic).items()}


def ask_with_share(engine: Engine, image, prompt: str, methods: list[str], budget: float, max_new: int,
                   budget_mode: str = "published", knobs: dict | None = None, query_agnostic: bool = False,
                   seed: int = 0, draws: int = 1) -> dict[str, tuple[str, float | None, float | None]]:
    """Each row's answer, the share of the image tokens it kept (`image_kept_share`, reported by the
    image-token reductions; None for the others) and the share of Full's KV bytes its cache held at the end of
    the answer (measured from the tensors). `query_agnostic`: the image is compressed before the question is fed
    (the engine's query-agnostic mode). `seed`: the comparison's seed (the controls' draw). `draws`: the controls
    that draw at random answer that many times, as rows "random", "random~1" … (`policies.split_draw`)."""
    session = engine.new_session(image, prompt, methods, budget, GenerationSettings(max_new_tokens=max_new, seed=seed),
                                 knobs, budget_mode=budget_mode, query_agnostic=query_agnostic, draws=draws)
    for _ in session.run():
        pass
    return {m: ((r["error"] and f"ERROR {r['error']}") or r["text"], (r.get("extras") or {}).get("image_kept_share"),
                r["kv_bytes"] / r["full_kv_bytes"] if r.get("kv_bytes") and r.get("full_kv_bytes") else None)
            for m, r in session.results().items()}


def sessions(methods: list[str], knobs: dict, image_rows: bool) -> list[tuple[list[str], dict, str]]:
    """The sessions one question is asked in: (methods, knobs, suffix of their names in the tables). The methods as
    given; with `image_rows`, the methods with a `budget_of` knob again with budget_of=image."""
    out = [(methods, knobs, "")]
    again = [m for m in methods if has_budget_of(m)] if image_rows else []
    if again:
        out.append((again, {**knobs, **{m: {**knobs.get(m, {}), "budget_of": "image"} for m in again}}, IMAGE_SUFFIX))
    return out


def evaluate(engine: Engine, seeds: list[int], methods: list[str], budgets: list[float], max_new: int,
             describe: int, split: str, budget_mode: str = "published", knobs: dict | None = None,
             image_rows: bool = False, query_agnostic: bool = False, checkpoint: Path | None = None,
             control_seeds: int = 1, shard: tuple[int, int] = (0, 1)) -> dict:
    """Every question of every scene at every budget. `checkpoint`: a JSON-lines file that gets one line per scene
    and budget as it finishes; the (scene, budget) pairs already in it are not asked again (a long run resumes),
    and a run with more methods asks only the methods its lines lack (the rows already there are kept).
    `control_seeds`: the controls that draw at random are asked with draws 0 … N-1 (a record's `draw`).
    `shard` (i, n): only the scenes whose index is i modulo n are asked (n processes share a run)."""
    done = read_checkpoint(checkpoint)
    records, descriptions = [], []
    for line in done.values():
        records += line["records"]
        descriptions += line["descriptions"]
    reference = role_method("reference")
    # A method without a budget answers alike at every budget: ask it once, with the first budget.
    runs = [(budget, ms) for j, budget in enumerate(budgets)
            if (ms := [m for m in methods if uses_budget(m) or j == 0])]
    bar = tqdm(total=len(seeds) * len(runs), desc="scene x budget", file=sys.stderr, mininterval=5)
    for i, seed in enumerate(seeds):
        scene = render_scene(seed)
        for budget, ms in runs:
            bar.update()
            have = done.get((seed, budget), {}).get("methods", set())
            missing = [m for m in ms if m not in have]  # a line of a run with fewer methods: ask only the others
            if not missing or i % shard[1] != shard[0]:
                continue
            # the reference answers too (the KV shares are measured against it), recorded only when missing
            asked = missing if reference in missing or reference is None else [reference, *missing]
            line = {"seed": seed, "budget": budget, "methods": missing, "records": [], "descriptions": []}
            for qa in scene.qa:
                for group, group_knobs, suffix in sessions(asked, knobs or {}, image_rows):
                    outs = ask_with_share(engine, scene.image, qa.question, group, budget, max_new, budget_mode,
                                          group_knobs, query_agnostic, draws=control_seeds)
                    for row, (text, share, kv) in outs.items():
                        m, draw = split_draw(row)
                        if m not in missing:
                            continue
                        line["records"].append({
                            "split": split, "seed": seed, "question": qa.question, "answer": qa.answer,
                            "qtype": qa.qtype, "method": m + suffix, "budget": reported_budget(m, budget),
                            "draw": draw, "image_kept_share": share, "kv_share": kv, "output": text,
                            "correct": is_correct(text, qa.answer)})
            if i < describe:
                outs = ask(engine, scene.image, DESCRIBE_PROMPT, asked, budget, 96, budget_mode, knobs, query_agnostic)
                for m, text in outs.items():
                    if m not in missing:
                        continue
                    line["descriptions"].append({"seed": seed, "method": m, "budget": reported_budget(m, budget),
                                                 "output": text, "reference": scene.description,
                                                 "named": named_share(text, scene)})
            records += line["records"]
            descriptions += line["descriptions"]
            if checkpoint is not None:
                with checkpoint.open("a") as f:
                    f.write(json.dumps(line) + "\n")
    bar.close()
    return {"records": records, "descriptions": descriptions}


def read_checkpoint(path: Path | None) -> dict[tuple[int, float], dict]:
    """(seed, budget) -> what previous runs wrote for it: their records and descriptions joined, and the methods
    they asked (`methods`; a line written before lines named them: the methods of its records). Several lines may
    hold one pair (a later run asked only the methods the earlier lacked). A torn last line, from a run stopped
    mid-write, is dropped and asked again."""
    done: dict[tuple[int, float], dict] = {}
    if path is None or not path.exists():
        return done
    for raw in path.read_text().splitlines():
        try:
            line = json.loads(raw)
        except json.JSONDecodeError:
            continue
        asked = line.get("methods") or {r["method"].removesuffix(IMAGE_SUFFIX) for r in line["records"]}
        joined = done.setdefault((line["seed"], line["budget"]),
                                 {"seed": line["seed"], "budget": line["budget"], "methods": set(), "records": [],
                                  "descriptions": []})
        joined["methods"] |= set(asked)
        joined["records"] += line["records"]
        joined["descriptions"] += line["descriptions"]
    return done


def not_above_control(summary: dict, control: str) -> dict[float, tuple[float, list[str]]]:
    """Per budget: the control's accuracy (all question types) and the methods with a budget whose accuracy is not
    above it there (a method that does not beat chance at that budget)."""
    by_budget: dict[float, dict[str, float]] = defaultdict(dict)
    for key, per in summary.items():
        m, b = key.rsplit("@", 1)
        if "all" in per and uses_budget(m):
            by_budget[float(b)][m] = per["all"]["accuracy"]
    out = {}
    for budget, accs in sorted(by_budget.items()):
        if control in accs:
            out[budget] = (accs[control], sorted(m for m, a in accs.items() if m != control and a <= accs[control]))
    return out


def sign_test_p(wins: int, losses: int) -> float:
    """One-sided exact sign test: the chance of at least `wins` wins in `wins + losses` fair coin tosses (ties, the
    questions both answer alike, carry no information and are left out)."""
    n = wins + losses
    return sum(math.comb(n, k) for k in range(wins, n + 1)) / 2 ** n if n else 1.0


def paired_against_control(records: list[dict], control: str) -> dict[tuple[str, float], tuple[int, int]]:
    """(method, budget) -> (questions it answers right and the control wrong, the other way round): the same
    questions at the same budget, paired by scene and question."""
    right: dict = defaultdict(dict)
    for r in records:
        right[(r["method"], r["budget"])][(r["seed"], r["question"])] = r["correct"]
    out = {}
    for (m, b), answers in right.items():
        base = right.get((control, b))
        if m == control or base is None or not uses_budget(m):
            continue
        shared = answers.keys() & base.keys()
        out[(m, b)] = (sum(answers[q] and not base[q] for q in shared), sum(base[q] and not answers[q] for q in shared))
    return out


SIGNIFICANCE = 0.05  # a method above the control with a larger sign-test p is within what chance gives


def control_lines(summary: dict, control: str | None, records: list[dict] | None = None) -> str:
    """Per budget, the control's accuracy, the methods not above it and (with `records`) the methods above it by
    less than chance explains: a one-sided paired sign test over the same questions, p >= SIGNIFICANCE."""
    if control is None:
        return ""
    paired = paired_against_control(records, control) if records else {}
    lines = []
    for b, (acc, ms) in not_above_control(summary, control).items():
        line = f"- r = {b:g}: {control} {acc:.1%}; not above it: {', '.join(ms) or 'none'}"
        if records:
            unclear = []
            for (m, mb), (wins, losses) in sorted(paired.items()):
                p = sign_test_p(wins, losses)
                if mb == b and m not in ms and p >= SIGNIFICANCE:
                    unclear.append(f"{m} (+{wins}/-{losses}, p {p:.3f})")
            line += f"; above it but not clearly (p >= {SIGNIFICANCE:g}): {', '.join(unclear) or 'none'}"
        lines.append(line)
    if not lines:
        return ""
    test = (" A method above it is clearly above it when a one-sided paired sign test over the questions both "
            f"answered (+ right where {control} is wrong, - the other way round) gives p < {SIGNIFICANCE:g}."
            if records else "")
    return (f"Methods that do not beat {control} (accuracy over all question types not above its own).{test}\n\n"
            + "\n".join(lines) + "\n")


def _control_for(method: str, present: set[str], fallback: str | None) -> str | None:
    """The control a method's line is read against: the one of its own kind (a `[image]` row's own `[image]` row of
    it when that ran), else `fallback`."""
    base = method.removesuffix(IMAGE_SUFFIX)
    own = REGISTRY[base].control
    for name in ((own + IMAGE_SUFFIX) if own and method.endswith(IMAGE_SUFFIX) else None, own, fallback):
        if name and name in present:
            return name
    return None


def chance_lines(records: list[dict], summary: dict, fallback: str | None = "random") -> str:
    """Per budget: each control's accuracy over its draws (mean, spread), and the methods not clearly above the
    control of their own kind: the one-sided z-test of `chance.beats_chance` (their count right against the
    Poisson-binomial of the control's per-question rates over its draws), p >= SIGNIFICANCE."""
    by_budget: dict[float, set[str]] = defaultdict(set)
    for key in summary:
        m, b = key.rsplit("@", 1)
        if uses_budget(m):
            by_budget[float(b)].add(m)
    lines = []
    for b, present in sorted(by_budget.items()):
        controls = sorted(m for m in present if REGISTRY[m.removesuffix(IMAGE_SUFFIX)].is_control)
        heads = []
        for c in controls:
            per = summary[f"{c}@{b:g}"]
            d = per.get("draws")
            heads.append(f"{c} {per['all']['accuracy']:.1%}" + (
                f" ({d['draws']} draws: sd {d['sd']:.1%}, {d['min']:.1%}-{d['max']:.1%})" if d else ""))
        unclear = []
        for m in sorted(present - set(controls)):
            control = _control_for(m, present, fallback)
            if control is None:
                continue
            answers = {(r["seed"], r["question"]): r["correct"] for r in records
                       if r["method"] == m and r["budget"] == b and not r.get("draw")}
            right, expected, p = chance.beats_chance(answers, chance.chance_rates(records, control, b))
            if p >= SIGNIFICANCE:
                unclear.append(f"{m} vs {control} ({right} right, chance {expected:.1f}, p {p:.2f})")
        lines.append(f"- r = {b:g}: {'; '.join(heads) or 'no control'}; not clearly above chance "
                     f"(p >= {SIGNIFICANCE:g}): {', '.join(unclear) or 'none'}")
    if not lines:
        return ""
    return ("Chance, per budget: each control over its draws, and the methods not clearly above the control of their "
            "own kind (the KV-cache methods against Random, the image-token reductions against Random drop): a "
            "one-sided z-test of a method's number of right answers against the control's per-question rates over "
            "its draws (a Poisson-binomial).\n\n" + "\n".join(lines) + "\n")


def equal_memory_table(summary: dict, shares: tuple[float, ...] = (0.1, 0.2, 0.3, 0.5)) -> str:
    """Accuracy (all question types) at equal real memory: each method's accuracy interpolated at a few shares of
    Full's KV bytes held (measured), within the shares it was measured at."""
    points: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for key, per in summary.items():
        m, _ = key.rsplit("@", 1)
        if uses_budget(m) and per.get("kv_share") is not None and "all" in per:
            points[m].append((per["kv_share"], per["all"]["accuracy"]))
    if not points:
        return ""
    lines = ["| method | measured KV shares | " + " | ".join(f"at {x:.0%}" for x in shares) + " |",
             "|---" * (len(shares) + 2) + "|"]
    for m in sorted(points):
        pts = sorted(points[m])
        cells = [chance.at_equal_memory(pts, x) for x in shares]
        lines.append(f"| {m} | {pts[0][0]:.0%}-{pts[-1][0]:.0%} | "
                     + " | ".join("" if c is None else f"{c:.1%}" for c in cells) + " |")
    return ("At equal real memory (accuracy interpolated at a share of Full's KV bytes held, measured; empty where a "
            "method was not measured around that share):\n\n" + "\n".join(lines) + "\n")


BLANK_GREY = (128, 128, 128)
DEFAULT_OUT = "benchmarks/results/vision_accuracy"


def controls(engine: Engine, seeds: list[int], freeform: int, max_new: int) -> dict:
    """Full-cache answers that must come from the image: colour/shape questions over a blank image (chance
    expected) and colour questions about freeform images in held-out phrasings."""
    from PIL import Image

    blank = Image.new("RGB", (384, 384), BLANK_GREY)
    reference = role_method("reference")  # the full cache
    records = []
    for seed in tqdm(seeds, desc="blank control", file=sys.stderr, mininterval=5):
        for qa in render_scene(seed).qa:
            if qa.qtype in ("colour", "shape"):
                text = ask(engine, blank, qa.question, [reference], 1.0, max_new)[reference]
                records.append({"set": "blank", "seed": seed, "question": qa.question, "answer": qa.answer,
                                "qtype": qa.qtype, "output": text, "correct": is_correct(text, qa.answer)})
    for k, seed in enumerate(tqdm(split_seeds("test", freeform), desc="freeform", file=sys.stderr, mininterval=5)):
        img = render_freeform(seed)
        phrasing = HELD_OUT["colour"][k % len(HELD_OUT["colour"])]
        question = phrasing.format(shape=img.shape)
        text = ask(engine, img.image, question, [reference], 1.0, max_new)[reference]
        records.append({"set": "freeform", "seed": seed, "question": question, "answer": img.colour,
                        "qtype": "colour", "size": round(img.radius, 3), "output": text,
                        "correct": is_correct(text, img.colour)})
    summary: dict = defaultdict(lambda: defaultdict(lambda: [0, 0]))
    for r in records:
        summary[r["set"]][r["qtype"]][0] += r["correct"]
        summary[r["set"]][r["qtype"]][1] += 1
    return {"records": records,
            "summary": {k: {t: {"correct": c, "n": n, "accuracy": c / n} for t, (c, n) in v.items()}
                        for k, v in summary.items()}}


def controls_markdown(ctrl: dict) -> str:
    names = {"blank": f"blank grey image {BLANK_GREY} (chance: colour 1/8, shape 1/6)",
             "freeform": "freeform images, held-out phrasings"}
    lines = ["| control | question type | accuracy |", "|---|---|---|"]
    for k, per in ctrl["summary"].items():
        for t, v in per.items():
            lines.append(f"| {names[k]} | {t} | {v['accuracy']:.1%} (n={v['n']}) |")
    return "\n".join(lines) + "\n"


def loyalty(res: dict, reference: str) -> dict[str, dict]:
    """Agreement with the reference method's (Full's) own outputs, EffiVLM-Bench's loyalty: per method@budget, the
    share of questions answered exactly as the reference answered them (normalised text, its first draw), and the
    mean ROUGE-L F1 of each description against the reference's description of the same scene. Right or wrong
    alike: it covers the long answers that no reference text grades."""
    ref_answers = {(r["seed"], r["question"]): normalise(r["output"]) for r in res["records"]
                   if r["method"] == reference and not r.get("draw")}
    ref_descriptions = {d["seed"]: d["output"] for d in res["descriptions"] if d["method"] == reference}
    same: dict = defaultdict(list)
    by_type: dict = defaultdict(lambda: defaultdict(list))
    for r in res["records"]:
        if r["method"] != reference and not r.get("draw") and (r["seed"], r["question"]) in ref_answers:
            agrees = normalise(r["output"]) == ref_answers[r["seed"], r["question"]]
            same[f"{r['method']}@{r['budget']:g}"].append(agrees)
            if r.get("qtype"):
                by_type[f"{r['method']}@{r['budget']:g}"][r["qtype"]].append(agrees)
    rouge: dict = defaultdict(list)
    for d in res["descriptions"]:
        if d["method"] != reference and d["seed"] in ref_descriptions:
            rouge[f"{d['method']}@{d['budget']:g}"].append(rouge_l(d["output"], ref_descriptions[d["seed"]]))
    out: dict = defaultdict(dict)
    for k, v in same.items():
        out[k]["agrees_with_full"] = {"n": len(v), "accuracy": sum(v) / len(v)}
        out[k]["agrees_with_full_by_type"] = {q: {"n": len(a), "accuracy": sum(a) / len(a)}
                                              for q, a in by_type[k].items()}
    for k, v in rouge.items():
        out[k]["describe_rouge_l_vs_full"] = {"n": len(v), "accuracy": sum(v) / len(v)}
    return out


def summarise(res: dict) -> dict:
    acc: dict = defaultdict(lambda: defaultdict(lambda: [0, 0]))
    for r in res["records"]:
        key = f"{r['method']}@{r['budget']:g}"
        for t in (r["qtype"], "all"):
            acc[key][t][0] += r["correct"]
            acc[key][t][1] += 1
    out = {k: {t: {"correct": c, "n": n, "accuracy": c / n} for t, (c, n) in v.items()} for k, v in acc.items()}
    named: dict = defaultdict(list)
    for d in res["descriptions"]:
        named[f"{d['method']}@{d['budget']:g}"].append(d["named"])
    for k, v in named.items():
        out.setdefault(k, {})["describe_named_objects"] = {"n": len(v), "accuracy": sum(v) / len(v)}
    shares: dict = defaultdict(list)
    for r in res["records"]:
        if r.get("image_kept_share") is not None:
            shares[f"{r['method']}@{r['budget']:g}"].append(r["image_kept_share"])
    for k, v in shares.items():  # the mean over the answers (prompts differ in length by a few tokens)
        out[k]["image_kept_share"] = sum(v) / len(v)
    kv: dict = defaultdict(list)
    for r in res["records"]:
        if r.get("kv_share") is not None:
            kv[f"{r['method']}@{r['budget']:g}"].append(r["kv_share"])
    for k, v in kv.items():  # the share of Full's KV bytes held at the end of the answer, over the answers
        out[k]["kv_share"] = sum(v) / len(v)
    for k, v in loyalty(res, role_method("reference")).items():
        out.setdefault(k, {}).update(v)
    for key in out:  # a control asked with several seeds: its accuracy under each draw, and their spread
        m, b = key.rsplit("@", 1)
        draws = chance.draw_accuracies(res["records"], m, float(b))
        if len(draws) > 1:
            out[key]["draws"] = {**chance.spread(draws), "accuracies": draws}
    return out


def kept_share(per: dict, kv: bool = True) -> str:
    """' (KV 21%, R 33%)': the share of Full's KV bytes the method held (measured; with `kv`) and the share of image
    tokens it kept, where it reports one; a control with several draws adds their spread."""
    notes = []
    if kv and per.get("kv_share") is not None:
        notes.append(f"KV {per['kv_share']:.0%}")
    if per.get("image_kept_share") is not None:
        notes.append(f"R {per['image_kept_share']:.0%}")
    if "draws" in per:
        d = per["draws"]
        notes.append(f"{d['draws']} draws, sd {d['sd']:.1%}")
    return f" ({', '.join(notes)})" if notes else ""


def markdown(summary: dict) -> str:
    cols = [*QTYPES, "all", "describe_named_objects", "agrees_with_full", "describe_rouge_l_vs_full"]
    lines = ["| method@budget | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for key, per in summary.items():
        cells = [f"{per[c]['accuracy']:.1%} (n={per[c]['n']})" if c in per else "-" for c in cols]
        lines.append(f"| {key}{kept_share(per, kv=False)} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def pivot(summary: dict, qtype: str = "all") -> str:
    """Methods x budgets, one question type (default: all types pooled); a method without a budget is one
    column at 1.0, the reference (Full) on the first row. An image-token reduction's cell adds the share of the
    image tokens it kept, R (the mean over its answers), beside the budget r its column is."""
    rows: dict = defaultdict(dict)
    for key, per in summary.items():
        m, b = key.rsplit("@", 1)
        if qtype in per:
            rows[m][float(b)] = f"{per[qtype]['accuracy']:.1%}{kept_share(per)}"
    budgets = sorted({b for r in rows.values() for b in r})
    lines = ["| method | " + " | ".join(f"{b:g}" for b in budgets) + " |", "|---" * (len(budgets) + 1) + "|"]
    reference = role_method("reference")
    for m in sorted(rows, key=lambda m: (m != reference, m)):
        lines.append(f"| {m} | " + " | ".join(rows[m].get(b, "") for b in budgets) + " |")
    return "\n".join(lines) + "\n"


def figure(summary: dict, stem: Path, budget_mode: str = "published", query_agnostic: bool = False,
           control: str | None = None, title: str | None = None) -> str:
    """Accuracy per method in its registered colour against the share of Full's KV bytes it held where every row
    measured it, else against the budget (the reference, Full, a horizontal line; another method without a budget a
    point at its measured share, else a line; budget_of=image rows dashed; the control drawn thick); HTML always,
    PNG when Chromium is there."""
    import plotly.graph_objects as go

    from benchmarks.common import save_figure

    fig = go.Figure()
    by_method: dict = defaultdict(list)
    measured = all(per.get("kv_share") is not None for key, per in summary.items() if uses_budget(key.rsplit("@", 1)[0]))
    held: dict[str, float] = {}  # a method without a budget: the share it measured
    for key, per in summary.items():
        m, b = key.rsplit("@", 1)
        x = per["kv_share"] if measured and uses_budget(m) else float(b)
        by_method[m].append((x, per["all"]["accuracy"]))
        if not uses_budget(m) and per.get("kv_share") is not None:
            held[m] = per["kv_share"]
    full = dict(by_method.pop(role_method("reference"), [])).get(NO_BUDGET)
    budgets = sorted({b for m, pts in by_method.items() if uses_budget(m) for b, _ in pts}) or [NO_BUDGET]
    for m, pts in sorted(by_method.items()):
        if not uses_budget(m):  # one answer for every budget: a point at its share held, else a flat line
            acc = dict(pts)[NO_BUDGET]
            if measured and m in held:
                fig.add_trace(go.Scatter(x=[held[m]], y=[acc], mode="markers", name=f"{m} (no budget)",
                                         marker=dict(symbol="star", size=14, color=REGISTRY[m].colour or None)))
            else:
                fig.add_trace(go.Scatter(x=[budgets[0], budgets[-1]], y=[acc, acc], mode="lines",
                                         name=f"{m} (no budget)", line=dict(dash="dot")))
            continue
        pts.sort()
        base = m.removesuffix(IMAGE_SUFFIX)  # a budget_of=image row: the method's colour, dashed
        colour = REGISTRY[base].colour if base in REGISTRY else None
        line = dict(color=colour, dash="dash" if m.endswith(IMAGE_SUFFIX) else "solid",
                    width=4 if m == control else 2)
        fig.add_trace(go.Scatter(x=[p[0] for p in pts], y=[p[1] for p in pts], mode="lines+markers", name=m,
                                 line=line))
    if full is not None:
        fig.add_hline(y=full, line_dash="dash", annotation_text=f"full cache {full:.0%}")
    mode = ("equal memory" if budget_mode == "equal_memory" else "budgets as published") + (
        ", query-agnostic" if query_agnostic else ", question in view")
    title = title or ("Scene QA accuracy against the memory held (held-out test scenes)" if measured else
                      "Scene QA accuracy against the KV budget (held-out test scenes)")
    fig.update_layout(title=f"{title} [{mode}]",
                      xaxis_title=("the share of Full's KV bytes each method held (measured)" if measured else
                                   "budget r (the share of the cache kept; dashed [image] rows: of the image tokens)"),
                      yaxis_title="accuracy (every question pooled)", yaxis_range=[0, 1], yaxis_tickformat=".0%",
                      width=1000, height=max(560, 120 + 24 * len(fig.data)))  # every legend entry shown
    _, message = save_figure(fig, stem)
    return message


def shard_arg(text: str) -> tuple[int, int]:
    """'I/N' -> (I, N), 0 <= I < N."""
    i, sep, n = text.partition("/")
    try:
        shard = int(i), int(n)
    except ValueError:
        shard = None
    if not sep or shard is None or not 0 <= shard[0] < shard[1]:
        raise argparse.ArgumentTypeError(f"a shard is I/N with 0 <= I < N (e.g. 1/2), got {text!r}")
    return shard


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--split", default="test", choices=["test", "val"])
    ap.add_argument("--scenes", type=int, default=100)
    ap.add_argument("--methods", default=role_method("reference"),
                    help="comma-separated engine methods (default: the reference, Full)")
    ap.add_argument("--budgets", default="", help="comma-separated KV budgets (default: 1.0 only)")
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--describe", type=int, default=0, help="also ask this many scenes for a description")
    ap.add_argument("--equal-memory", action="store_true",
                    help="hold the prompt-only methods at r·N_t while decoding (budget mode equal_memory)")
    ap.add_argument("--controls", type=int, default=0, metavar="N",
                    help="also run the blank-image control and N freeform images (full cache)")
    ap.add_argument("--knob", action="append", default=[], metavar="METHOD.KNOB=VALUE",
                    help="a method's own setting, repeatable, e.g. fastv.rank=random")
    ap.add_argument("--budget-of-image", action="store_true",
                    help="also run the methods with a budget_of knob (FastV, VisionZip) with budget_of=image: r is "
                         "then the share of image tokens kept (rows '<method>[image]')")
    ap.add_argument("--query-agnostic", action="store_true",
                    help="compress the image before the question is fed (the engine's query-agnostic mode)")
    ap.add_argument("--control", default="random",
                    help="the method each budget's line of methods that do not beat it names ('' for none); with "
                         "--control-seeds, the control for a method whose own kind's control did not run")
    ap.add_argument("--control-seeds", type=int, default=1, metavar="N",
                    help="ask the controls that draw at random (Random, Random drop) with seeds 0 … N-1 (chance as a "
                         "distribution: their mean and spread, and each method tested against the control of its "
                         "own kind over the draws); 1: one draw, the methods compared with --control")
    ap.add_argument("--checkpoint", default=None, metavar="PATH",
                    help="append each scene and budget's answers here as they finish, and skip those already in it")
    ap.add_argument("--shard", default="0/1", type=shard_arg, metavar="I/N",
                    help="ask only the scenes whose index is I modulo N: N processes (or machines) share one run, each "
                         "with a --checkpoint of its own; join the files (cat) and run again without --shard for the "
                         "tables of the whole")
    ap.add_argument("--out", default=DEFAULT_OUT)
    ap.add_argument("--leaderboard", default=None, metavar="DIR",
                    help="also write the rows in the leaderboard's layout there (the app's Leaderboard tab reads "
                         "benchmarks/leaderboard/)")
    args = ap.parse_args(argv)

    methods = resolve_methods(args.methods)  # "all", or names separated by commas
    budgets = [float(b) for b in args.budgets.split(",") if b.strip()] or [1.0]
    t0 = time.time()
    loaded = load_model(args.model, device=args.device, dtype=args.dtype)
    engine = Engine(loaded)
    budget_mode = "equal_memory" if args.equal_memory else "published"
    knobs = parse_knobs(args.knob)
    res = evaluate(engine, split_seeds(args.split, args.scenes), methods, budgets, args.max_new_tokens,
                   args.describe, args.split, budget_mode, knobs, args.budget_of_image, args.query_agnostic,
                   Path(args.checkpoint) if args.checkpoint else None, max(1, args.control_seeds), args.shard)
    ctrl = controls(engine, split_seeds(args.split, args.scenes), args.controls, args.max_new_tokens) \
        if args.controls else None
    summary = summarise(res)
    full = summary.get(f"{role_method('reference')}@{NO_BUDGET:g}")
    out = Path(args.out + ("-equal-memory" if budget_mode == "equal_memory" and args.out == DEFAULT_OUT else "")
               + ("-query-agnostic" if args.query_agnostic and args.out == DEFAULT_OUT else ""))
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "model": args.model, "vision_trained": loaded.vision_trained, "split": args.split, "scenes": args.scenes,
        "methods": methods, "budgets": budgets, "max_new_tokens": args.max_new_tokens, "budget_mode": budget_mode,
        "knobs": knobs, "budget_of_image": args.budget_of_image, "query_agnostic": args.query_agnostic,
        "control_seeds": max(1, args.control_seeds),
        "controls": ctrl["summary"] if ctrl else None,
        "accuracy": {t: v["accuracy"] for t, v in full.items() if t in (*QTYPES, "all")} if full else None,
        "n": {t: v["n"] for t, v in full.items() if t in (*QTYPES, "all")} if full else None,
        "summary": summary, "seconds": round(time.time() - t0, 1), **res,
        "control_records": ctrl["records"] if ctrl else [],
    }
    out.with_suffix(".json").write_text(json.dumps(payload, indent=1))
    if args.leaderboard:
        accuracy_leaderboard.write(Path(args.leaderboard), summary, model=args.model, budget_mode=budget_mode,
                                   query_agnostic=args.query_agnostic, **accuracy_leaderboard.ran_on(loaded))
    md = markdown(summary)
    if len(budgets) > 1 or budgets != [1.0]:
        control = args.control if args.control in methods else None
        against = (chance_lines(res["records"], summary, control) if args.control_seeds > 1
                   else control_lines(summary, control, res["records"]))
        equal = equal_memory_table(summary)
        loyal = any("agrees_with_full" in per for per in summary.values())
        md = ("All question types pooled:\n\n" + pivot(summary) + "\n" + against
              + ("\n" + equal if equal else "")
              + ("\nAgreement with Full's own answers (loyalty: the share of questions answered as Full answered "
                 "them, right or wrong):\n\n" + pivot(summary, "agrees_with_full") if loyal else "")
              + ("\nDescriptions against Full's (ROUGE-L F1):\n\n" + pivot(summary, "describe_rouge_l_vs_full")
                 if args.describe and loyal else "")
              + "\nPer question type:\n\n" + md)
        print(figure(summary, out, budget_mode, args.query_agnostic, control), file=sys.stderr)
    if ctrl:
        md += "\nControls (full cache):\n\n" + controls_markdown(ctrl)
    mode = ("equal memory" if budget_mode == "equal_memory" else "budgets as published") + (
        ", query-agnostic" if args.query_agnostic else ", question in view")
    out.with_suffix(".md").write_text(f"Scene QA accuracy, {args.split} split, {args.scenes} scenes, "
                                      f"model {args.model}, {mode}\n\n" + md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
