"""Stages W and L of the embedded model's training (see word_grid.py for the layout they share).

W: tower + projector emit, per image token, the language model's input embedding of its word-grid token.
   Loss = cross-entropy over the grid vocabulary (cosine logits; the phrase tokens weigh more than the fill)
   + the squared error to the target embedding relative to its norm. No language-model forward.
L: a LoRA adapter on the language model answers questions from the ground-truth word grid placed where the
   image tokens go (tree-packed: every question of a scene shares one prefix), with a little noise on the
   grid so that the adapter tolerates a projector that is close but not exact. No vision forward.
Both checkpoint every few minutes into --out and continue with --resume.
"""
from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from prefixkv_core.models import load_model
from scenes import SPLITS, all_qa, render_scene
from scenes.phrasings import casual_qa

from . import data, prefetch, word_grid
from .loose_scenes import render_loose
from .schedule import lr_at
from .trainable import add_lora, load_vision_state, lora_state, patch_features, vision_state

STAGE_BASE = {"W": 700_000, "L": 800_000}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Checkpoint:
    """stage<S>.ckpt (everything needed to resume) + the trained parts a later stage or export reads."""

    def __init__(self, out: Path, stage: str):
        self.out, self.stage = out, stage
        self.path = out / f"stage{stage}.ckpt"

    def load(self):
        return torch.load(self.path, weights_only=False) if self.path.is_file() else None

    def resume(self, args, opt, restore) -> tuple[int, list[dict]]:
        """(first step, history): from the checkpoint when --resume finds one (`restore(ck)` puts the trained
        parts back, the optimiser state is loaded here), else (0, [])."""
        if not args.resume or (ck := self.load()) is None:
            return 0, []
        restore(ck)
        opt.load_state_dict(ck["opt"])
        log(f"resumed stage {self.stage} at step {ck['step']}")
        return ck["step"], ck["history"]

    def save(self, state: dict, parts: dict[str, object]) -> None:
        tmp = self.path.with_suffix(".tmp")
        torch.save(state, tmp)
        tmp.replace(self.path)
        for name, obj in parts.items():
            if name.endswith(".safetensors"):
                from safetensors.torch import save_file
                save_file(obj, str(self.out / name))
            elif name.endswith(".json"):
                (self.out / name).write_text(json.dumps(obj))
            else:
                torch.save(obj, self.out / name)


SNAPSHOT_DIR = Path(__file__).parent / "checkpoints"


def read_state(path: str | Path) -> dict[str, torch.Tensor]:
    """A state dict from a .pt file or a (possibly fp16) .safetensors file, as float32."""
    if str(path).endswith(".safetensors"):
        from safetensors.torch import load_file
        return {k: v.float() for k, v in load_file(str(path)).items()}
    return {k: v.float() for k, v in torch.load(path).items()}


def snapshot(args) -> None:
    """The trained parts of stages W and L in fp16 under training/checkpoints/ (kept in the repository so that
    training continues on a fresh machine: `W --init .../vision_W.safetensors`, `L --init-lora .../lora_L...`)."""
    from safetensors.torch import load_file, save_file

    out = Path(args.out)
    dest = Path(args.dest) if args.dest else SNAPSHOT_DIR
    dest.mkdir(parents=True, exist_ok=True)
    progress = json.loads((dest / "progress.json").read_text()) if (dest / "progress.json").is_file() else {}
    for stage, src, name in (("W", out / "vision_W.pt", "vision_W.safetensors"),
                             ("L", out / "lora_L.safetensors", "lora_L.safetensors"),
                             ("J", out / "vision_J.pt", "vision_J.safetensors"),
                             ("J", out / "lora_J.safetensors", "lora_J.safetensors")):
        if not src.is_file():
            continue
        state = torch.load(src) if src.suffix == ".pt" else load_file(str(src))
        save_file({k: v.to(torch.float16).contiguous() for k, v in state.items()}, str(dest / name))
        hist = json.loads((out / f"history_{stage}.json").read_text())
        evals = [r["val"] for r in hist if "val" in r]
        last = hist[-25:]
        progress[stage] = {"file": name, "steps": hist[-1]["step"],
                           "last_loss": sum(r["loss"] for r in last) / len(last),
                           **({"acc_words": sum(r["acc_words"] for r in last) / len(last)} if stage == "W" else {}),
                           **({("val_on_images" if stage == "J" else "val_from_true_grids"): evals[-1]}
                              if evals else {})}
    (dest / "progress.json").write_text(json.dumps(progress, indent=1) + "\n")
    log(f"snapshot of {', '.join(progress)} -> {dest}")


