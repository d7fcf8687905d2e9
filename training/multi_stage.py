"""Stage M of the embedded model's training: several images and a clip's frames in one first turn.

The tower and projector already put each image's word grid where its image tokens go (stages W and J), and they
stay frozen here at the weights given by --init (the shipped ones); only the LoRA adapter (from --init-lora)
learns to answer questions that need several images at once:

- multi-image sets (scenes/multi.py, train split, 2-6 scenes): the set's own question, asked as the lmms task
  asks it (`MultiSample.prompt`: how the images are numbered, then the question), plus more questions of every
  subtask that hold for the same set (`multi_branches`);
- clips (scenes/video.py, train split): the 16-frame clip sampled to --frames frames with the engine's
  `sample_indices` (sometimes fewer frames, sometimes through an mp4 and back as the engine reads a file), asked
  its own question and the others its movers allow (`video_branches`);
- single images (the scenes and questions of stage J), so that one-image answers stay as they are.

Each example is tree-packed as in stage J: the images' tokens are one shared prefix, every question a branch that
sees the prefix and itself only (`tree_example`), built with the engine's `format_prompt(loaded, prompt,
with_image=n)` so that a branch is exactly the engine's prompt. The image features come from the frozen tower
once per example (no gradient). Loss = the answers' cross-entropy (each answer weighs the same) summed over the
step's examples + --text-weight x KL(base || adapted) on a window of ordinary text (stage J's term).

Every --eval-every steps the adapter is merged into a fresh copy of the model (as the loader merges the shipped
one) and asked --eval-samples validation samples per subtask through the engine (Full, greedy, 8 new tokens).
Checkpoints every few minutes into --out (vision_M.pt: the frozen vision weights, lora_M.safetensors,
stageM.ckpt; --resume).
"""
from __future__ import annotations

import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from prefixkv_core.models import format_prompt
from prefixkv_core.session.video_input import sample_indices
from scenes import render_scene
from scenes.multi import MULTI_SUBTASKS, multi_prompt, multi_sample, multi_seeds
from scenes.splits import SPLITS
from scenes.video import VIDEO_SUBTASKS, video_sample, video_seeds
from scenes.vocabulary import PLURALS, SHAPES, article

from . import data, text_corpus
from .grid_stages import Checkpoint, frozen_model, log, read_state, run_steps, training_scene
from .joint_stage import scene_branches, text_kl
from .trainable import add_lora, load_vision_state, lora_state, patch_features, vision_state

# Train-split seed ranges of stage M's samples (stage J's scenes start at 900,000)
MULTI_BASE, VIDEO_BASE, SINGLE_BASE = 500_000, 600_000, 960_000
CLIP_FRAMES = 16  # the lmms task's clips


# ----------------------------------------------------------------------------------------------- sequences
def _ids(loaded, text: str) -> list[int]:
    return loaded.tokenizer(text, add_special_tokens=False)["input_ids"]


def turn_ids(loaded, prompt: str, n_images: int) -> list[int]:
    """The engine's first-turn ids for `n_images` images before `prompt` (`format_prompt(..., with_image=n)`),
    each `<image>` expanded to the image tokens as the processor expands it."""
    out: list[int] = []
    for t in _ids(loaded, format_prompt(loaded, prompt, with_image=n_images)):
        out.extend([t] * loaded.image_seq_length if t == loaded.image_token_id else [t])
    return out


