"""Train the embedded model's vision tower + projector (and a LoRA adapter of its language model) on synthetic
scenes. The current recipe, the word grid (training/README.md has the shipped run's full commands):

    python -m training.train_embedded W --layout anchored --out runs/emb   # tower + projector emit the word grid
    python -m training.train_embedded L --layout anchored --out runs/emb   # an adapter answers from the grid
    python -m training.train_embedded J --layout anchored --out runs/emb   # both end to end on rendered scenes
    python -m training.train_embedded export --out runs/emb [--eval-json results.json]

The earlier recipe (runs v1-v5, which stayed near chance):

    python -m training.train_embedded A --steps 300 --out runs/emb      # tower from scratch, aux heads
    python -m training.train_embedded B --steps 100 --out runs/emb      # projector on descriptions
    python -m training.train_embedded C --steps 1200 --out runs/emb     # all QA turns of a scene

Stage A never runs the language model: linear heads on 3x3-pooled patch features predict, from the scene
metadata, each cell's colour/shape/size plus counts and the printed word; the heads are thrown away.
Stages B/C run the frozen SmolLM2 (requires_grad=False) and apply lm_head only where the next token is
supervised, which keeps a 49k-vocab softmax off the ~400 other positions. Every stage checkpoints into
--out (resumable with --resume); data order depends only on --seed and the step index, so a run with
a fixed --steps is reproducible. --minutes is a safety stop that saves and exits early.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from tqdm import tqdm

from prefixkv_core.method_args import add_device_arg
from prefixkv_core.report.provenance import git_commit
from prefixkv_core.models import EMBEDDED_VISION_DIR, load_model
from scenes import SHAPES, SPLITS, all_qa
from scenes.phrasings import casual_qa

from . import data
from .schedule import lr_at
from .trainable import add_lora, load_vision_state, lora_state, patch_features, vision_state

# Disjoint sub-ranges of the train split per stage, so stages do not reuse scenes.
STAGE_BASE = {"A": 0, "B": 400_000, "C": 600_000}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


class AuxHeads(nn.Module):
    """Linear read-outs of the tower's patch features (the LLaVA-selected layer, CLS dropped)."""

    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.colour = nn.Linear(dim, 1 + len(data.COLOUR_IDS))
        self.shape = nn.Linear(dim, 1 + len(SHAPES))
        self.size = nn.Linear(dim, 3)
        g = 9 * dim
        self.counts = nn.Linear(g, len(SHAPES) * 6)
        self.total = nn.Linear(g, 6)
        self.word = nn.Linear(g, 1 + len(data.WORD_IDS))
        self.word_region = nn.Linear(g, 3)

    def forward(self, feats: torch.Tensor) -> dict[str, torch.Tensor]:
        b, n, d = feats.shape
        side = int(math.isqrt(n))
        grid = feats.view(b, side, side, d).permute(0, 3, 1, 2)
        cells = F.adaptive_avg_pool2d(grid, 3).flatten(2).transpose(1, 2)  # [B, 9, D], reading order
        cells = self.norm(cells)
        flat = cells.flatten(1)
        return {
            "colour": self.colour(cells), "shape": self.shape(cells), "size": self.size(cells),
            "counts": self.counts(flat).view(b, len(SHAPES), 6), "total": self.total(flat),
            "word": self.word(flat), "word_region": self.word_region(flat),
        }


def aux_loss(pred: dict, tgt: dict) -> tuple[torch.Tensor, dict[str, float]]:
    parts = {}
    for k in ("colour", "shape", "size", "counts"):
        parts[k] = F.cross_entropy(pred[k].flatten(0, -2), tgt[k].flatten())
    for k in ("total", "word", "word_region"):
        parts[k] = F.cross_entropy(pred[k], tgt[k])
    acc = {
        "acc_colour": (pred["colour"].argmax(-1) == tgt["colour"]).float().mean().item(),
        "acc_shape": (pred["shape"].argmax(-1) == tgt["shape"]).float().mean().item(),
        "acc_total": (pred["total"].argmax(-1) == tgt["total"]).float().mean().item(),
        "acc_word": (pred["word"].argmax(-1) == tgt["word"]).float().mean().item(),
    }
    return sum(parts.values()), {k: v.item() for k, v in parts.items()} | acc