def training_scene(seed: int, loose_share: float) -> object:
    """The scene of a training seed: a looser one (loose_scenes.py) for a `loose_share` of the seeds."""
    rng = random.Random(seed * 13 + 5)
    return render_loose(seed) if rng.random() < loose_share else render_scene(seed, data.RENDER_SIZE)


# ----------------------------------------------------------------------------------------------- stage W
def grid_classes(tokenizer, vocab: "VocabIndex", scenes, layout: str) -> torch.Tensor:
    """[B, 144] class indices (into the grid vocabulary, 0 = fill) of the scenes' word grids."""
    return vocab.index_of(torch.tensor([word_grid.grid_ids(tokenizer, s, layout) for s in scenes]))


def grid_loss(out: torch.Tensor, cls: torch.Tensor, vocab_emb: torch.Tensor, fill_weight: float):
    """Loss of projected image tokens `out` [B, 144, D] against their grid classes `cls` [B, 144]:
    cosine cross-entropy over the grid vocabulary + squared error relative to the target's norm, the fill
    token's patches weighted by `fill_weight`. Returns (loss, metrics)."""
    out = out.float()
    target = vocab_emb[cls]
    logits = F.normalize(out, dim=-1) @ F.normalize(vocab_emb, dim=-1).T / 0.05
    weight = torch.where(cls == 0, fill_weight, 1.0)
    ce = (F.cross_entropy(logits.flatten(0, 1), cls.flatten(), reduction="none") * weight.flatten()).sum() / weight.sum()
    rel = ((out - target) ** 2).sum(-1) / (target ** 2).sum(-1)
    mse = (rel * weight).sum() / weight.sum()
    pred = logits.argmax(-1)
    words = cls != 0
    acc = {"acc_all": (pred == cls).float().mean().item(),
           "acc_words": (pred[words] == cls[words]).float().mean().item() if words.any() else 1.0,
           "rel_err": rel.mean().item()}
    return ce + mse, acc


class VocabIndex:
    def __init__(self, ids: list[int]):
        self.ids = torch.tensor(ids)
        self.lookup = {t: i for i, t in enumerate(ids)}

    def index_of(self, token_ids: torch.Tensor) -> torch.Tensor:
        return torch.tensor([[self.lookup[t] for t in row] for row in token_ids.tolist()])


def autocast(device: str):
    """bf16 autocast on a GPU (the weights stay float32); nothing on the CPU, where it would only be slower."""
    import contextlib
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.startswith("cuda") else contextlib.nullcontext()


def frozen_model(args):
    """The embedded model with every weight frozen, threads and seed set, the output folder made."""
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if args.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    loaded = load_model("embedded-base", device=args.device, dtype="float32")
    model = loaded.model.train()
    for p in model.parameters():
        p.requires_grad_(False)
    return loaded, model


def periodic_eval(args, model, history: list[dict], measure, what: str):
    """The after-step hook of a stage: every --eval-every steps, `measure(val seeds)` in eval mode, kept in the
    step's history record and logged."""
    def evaluate(step: int) -> None:
        if args.eval_every and (step + 1) % args.eval_every == 0:
            model.eval()
            ev = measure(list(SPLITS["val"][:args.eval_scenes]))
            model.train()
            history[-1]["val"] = ev
            log(f"val answers {what}: " + " ".join(f"{k}={v:.2f}" for k, v in ev.items()))
    return evaluate