def tree_example(loaded, n_images: int, branches: list[tuple[str, str]]):
    """`n_images` images shared by single-turn question branches, as one sequence (data.tree_example for several
    images, and a longer shared prefix): every branch sees the tokens all the branches' prompts begin with (the
    template, the images, a numbering note they share) and its own rest of the prompt and answer, never another
    branch, at the positions its own prompt gives it; so a branch computes exactly what the engine computes for
    its prompt alone. Returns (input_ids [T], position_ids [T], mask [T, T] bool (True = may attend),
    sup [T] long: k >= 1 marks branch k's answer tokens and its end-of-turn token)."""
    eos = loaded.tokenizer.eos_token_id
    prompts = [turn_ids(loaded, q, n_images) for q, _ in branches]
    last_image = max(i for i, t in enumerate(prompts[0]) if t == loaded.image_token_id)
    cut = min(len(p) for p in prompts) - 1  # every branch keeps at least its prompt's last token
    for p in prompts[1:]:
        cut = next((i for i, (a, b) in enumerate(zip(prompts[0][:cut], p)) if a != b), cut)
    if cut <= last_image:
        raise ValueError("the branches' prompts differ before their last image token; cannot share the images")
    ids, pos, branch, sup = list(prompts[0][:cut]), list(range(cut)), [0] * cut, [0] * cut
    for k, ((_, a), full) in enumerate(zip(branches, prompts), start=1):
        tail, ans = full[cut:], _ids(loaded, a) + [eos]
        ids += tail + ans
        pos += list(range(cut, cut + len(tail) + len(ans)))
        branch += [k] * (len(tail) + len(ans))
        sup += [0] * len(tail) + [k] * len(ans)
    b = torch.tensor(branch)
    t = torch.arange(len(ids))
    mask = (t[None, :] <= t[:, None]) & ((b[None, :] == 0) | (b[None, :] == b[:, None]))
    return torch.tensor(ids), torch.tensor(pos), mask, torch.tensor(sup)


# ----------------------------------------------------------------------------------------------- questions
def _pairs(scene) -> set[tuple[str, str]]:
    return {(o.colour, o.shape) for o in scene.objects}


def multi_questions(scenes) -> dict[str, list[tuple[str, str, bool]]]:
    """Every question of each multi-image subtask that has exactly one right answer over `scenes` (in the order
    shown), as (question, answer, hard), in the forms of scenes/multi.py. `hard`: the question needs the image
    number or several images: a `colour_k` shape that another image shows in another colour (the test's
    distractor), a `count` shape that more than one image holds; every `which` and `needle` question."""
    out: dict[str, list[tuple[str, str, bool]]] = {s: [] for s in MULTI_SUBTASKS}
    holders: dict[tuple[str, str], list[int]] = {}
    for k, s in enumerate(scenes):
        for pair in _pairs(s):
            holders.setdefault(pair, []).append(k)
    for (colour, shape), ks in sorted(holders.items()):
        if len(ks) == 1:
            out["which"].append((f"Which image shows {article(colour)} {colour} {shape}?", str(ks[0] + 1), True))
    for k, s in enumerate(scenes):
        for o in s.objects:
            if sum(p.shape == o.shape for p in s.objects) == 1:
                hard = any(p.shape == o.shape and p.colour != o.colour
                           for j, other in enumerate(scenes) if j != k for p in other.objects)
                out["colour_k"].append((f"What colour is the {o.shape} in image {k + 1}?", o.colour, hard))
    worded = [s for s in scenes if s.word]
    if len(worded) == 1:
        out["needle"].append(("Which word is printed in one of the images?", worded[0].word, True))
    for shape in SHAPES:
        per_image = [sum(o.shape == shape for o in s.objects) for s in scenes]
        if 1 <= sum(per_image) <= 9:
            out["count"].append((f"How many {PLURALS[shape]} are there in all the images?", str(sum(per_image)),
                                 sum(c > 0 for c in per_image) > 1))
    return out


def multi_branches(sample, scenes, rng: random.Random, per_subtask: int) -> list[tuple[str, str, str]]:
    """(prompt, answer, subtask): the sample's own question first, then up to `per_subtask` more of each subtask
    that hold for its images (the hard ones first, see `multi_questions`), every prompt with the numbering note
    the lmms task puts before the question."""
    n = len(scenes)
    own = (sample.question, sample.answer)
    out = [(sample.prompt, sample.answer, sample.subtask)]
    for sub, qas in multi_questions(scenes).items():
        qas = [qa for qa in qas if qa[:2] != own]
        rng.shuffle(qas)
        qas.sort(key=lambda qa: not qa[2])  # stable: the hard ones first, each group shuffled
        out += [(multi_prompt(q, n), a, sub) for q, a, _ in qas[:per_subtask]]
    return out