def supervised_logits(model, input_ids, sup, pixel_values, position_ids=None, mask=None):
    """(logits, targets, turn) at the positions that predict supervised tokens only; `mask` [T, T] and
    `position_ids` [T] describe a tree-packed example (see data.tree_example)."""
    kw = {}
    if mask is not None:
        kw = {"attention_mask": mask[None, None], "position_ids": position_ids[None]}
    out = model.model(input_ids=input_ids[None], pixel_values=pixel_values, use_cache=False, **kw)
    pos = torch.nonzero(sup[1:]).squeeze(1)  # hidden state at t predicts token t+1
    logits = model.lm_head(out.last_hidden_state[0, pos])
    return logits, input_ids[pos + 1], sup[pos + 1]


def lm_loss(model, input_ids: torch.Tensor, sup: torch.Tensor, pixel_values: torch.Tensor,
            position_ids=None, mask=None):
    """CE averaged per answer, then over answers (a long description does not outweigh the one-word
    answers); lm_head only at the positions that predict supervised tokens."""
    logits, target, turn = supervised_logits(model, input_ids, sup, pixel_values, position_ids, mask)
    w = 1.0 / torch.bincount(turn)[turn].float()
    loss = (F.cross_entropy(logits.float(), target, reduction="none") * w).sum() / w.sum()
    acc = (logits.argmax(-1) == target).float().mean().item()
    return loss, acc


@torch.no_grad()
def answer_accuracy(model, loaded, seeds: list[int]) -> dict[str, float]:
    """Share of each question type whose answer greedy decoding would give (every answer token is
    the argmax after the correct earlier ones), with the scenes' own test-style questions."""
    from scenes import render_scene

    from .grid_stages import tally_answers

    right: dict[str, list[bool]] = {}
    for seed in seeds:
        scene = render_scene(seed, data.RENDER_SIZE)
        ids, pos, mask, sup = data.tree_example(loaded, [(qa.question, qa.answer) for qa in scene.qa])
        logits, target, turn = supervised_logits(model, ids, sup, data.pixels(loaded, [scene.image]), pos, mask)
        tally_answers(right, scene.qa, logits.argmax(-1) == target, turn)
    return {t: sum(v) / len(v) for t, v in right.items()}