def run_steps(args, stage: str, opt, start: int, history: list[dict], step_fn, save, metrics: tuple[str, ...],
              after_step=None) -> None:
    """The loop both stages share: the learning-rate schedule, `step_fn(step) -> record` (it does the backward
    and the optimiser step), a log line every --log-every steps with the mean of `metrics`, `after_step(step)`
    (evaluations), a checkpoint every --ckpt-minutes and at the end, and the --minutes time budget."""
    t0 = last = time.time()
    step = start
    for step in tqdm(range(start, args.steps), initial=start, total=args.steps, desc=f"stage {stage}",
                     mininterval=30, file=sys.stdout):
        if getattr(args, "time_schedule", False) and args.minutes and step >= args.warmup:
            # the cosine runs over the --minutes budget rather than --steps (a machine of unknown speed)
            f = lr_at(args.warmup + int((time.time() - t0) / (args.minutes * 60) * 10_000), 10_000 + args.warmup,
                      args.warmup)
        else:
            f = lr_at(step, args.steps, args.warmup)
        for g in opt.param_groups:
            g["lr"] = g["base_lr"] * f
        history.append({"step": step + 1, **step_fn(step), "elapsed_s": round(time.time() - t0, 1)})
        if (step + 1) % args.log_every == 0:
            recent = history[-args.log_every:]
            mean = {k: sum(r[k] for r in recent) / len(recent) for k in metrics}
            log(f"stage {stage} step {step + 1}/{args.steps} " + " ".join(f"{k}={v:.4f}" for k, v in mean.items())
                + f" {time.time() - t0:.0f}s")
        if after_step is not None:
            after_step(step)
        if time.time() - last > args.ckpt_minutes * 60:
            save(step + 1)
            last = time.time()
        if args.minutes and time.time() - t0 > args.minutes * 60:
            log(f"time budget reached at step {step + 1}")
            step += 1
            break
    else:
        step = args.steps
    save(step)
    log(f"saved stage {stage} at step {step}")