def video_questions(movers) -> dict[str, list[tuple[str, str]]]:
    """Every question of each clip subtask its movers allow, in scenes/video.py's forms."""
    out: dict[str, list[tuple[str, str]]] = {s: [] for s in VIDEO_SUBTASKS}
    for m in movers:
        what = "shape" if len(movers) == 1 else m.shape
        out["colour_seen"].append((f"What colour is the moving {what}?", m.colour))
        out["direction"].append((f"Which way does the {m.colour} {m.shape} move?", m.direction))
    late = [m for m in movers if m.appears > 0]
    if len(late) == 1:
        out["appears_last"].append(("What shape appears last?", late[0].shape))
    return out


def video_branches(sample, rng: random.Random, per_subtask: int) -> list[tuple[str, str, str]]:
    """(question, answer, subtask): the clip's own question first, then up to `per_subtask` more of each subtask."""
    own = (sample.question, sample.answer)
    out = [(sample.question, sample.answer, sample.subtask)]
    for sub, qas in video_questions(sample.movers).items():
        qas = [qa for qa in qas if qa != own]
        rng.shuffle(qas)
        out += [(q, a, sub) for q, a in qas[:per_subtask]]
    return out


def clip_frames(sample, frames: int, via_mp4: bool = False) -> list:
    """The clip's frames as the engine reads them: sampled uniformly (`sample_indices`) from the whole clip; with
    `via_mp4`, from the clip written to an mp4 and decoded again (the lmms task hands the engine a file)."""
    if via_mp4:
        import tempfile

        from prefixkv_core.session.video_input import load_video
        from scenes.video import write_clip

        with tempfile.TemporaryDirectory() as tmp:
            path = write_clip(sample, Path(tmp) / "clip.mp4")
            return list(load_video(str(path), frames).frames)
    return [sample.frames[i] for i in sample_indices(len(sample.frames), frames)]


# ----------------------------------------------------------------------------------------------- examples
def multi_example(seed: int, rng: random.Random, per_subtask: int):
    """(images, branches) of the multi-image training sample `seed` (train split)."""
    sample = multi_sample(seed, images=False)
    scenes = [render_scene(s, data.RENDER_SIZE) for s in sample.scene_seeds]
    return [s.image for s in scenes], multi_branches(sample, scenes, rng, per_subtask)


def video_example(seed: int, rng: random.Random, per_subtask: int, frames: int, frame_choices: tuple[int, ...],
                  vary_share: float, mp4_share: float):
    """(frames, branches) of clip `seed`: --frames frames of the 16-frame clip, or another count of
    `frame_choices` for a `vary_share` of the clips; a `mp4_share` of them through an mp4 and back."""
    n = rng.choice(frame_choices) if frame_choices and rng.random() < vary_share else frames
    sample = video_sample(seed, CLIP_FRAMES)
    return clip_frames(sample, n, rng.random() < mp4_share), video_branches(sample, rng, per_subtask)


def subtask_of_branches(branches) -> list[str]:
    return [b[2] for b in branches]


# ----------------------------------------------------------------------------------------------- the loss
def image_features(model, loaded, images) -> torch.Tensor:
    """[n * 144, D]: what the frozen tower and projector put where the images' tokens go, in order."""
    with torch.no_grad():
        feats = model.model.multi_modal_projector(patch_features(model, data.pixels(loaded, images).to(model.device)))
    return feats.reshape(-1, feats.shape[-1])