def train_stage(args) -> None:
    stage = args.stage
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    loaded = load_model("embedded-base", device="cpu", dtype="float32")
    model = loaded.model
    model.train()  # no dropout in CLIP/Llama configs here; train() only matters for consistency
    for p in model.parameters():
        p.requires_grad_(False)

    init = Path(args.init) if args.init else None
    if init is None:  # continue from the previous stage's weights when present
        prev = {"A": None, "B": "vision_A.pt", "C": "vision_B.pt"}[stage]
        for cand in ([prev, "vision_A.pt"] if prev else []):
            if cand and (out / cand).is_file():
                init = out / cand
                break
    if init is not None:
        load_vision_state(model, torch.load(init))
        log(f"init vision/projector from {init}")

    tower = model.model.vision_tower
    proj = model.model.multi_modal_projector
    groups = []
    heads = None
    lora = None
    if stage == "C" and args.lora_rank > 0:  # adapters on the frozen language model's linear layers
        lora = add_lora(model, args.lora_rank)
        if args.init_lora:
            from peft import set_peft_model_state_dict
            from safetensors.torch import load_file
            set_peft_model_state_dict(lora, load_file(args.init_lora))
    if stage == "A":
        heads = AuxHeads(tower.config.hidden_size)
        for p in tower.parameters():
            p.requires_grad_(True)
        groups = [{"params": list(tower.parameters()) + list(heads.parameters()), "lr": args.lr}]
    else:
        for p in proj.parameters():
            p.requires_grad_(True)
        groups = [{"params": list(proj.parameters()), "lr": args.lr}]
        if stage == "C" and args.tower_lr > 0:
            for p in tower.parameters():
                p.requires_grad_(True)
            groups.append({"params": list(tower.parameters()), "lr": args.tower_lr})
        if lora is not None:
            groups.append({"params": [p for p in lora.parameters() if p.requires_grad], "lr": args.lora_lr})
    for g in groups:
        g["base_lr"] = g["lr"]
    opt = torch.optim.AdamW(groups, weight_decay=args.wd, betas=(0.9, 0.98))

    ckpt_path = out / f"stage{stage}.ckpt"
    start = 0
    history: list[dict] = []
    if args.resume and ckpt_path.is_file():
        ck = torch.load(ckpt_path, weights_only=False)
        load_vision_state(model, ck["vision"])
        if lora is not None and ck.get("lora"):
            from peft import set_peft_model_state_dict
            set_peft_model_state_dict(lora, ck["lora"])
        if heads is not None and ck.get("heads"):
            heads.load_state_dict(ck["heads"])
        opt.load_state_dict(ck["opt"])
        start, history = ck["step"], ck["history"]
        torch.set_rng_state(ck["rng"])
        log(f"resumed stage {stage} at step {start}")

    def save(step: int, final: bool = False) -> None:
        ck = {"step": step, "vision": vision_state(model), "opt": opt.state_dict(), "history": history,
              "heads": heads.state_dict() if heads is not None else None, "rng": torch.get_rng_state(),
              "args": vars(args), "lora": lora_state(lora) if lora is not None else None}
        torch.save(ck, str(ckpt_path) + ".tmp")
        Path(str(ckpt_path) + ".tmp").replace(ckpt_path)
        torch.save(vision_state(model), out / f"vision_{stage}.pt")
        if lora is not None:
            from safetensors.torch import save_file
            save_file(lora_state(lora), str(out / f"lora_{stage}.safetensors"))
        (out / f"history_{stage}.json").write_text(json.dumps(history))
        if final:
            log(f"saved final stage {stage} at step {step}")

    t0 = time.time()
    last_save = t0
    base = STAGE_BASE[stage] + 10_000 * args.seed
    run_loss, run_acc, n_run = 0.0, 0.0, 0
    bar = tqdm(range(start, args.steps), initial=start, total=args.steps, desc=f"stage {stage}",
               mininterval=20, file=sys.stdout)
    step = start
    for step in bar:
        f = lr_at(step, args.steps, args.warmup)
        for g in opt.param_groups:
            g["lr"] = g["base_lr"] * f
        opt.zero_grad(set_to_none=True)
        if stage == "A":
            seeds = [data.scene_seed(base, step * args.batch + i) for i in range(args.batch)]
            scenes = [data.render(s) for s in seeds]
            pv = data.pixels(loaded, [s.image for s in scenes])
            tgt = {k: torch.stack([data.vision_targets(s)[k] for s in scenes]) for k in data.vision_targets(scenes[0])}
            loss, parts = aux_loss(heads(patch_features(model, pv)), tgt)
            loss.backward()
            acc = parts["acc_colour"]
            rec = {"step": step + 1, "loss": loss.item(), **parts}
        else:
            tot, accs = 0.0, []
            for i in range(args.batch):
                seed = data.scene_seed(base, step * args.batch + i)
                scene = data.render(seed)
                rng = random.Random(seed * 31 + args.seed)
                with_desc = stage == "B" or rng.random() < args.desc_prob
                pv = data.pixels(loaded, [scene.image])
                if stage == "C" and args.tree:  # every question of the scene, one branch each
                    qas = all_qa(scene, rng) + (casual_qa(scene, rng) if args.casual else [])
                    rng.shuffle(qas)
                    branches = [(qa.question, qa.answer) for qa in qas[:args.max_branches]]
                    if with_desc:
                        branches.append((rng.choice(data.DESCRIBE_PROMPTS), scene.description))
                    ids, pos, mask, sup = data.tree_example(loaded, branches)
                    loss, a = lm_loss(model, ids, sup, pv, pos, mask)
                else:
                    turns = data.scene_turns(scene, rng, with_desc, only_description=stage == "B")
                    if args.turns > 0:  # later turns can give earlier answers away; fewer turns = no leak
                        turns = turns[:args.turns]
                    ids, sup = data.conversation(loaded, turns)
                    loss, a = lm_loss(model, ids, sup, pv)
                (loss / args.batch).backward()
                tot += loss.item() / args.batch
                accs.append(a)
            acc = sum(accs) / len(accs)
            rec = {"step": step + 1, "loss": tot, "tok_acc": acc}
        torch.nn.utils.clip_grad_norm_([p for g in groups for p in g["params"]], 1.0)
        opt.step()
        rec["elapsed_s"] = round(time.time() - t0, 1)
        history.append(rec)
        run_loss += rec["loss"]
        run_acc += acc
        n_run += 1
        if (step + 1) % args.log_every == 0:
            extra = "" if stage != "A" else " " + " ".join(
                f"{k}={v:.3f}" for k, v in rec.items() if k.startswith(("acc_", "word", "counts", "total")))
            log(f"stage {stage} step {step + 1}/{args.steps} loss={run_loss / n_run:.4f} acc={run_acc / n_run:.3f} "
                f"lr={opt.param_groups[0]['lr']:.2e} {time.time() - t0:.0f}s{extra}")
            run_loss, run_acc, n_run = 0.0, 0.0, 0
        if stage != "A" and args.eval_every and (step + 1) % args.eval_every == 0:
            ev = answer_accuracy(model, loaded, list(SPLITS["val"][:args.eval_scenes]))
            history[-1]["val"] = ev
            log(f"val answers ({args.eval_scenes} scenes): " + " ".join(f"{k}={v:.2f}" for k, v in ev.items()))
        if time.time() - last_save > args.ckpt_minutes * 60:
            save(step + 1)
            last_save = time.time()
        if args.minutes and time.time() - t0 > args.minutes * 60:
            log(f"time budget of {args.minutes} min reached at step {step + 1}")
            step += 1
            break
    else:
        step = args.steps
    save(step, final=True)