def train_words(args) -> None:
    loaded, model = frozen_model(args)
    if args.init:
        load_vision_state(model, read_state(args.init))
        log(f"init vision/projector from {args.init}")
    params = list(model.model.vision_tower.parameters()) + list(model.model.multi_modal_projector.parameters())
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW([{"params": params, "lr": args.lr, "base_lr": args.lr}], weight_decay=args.wd,
                            betas=(0.9, 0.98))
    vocab = VocabIndex(word_grid.vocabulary(loaded.tokenizer))
    vocab_emb = model.get_input_embeddings().weight[vocab.ids.to(args.device)].detach()

    ckpt = Checkpoint(Path(args.out), "W")
    start, history = ckpt.resume(args, opt, lambda ck: load_vision_state(model, ck["vision"]))

    def save(step):
        state = {k: v.cpu() for k, v in vision_state(model).items()}
        ckpt.save({"step": step, "vision": state, "opt": opt.state_dict(), "history": history, "args": vars(args)},
                  {"vision_W.pt": state, "history_W.json": history})

    base = STAGE_BASE["W"] + 10_000 * args.seed

    def make_batch(step):  # CPU side, in a worker when --workers > 0
        scenes = [training_scene(base + step * args.batch + i, args.loose_share) for i in range(args.batch)]
        return data.pixels(loaded, [s.image for s in scenes]), grid_classes(loaded.tokenizer, vocab, scenes, args.layout)

    feed = prefetch.batches(make_batch, start, args.steps, args.workers)

    def step_fn(step):
        pv, cls = (t.to(args.device, non_blocking=True) for t in next(feed))
        with autocast(args.device):
            out = model.model.multi_modal_projector(patch_features(model, pv))
        loss, acc = grid_loss(out, cls, vocab_emb, args.fill_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        return {"loss": loss.item(), **acc}

    run_steps(args, "W", opt, start, history, step_fn, save, ("loss", "acc_all", "acc_words", "rel_err"))


# ----------------------------------------------------------------------------------------------- stage L
def reader_branches(scene, rng: random.Random, desc_prob: float, max_branches: int) -> list[tuple[str, str]]:
    """The template questions, the same facts asked as people type them, sometimes a description."""
    qa = all_qa(scene, rng) + casual_qa(scene, rng)
    rng.shuffle(qa)
    branches = [(q.question, q.answer) for q in qa[:max_branches]]
    if rng.random() < desc_prob:
        branches.append((rng.choice(data.DESCRIBE_PROMPTS), scene.description))
    return branches


def grid_inputs(model, loaded, ids: torch.Tensor, scene, noise: float, layout: str = "cell") -> torch.Tensor:
    """Input embeddings of a packed example with the image tokens replaced by the scene's word grid."""
    embed = model.get_input_embeddings()
    x = embed(ids)
    img = ids == loaded.image_token_id
    grid = word_grid.grid_embeddings(embed, loaded.tokenizer, scene, layout)
    if noise > 0:
        grid = grid + noise * torch.randn_like(grid)
    x = x.clone()
    x[img] = grid.to(x.dtype)
    return x


def reader_loss(model, loaded, scene, branches, noise: float, layout: str = "cell"):
    ids, pos, mask, sup = (t.to(model.device) for t in data.tree_example(loaded, branches))
    x = grid_inputs(model, loaded, ids, scene, noise, layout)
    hidden = model.model.language_model(inputs_embeds=x[None], attention_mask=mask[None, None],
                                        position_ids=pos[None], use_cache=False).last_hidden_state[0]
    at = torch.nonzero(sup[1:]).squeeze(1)
    logits = model.lm_head(hidden[at])
    target, turn = ids[at + 1], sup[at + 1]
    w = 1.0 / torch.bincount(turn)[turn].float()
    loss = (F.cross_entropy(logits.float(), target, reduction="none") * w).sum() / w.sum()
    return loss, logits, target, turn


def tally_answers(right: dict[str, list[bool]], qas, hit: torch.Tensor, branch: torch.Tensor) -> None:
    """Per question type, whether branch k's answer tokens (its end-of-turn token aside) were all predicted:
    teacher-forced argmax == what greedy decoding gives."""
    for k, qa in enumerate(qas, start=1):
        right.setdefault(qa.qtype, []).append(bool(hit[branch == k][:-1].all()))


@torch.no_grad()
def reader_accuracy(model, loaded, seeds: list[int], layout: str = "cell") -> dict[str, float]:
    """Teacher-forced answers (== greedy) from ground-truth grids on the scenes' own test-style questions."""
    right: dict[str, list[bool]] = {}
    for seed in seeds:
        scene = render_scene(seed, data.RENDER_SIZE)
        branches = [(qa.question, qa.answer) for qa in scene.qa]
        _, logits, target, turn = reader_loss(model, loaded, scene, branches, 0.0, layout)
        tally_answers(right, scene.qa, logits.argmax(-1) == target, turn)
    return {t: sum(v) / len(v) for t, v in right.items()}


def train_reader(args) -> None:
    from peft import set_peft_model_state_dict

    loaded, model = frozen_model(args)
    lora = add_lora(model, args.lora_rank)
    if args.init_lora:
        set_peft_model_state_dict(lora, read_state(args.init_lora))
        log(f"init adapter from {args.init_lora}")
    params = [p for p in lora.parameters() if p.requires_grad]
    opt = torch.optim.AdamW([{"params": params, "lr": args.lora_lr, "base_lr": args.lora_lr}], weight_decay=0.0)
    ckpt = Checkpoint(Path(args.out), "L")
    start, history = ckpt.resume(args, opt, lambda ck: set_peft_model_state_dict(lora, ck["lora"]))

    def save(step):
        state = lora_state(lora)
        ckpt.save({"step": step, "lora": state, "opt": opt.state_dict(), "history": history, "args": vars(args)},
                  {"lora_L.safetensors": state, "history_L.json": history})

    base = STAGE_BASE["L"] + 10_000 * args.seed

    def step_fn(step):
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for i in range(args.batch):
            seed = base + step * args.batch + i
            rng = random.Random(seed * 31 + args.seed)
            scene = render_scene(seed, 64)  # the reader never sees pixels: a small render gives the facts
            branches = reader_branches(scene, rng, args.desc_prob, args.max_branches)
            loss, *_ = reader_loss(model, loaded, scene, branches, args.noise, args.layout)
            (loss / args.batch).backward()
            total += loss.item() / args.batch
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        return {"loss": total}

    evaluate = periodic_eval(args, model, history, lambda seeds: reader_accuracy(model, loaded, seeds, args.layout),
                             "from true grids")
    run_steps(args, "L", opt, start, history, step_fn, save, ("loss",), after_step=evaluate)