def tree_loss(model, loaded, tree, feats: torch.Tensor, index_layer: int = 0, digit_ids: torch.Tensor | None = None):
    """(loss, logits, target, branch, index) over the supervised tokens of one tree whose image tokens carry
    `feats`; each branch's answer weighs the same. With `index_layer` L > 0, `index` is the image-number loss: the
    residual stream after layer L, read through the final norm and the (tied) output embedding as in a logit lens,
    should name each image token's image number among the digit tokens `digit_ids` (image 1 -> "1", ...), so that
    the adapter writes into every image token which image it belongs to, in the words an answer uses; else 0."""
    ids, pos, mask, sup = (t.to(model.device) for t in tree)
    x = model.get_input_embeddings()(ids)
    img = ids == loaded.image_token_id
    if int(img.sum()) != feats.shape[0]:
        raise ValueError(f"{int(img.sum())} image tokens, {feats.shape[0]} image features")
    x = x.masked_scatter(img[:, None], feats.to(x.dtype))
    lm = model.model.language_model
    out = lm(inputs_embeds=x[None], attention_mask=mask[None, None], position_ids=pos[None], use_cache=False,
             output_hidden_states=index_layer > 0)
    hidden = out.last_hidden_state[0]
    at = torch.nonzero(sup[1:]).squeeze(1)
    logits = model.lm_head(hidden[at]).float()
    target, branch = ids[at + 1], sup[at + 1]
    w = 1.0 / torch.bincount(branch)[branch].float()
    loss = (F.cross_entropy(logits, target, reduction="none") * w).sum() / w.sum()
    index = torch.zeros((), device=model.device)
    n_images = feats.shape[0] // loaded.image_seq_length
    if index_layer > 0 and 1 < n_images <= len(digit_ids):
        h = lm.norm(out.hidden_states[index_layer][0][img]).float()
        lens = h @ model.lm_head.weight[digit_ids[:n_images]].float().T
        which = torch.arange(n_images, device=model.device).repeat_interleave(loaded.image_seq_length)
        index = F.cross_entropy(lens, which)
    return loss, logits, target, branch, index


def digit_token_ids(loaded, n: int = 9) -> torch.Tensor:
    """The ids of the answers "1" .. "n" (one token each)."""
    ids = [_ids(loaded, str(k)) for k in range(1, n + 1)]
    if any(len(t) != 1 for t in ids):
        raise ValueError("the tokenizer splits a single digit")
    return torch.tensor([t[0] for t in ids])


def branch_hits(logits, target, branch, names: list[str]) -> dict[str, list[bool]]:
    """Per subtask, whether each branch's answer tokens (its end-of-turn token aside) were all predicted."""
    hit = logits.argmax(-1) == target
    out: dict[str, list[bool]] = {}
    for k, name in enumerate(names, start=1):
        out.setdefault(name, []).append(bool(hit[branch == k][:-1].all()))
    return out


# ----------------------------------------------------------------------------------------------- evaluation
def merged_engine(vision: dict[str, torch.Tensor], adapter: dict[str, torch.Tensor]):
    """An Engine over the embedded model with these vision weights and this adapter merged in, built as the
    loader builds the shipped model (fp16 weights, float32 compute, the adapter merged into the base weights)."""
    import tempfile

    from safetensors.torch import save_file

    from prefixkv_core import Engine
    from prefixkv_core.models import load_model
    from prefixkv_core.models.embedded import merge_embedded_lora

    loaded = load_model("embedded-base", device="cpu", dtype="float32")
    load_vision_state(loaded.model, {k: v.half().float() for k, v in vision.items()})
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "lora.safetensors"
        save_file({k: v.half().contiguous() for k, v in adapter.items()}, str(path))
        merge_embedded_lora(loaded.model, path)
    loaded.model.eval()
    return Engine(loaded)