def export(args) -> None:
    """Write assets/embedded_vision/vision.safetensors (fp16) + info.json from a stage's weights."""
    from safetensors.torch import load_file, save_file

    from prefixkv_core.models import EMBEDDED_LORA_FILE

    def save_fp16(tensors: dict[str, torch.Tensor], path: Path) -> None:
        save_file({k: v.to(torch.float16).contiguous() for k, v in tensors.items()}, str(path),
                  metadata={"format": "pt"})

    out = Path(args.out)
    src = Path(args.init) if args.init else next(
        (out / f"vision_{s}.pt" for s in "MJCWBA" if (out / f"vision_{s}.pt").is_file()), None)
    if src is None:
        raise SystemExit(f"no vision_*.pt in {out}")
    state = torch.load(src)
    dest = Path(args.dest) if args.dest else EMBEDDED_VISION_DIR
    dest.mkdir(parents=True, exist_ok=True)
    save_fp16(state, dest / "vision.safetensors")
    # The language-model adapter of the same run (stage C with --lora-rank), fp16 like the vision file;
    # a stale adapter from an earlier export must not be merged into a model trained without it.
    lora_src = Path(args.lora) if args.lora else src.parent / f"lora_{src.stem.split('_')[-1]}.safetensors"
    lora_dest = dest / EMBEDDED_LORA_FILE.name
    lora = load_file(str(lora_src)) if lora_src.is_file() else None
    if lora is not None:
        save_fp16(lora, lora_dest)
    elif lora_dest.is_file():
        lora_dest.unlink()
    hist = {}
    for s in "AWLBCJM":
        h = out / f"history_{s}.json"
        if h.is_file():
            recs = json.loads(h.read_text())
            if recs:
                n = max(1, len(recs) // 20)
                ck = out / f"stage{s}.ckpt"
                a = torch.load(ck, weights_only=False)["args"] if ck.is_file() else {}
                hist[s] = {"steps": recs[-1]["step"], "scenes": recs[-1]["step"] * a.get("batch", 1),
                           "seed": a.get("seed"), "lr": a.get("lr"), "seconds_last_run": recs[-1]["elapsed_s"],
                           "first_loss": sum(r["loss"] for r in recs[:n]) / n,
                           "last_loss": sum(r["loss"] for r in recs[-n:]) / n}
    info = json.loads(Path(args.info_extra).read_text()) if args.info_extra else {}
    info.setdefault("description", "synthetic Pillow scenes of coloured shapes and printed words")
    if hist:
        info["description"] += "; " + ", ".join(
            f"stage {s}: {h['steps']} steps / {h['scenes']} scenes" for s, h in hist.items()) + (
            f", seed {next(iter(hist.values()))['seed']}")
    info["weights_from"] = src.name
    if lora is not None:
        rank = next(v.shape[0] for k, v in lora.items() if ".lora_A." in k)
        info["language_model_adapter"] = {
            "file": lora_dest.name, "kind": "LoRA (peft), merged into the language model at load", "rank": rank,
            "parameters": sum(v.numel() for v in lora.values())}
    info["training"] = {**info.get("training", {}), **hist}  # earlier stages' records from --info-extra kept
    info["script_commit"] = git_commit(short=False)
    if args.eval_json:  # the measured held-out numbers go into info.json and the app banner
        ev = json.loads(Path(args.eval_json).read_text())
        acc, counts = ev.get("accuracy") or {}, ev.get("n") or {}
        info["test_accuracy"] = acc
        info["test_questions"] = counts
        info["test_scenes"] = ev.get("scenes")
        shown = ", ".join(f"{t} {acc[t]:.0%}" for t in ("colour", "shape", "count", "position", "word", "yesno")
                          if t in acc)
        info.setdefault("notes", []).append(
            f"accuracy on {ev.get('scenes')} held-out synthetic test scenes (full cache): {shown}")
    (dest / "info.json").write_text(json.dumps(info, indent=2) + "\n")
    for f in ("vision.safetensors", "info.json", lora_dest.name):  # readable by the app's non-root user
        if (dest / f).is_file():
            (dest / f).chmod(0o644)
    log(f"exported {src} -> {dest}/vision.safetensors ({(dest / 'vision.safetensors').stat().st_size / 1e6:.1f} MB)")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stage", choices=["A", "B", "C", "W", "L", "J", "M", "export", "snapshot"])
    ap.add_argument("--out", default="runs/embedded", help="checkpoint directory")
    ap.add_argument("--init", default=None, help="vision_*.pt to start from (default: previous stage in --out)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=8, help="scenes per step")
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--tower-lr", type=float, default=5e-5, help="stage C: tower learning rate (0 = frozen)")
    ap.add_argument("--wd", type=float, default=0.01)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--desc-prob", type=float, default=0.4, help="stage C: share of scenes with a description turn")
    ap.add_argument("--turns", type=int, default=0,
                    help="stage C: QA turns per conversation (0 = all; 1 = single-turn, no answer leaks between turns)")
    ap.add_argument("--tree", action="store_true",
                    help="stage C: every question the templates allow about a scene, as branches sharing one image prefix")
    ap.add_argument("--lora-rank", type=int, default=0,
                    help="stage C: LoRA rank on the language model's linear layers (0 = language model fully frozen)")
    ap.add_argument("--lora-lr", type=float, default=5e-4)
    ap.add_argument("--init-lora", default=None, help="stages C/L: adapter safetensors to start from")
    ap.add_argument("--eval-every", type=int, default=0, help="stages B/C: val answer accuracy every N steps")
    ap.add_argument("--eval-scenes", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    add_device_arg(ap, "cpu", help="stages W/L/J: where to train (cpu, cuda; default cpu)")
    ap.add_argument("--workers", type=int, default=0,
                    help="stages W/J: processes that render the next batches ahead (0 = in the training process)")
    ap.add_argument("--grid-weight", type=float, default=0.5,
                    help="stage J: weight of stage W's word-grid loss on the image tokens")
    ap.add_argument("--text-weight", type=float, default=1.0,
                    help="stage J: weight of KL(base || adapted) on ordinary text (0 = off)")
    ap.add_argument("--text-tokens", type=int, default=256, help="stage J: tokens per text window")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--minutes", type=float, default=0.0, help="safety stop (0 = none)")
    ap.add_argument("--time-schedule", action="store_true",
                    help="stages W/L/J: the learning-rate cosine spans --minutes of wall time instead of --steps")
    ap.add_argument("--ckpt-minutes", type=float, default=4.0)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--loose-share", type=float, default=0.2,
                    help="stage W: share of looser scenes (any size, anywhere)")
    ap.add_argument("--layout", default="cell", choices=["cell", "anchored"],
                    help="stages W/L: where a cell's phrase sits (training/word_grid.py)")
    ap.add_argument("--fill-weight", type=float, default=0.25, help="stage W: weight of the fill token's patches")
    ap.add_argument("--noise", type=float, default=0.05, help="stage L: std of the noise on the word grid")
    ap.add_argument("--max-branches", type=int, default=28, help="stages L/C: questions per scene at most")
    ap.add_argument("--casual", action="store_true",
                    help="stage C: also ask the scene's facts as people type them (scenes.phrasings.TRAIN)")
    ap.add_argument("--lora", default=None,
                    help="export: adapter safetensors (default: lora_<stage>.safetensors beside the vision file)")
    ap.add_argument("--dest", default=None,
                    help="export: directory (default assets/embedded_vision); snapshot: default training/checkpoints")
    ap.add_argument("--eval-json", default=None, help="export: vision_accuracy JSON to record in info.json")
    ap.add_argument("--info-extra", default=None, help="export: JSON file with description/notes for info.json")
    from .multi_stage import add_args as add_multi_args
    add_multi_args(ap)
    args = ap.parse_args(argv)
    if args.stage == "export":
        export(args)
    elif args.stage == "snapshot":
        from .grid_stages import snapshot
        snapshot(args)
    elif args.stage == "W":
        from .grid_stages import train_words
        train_words(args)
    elif args.stage == "L":
        from .grid_stages import train_reader
        train_reader(args)
    elif args.stage == "J":
        from .joint_stage import train_joint
        train_joint(args)
    elif args.stage == "M":
        from .multi_stage import train_multi
        train_multi(args)
    else:
        train_stage(args)


if __name__ == "__main__":
    main()