def engine_answer(engine, images, prompt: str, max_new: int = 8) -> str:
    from prefixkv_core import GenerationSettings

    session = engine.new_session(list(images), prompt, ["full"], 1.0, GenerationSettings(max_new_tokens=max_new))
    for _ in session.run():
        pass
    r = session.results()["full"]
    return (r["error"] and f"ERROR {r['error']}") or r["text"]


def engine_accuracy(engine, split: str, per_subtask: int, frames: int = 8) -> dict[str, float]:
    """Full's accuracy per subtask on the first `per_subtask` samples of `split`, asked as the lmms tasks ask:
    the images and `MultiSample.prompt`; the clip written to an mp4 and sampled to `frames` by the engine."""
    import tempfile

    from scenes.grading import is_correct
    from scenes.video import write_clip

    acc: dict[str, float] = {}
    for sub in MULTI_SUBTASKS:
        right = [s.grade(engine_answer(engine, s.images, s.prompt))
                 for s in (multi_sample(seed) for seed in multi_seeds(split, per_subtask, sub))]
        acc[f"multi/{sub}"] = sum(right) / len(right)
    with tempfile.TemporaryDirectory() as tmp:
        for sub in VIDEO_SUBTASKS:
            right = []
            for seed in video_seeds(split, per_subtask, sub):
                s = video_sample(seed, CLIP_FRAMES)
                path = write_clip(s, Path(tmp) / f"clip-{seed}.mp4")
                session_out = engine_video_answer(engine, str(path), s.question, frames)
                right.append(is_correct(session_out, s.answer))
            acc[f"video/{sub}"] = sum(right) / len(right)
    return acc


def engine_single_accuracy(engine, split: str, scenes: int) -> dict[str, float]:
    """Full's accuracy per question type on every template question of the first `scenes` scenes of `split`, one
    image each (what benchmarks/vision_accuracy.py asks)."""
    from scenes.grading import is_correct
    from scenes.splits import split_seeds

    right: dict[str, list[bool]] = {}
    for seed in split_seeds(split, scenes):
        scene = render_scene(seed)
        for qa in scene.qa:
            right.setdefault(qa.qtype, []).append(is_correct(engine_answer(engine, [scene.image], qa.question),
                                                             qa.answer))
    acc = {f"single/{t}": sum(v) / len(v) for t, v in right.items()}
    every = [x for v in right.values() for x in v]
    return acc | {"single/all": sum(every) / len(every)}


def engine_video_answer(engine, video, prompt: str, frames: int, max_new: int = 8) -> str:
    from prefixkv_core import GenerationSettings

    session = engine.new_session(None, prompt, ["full"], 1.0, GenerationSettings(max_new_tokens=max_new),
                                 video=video, frames=frames)
    for _ in session.run():
        pass
    r = session.results()["full"]
    return (r["error"] and f"ERROR {r['error']}") or r["text"]


# ----------------------------------------------------------------------------------------------- training
def train_multi(args) -> None:
    from peft import set_peft_model_state_dict

    loaded, model = frozen_model(args)
    if not args.init or not args.init_lora:
        raise SystemExit("stage M starts from trained weights: give --init (vision) and --init-lora (adapter)")
    load_vision_state(model, read_state(args.init))
    log(f"init vision/projector from {args.init} (frozen)")
    init_adapter = read_state(args.init_lora)
    rank = next(v.shape[0] for k, v in init_adapter.items() if ".lora_A." in k)
    lora = add_lora(model, rank)
    set_peft_model_state_dict(lora, init_adapter)
    log(f"init adapter (rank {rank}) from {args.init_lora}")
    params = [p for p in lora.parameters() if p.requires_grad]
    opt = torch.optim.AdamW([{"params": params, "lr": args.lora_lr, "base_lr": args.lora_lr}], weight_decay=0.0,
                            betas=(0.9, 0.98))
    texts = text_corpus.windows(loaded.tokenizer, args.text_tokens) if args.text_weight > 0 else []
    vision = {k: v.cpu() for k, v in vision_state(model).items()}
    weights = {"multi": 1.0, "video": 1.0, "single": args.single_weight}
    digits = digit_token_ids(loaded, 9).to(args.device)

    ckpt = Checkpoint(Path(args.out), "M")
    start, history = ckpt.resume(args, opt, lambda ck: set_peft_model_state_dict(lora, ck["lora"]))

    def save(step):
        adapter = {k: v.cpu() for k, v in lora_state(lora).items()}
        ckpt.save({"step": step, "lora": adapter, "opt": opt.state_dict(), "history": history, "args": vars(args)},
                  {"vision_M.pt": vision, "lora_M.safetensors": adapter, "history_M.json": history})

    frame_choices = tuple(int(f) for f in args.frame_choices.split(",") if f.strip())
    multi_range = SPLITS["train"][MULTI_BASE:VIDEO_BASE]
    video_range = SPLITS["train"][VIDEO_BASE:SINGLE_BASE]

    def examples(step: int):
        """The step's examples: (kind, images, branches) for a multi-image set, a clip and (every
        --single-every steps) a single scene."""
        rng = random.Random(step * 7919 + args.seed)
        out = []
        for i in range(args.multi_per_step):
            seed = multi_range[(step * args.multi_per_step + i + 10_000 * args.seed) % len(multi_range)]
            out.append(("multi", *multi_example(seed, rng, args.per_subtask)))
        for i in range(args.video_per_step if step % args.video_every == 0 else 0):
            seed = video_range[(step * args.video_per_step + i + 10_000 * args.seed) % len(video_range)]
            out.append(("video", *video_example(seed, rng, args.per_subtask, args.frames, frame_choices,
                                                args.vary_frames, args.mp4_share)))
        if args.single_every and step % args.single_every == 0:
            scene = training_scene(SINGLE_BASE + step + 10_000 * args.seed, args.loose_share)
            branches = scene_branches(scene, rng, args.desc_prob, args.max_branches, args.casual)
            out.append(("single", [scene.image], [(q, a, "single") for q, a in branches]))
        return out

    def step_fn(step):
        t0 = time.time()
        batch = examples(step)
        t_data = time.time() - t0
        opt.zero_grad(set_to_none=True)
        rec: dict[str, float] = {}
        hits: dict[str, list[bool]] = {}
        total = 0.0
        for kind, images, branches in batch:
            tree = tree_example(loaded, len(images), [(q, a) for q, a, _ in branches])
            feats = image_features(model, loaded, images)
            loss, logits, target, branch, index = tree_loss(model, loaded, tree, feats, args.index_layer, digits)
            (weights[kind] * loss + args.index_weight * index).backward()
            total += weights[kind] * loss.item() + args.index_weight * index.item()
            rec[f"{kind}_loss"] = loss.item()
            if args.index_layer and kind != "single":
                rec[f"{kind}_index"] = index.item()
            for k, v in branch_hits(logits, target, branch, subtask_of_branches(branches)).items():
                hits.setdefault(k, []).extend(v)
        if texts and step % args.text_every == 0:
            window = torch.tensor([texts[(step // args.text_every) % len(texts)]], device=args.device)
            kl = text_kl(model, lora, window)
            (args.text_weight * kl).backward()
            total += args.text_weight * kl.item()
            rec["text_kl"] = kl.item()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        rec |= {f"acc/{k}": sum(v) / len(v) for k, v in hits.items()}
        return {"loss": total, **rec, "data_s": round(t_data, 2), "step_s": round(time.time() - t0, 2)}

    def evaluate(step: int) -> None:
        if args.eval_every and (step + 1) % args.eval_every == 0:
            t0 = time.time()
            engine = merged_engine(vision, lora_state(lora))
            ev = engine_accuracy(engine, "val", args.eval_samples, args.frames)
            del engine
            history[-1]["val"] = ev
            log(f"val (engine, Full, {args.eval_samples} per subtask, {time.time() - t0:.0f}s): "
                + " ".join(f"{k}={v:.2f}" for k, v in ev.items()))
            save(step + 1)

    metrics = ("loss", "multi_loss", "step_s") + (("multi_index",) if args.index_layer else ())
    run_steps(args, "M", opt, start, history, step_fn, save, metrics, after_step=evaluate)


def add_args(ap) -> None:
    """Stage M's own options (train_embedded.py adds them to its parser)."""
    ap.add_argument("--text-every", type=int, default=2, help="stage M: the text KL term every N steps")
    ap.add_argument("--per-subtask", type=int, default=6,
                    help="stage M: extra questions of each subtask per multi-image set or clip")
    ap.add_argument("--multi-per-step", type=int, default=1, help="stage M: multi-image sets per step")
    ap.add_argument("--video-per-step", type=int, default=1, help="stage M: clips per step")
    ap.add_argument("--video-every", type=int, default=1, help="stage M: clips every N steps")
    ap.add_argument("--index-layer", type=int, default=0,
                    help="stage M: the layer after which image tokens should name their image number (0 = off)")
    ap.add_argument("--index-weight", type=float, default=0.3, help="stage M: weight of that image-number loss")
    ap.add_argument("--single-every", type=int, default=2,
                    help="stage M: a single-image scene every N steps (0 = none)")
    ap.add_argument("--frames", type=int, default=8, help="stage M: frames sampled from each 16-frame clip")
    ap.add_argument("--frame-choices", default="4,5,6,7,10",
                    help="stage M: other frame counts a --vary-frames share of the clips gets")
    ap.add_argument("--vary-frames", type=float, default=0.15)
    ap.add_argument("--mp4-share", type=float, default=0.5,
                    help="stage M: share of the clips written to an mp4 and decoded, as the engine reads a file")
    ap.add_argument("--single-weight", type=float, default=0.5, help="stage M: weight of the single-image loss")
    ap.add_argument("--eval-samples", type=int, default=6,
                    help="stage M: validation samples per subtask asked through the engine every --eval-every steps")


def main(argv=None) -> int:
    """Full's accuracy per subtask through the engine, for an adapter a stage-M run saved."""
    import argparse
    import json

    from prefixkv_core.models import EMBEDDED_LORA_FILE, EMBEDDED_VISION_DIR

    ap = argparse.ArgumentParser(description="Ask a stage-M adapter validation samples through the engine (Full).")
    ap.add_argument("--lora", default=str(EMBEDDED_LORA_FILE))
    ap.add_argument("--vision", default=str(EMBEDDED_VISION_DIR / "vision.safetensors"))
    ap.add_argument("--split", default="val", choices=["val", "train"])
    ap.add_argument("--samples", type=int, default=8, help="per subtask")
    ap.add_argument("--frames", type=int, default=8)
    ap.add_argument("--single", type=int, default=0, help="also ask every template question of N single scenes")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    ap.add_argument("--save-dir", default=None,
                    help="also save the merged model there, loadable with --model DIR by the benchmarks")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    t0 = time.time()
    engine = merged_engine(read_state(args.vision), read_state(args.lora))
    if args.save_dir:
        from prefixkv_core.models.configs import META_KEY

        meta = dict(getattr(engine.loaded.model.config, META_KEY, None) or {})
        setattr(engine.loaded.model.config, META_KEY, meta | {"vision_trained": True})
        engine.loaded.model.save_pretrained(args.save_dir)
        engine.loaded.processor.save_pretrained(args.save_dir)
        log(f"merged model saved to {args.save_dir}")
    acc = engine_accuracy(engine, args.split, args.samples, args.frames) if args.samples else {}
    if args.single:
        acc |= engine_single_accuracy(engine, args.split, args.single)
    res = {"lora": args.lora, "split": args.split, "samples": args.samples, "accuracy": acc,
           "seconds": round(time.time() - t0, 1)}
    print(json.dumps(res))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
