"""Stage J of the embedded model's training: tower + projector + LoRA adapter end to end on rendered images.

Stages W and L trained the two halves apart (the projector to emit the word grid, the adapter to read it);
here they meet. Each step takes --batch scenes, every question of a scene packed as branches of one sequence
(data.tree_example), the scenes padded into one batch, and minimises
    answer cross-entropy                            (each answer weighs the same)
  + --grid-weight x stage W's loss on the image tokens  (the projector keeps speaking the grid's words)
  + --text-weight x KL(base || adapted) on one window of ordinary text  (training/text_corpus.py), so the
    adapter keeps SmolLM2's text ability (text_check.py measures it on the benchmarks' built-in text).
Checkpoints every few minutes into --out (vision_J.pt, lora_J.safetensors, stageJ.ckpt; --resume).
"""
from __future__ import annotations

import random
from pathlib import Path

import torch
import torch.nn.functional as F

from scenes import all_qa, render_scene
from scenes.phrasings import casual_qa

from . import data, prefetch, text_corpus, word_grid
from .grid_stages import (Checkpoint, VocabIndex, autocast, frozen_model, grid_classes, grid_loss, log,
                          periodic_eval, read_state, run_steps, tally_answers, training_scene)
from .trainable import add_lora, load_vision_state, lora_state, patch_features, vision_state

STAGE_BASE = 900_000


def scene_branches(scene, rng: random.Random, desc_prob: float, max_branches: int, casual: bool):
    qas = all_qa(scene, rng) + (casual_qa(scene, rng) if casual else [])
    rng.shuffle(qas)
    branches = [(qa.question, qa.answer) for qa in qas[:max_branches]]
    if rng.random() < desc_prob:
        branches.append((rng.choice(data.DESCRIBE_PROMPTS), scene.description))
    return branches


def pad_trees(trees: list[tuple[torch.Tensor, ...]], pad_id: int):
    """Stack tree examples (ids, pos, mask, sup) of different lengths into one batch. A padding position
    sees only itself and nobody sees it, so every row computes what it computes alone."""
    n = max(t[0].shape[0] for t in trees)
    b = len(trees)
    ids = torch.full((b, n), pad_id, dtype=torch.long)
    pos = torch.zeros((b, n), dtype=torch.long)
    sup = torch.zeros((b, n), dtype=torch.long)
    mask = torch.eye(n, dtype=torch.bool).repeat(b, 1, 1)
    for i, (t_ids, t_pos, t_mask, t_sup) in enumerate(trees):
        k = t_ids.shape[0]
        ids[i, :k], pos[i, :k], sup[i, :k], mask[i, :k, :k] = t_ids, t_pos, t_sup, t_mask
    return ids, pos, mask, sup


def answers_loss(model, loaded, ids, pos, mask, sup, image_embeds):
    """(loss, logits, targets, (row, branch)) over the supervised tokens of a padded batch of trees whose
    image tokens carry `image_embeds` [B, 144, D]."""
    x = model.get_input_embeddings()(ids)
    img = ids == loaded.image_token_id
    x = x.masked_scatter(img[..., None], image_embeds.to(x.dtype))
    hidden = model.model.language_model(inputs_embeds=x, attention_mask=mask[:, None], position_ids=pos,
                                        use_cache=False).last_hidden_state
    row, at = torch.nonzero(sup[:, 1:], as_tuple=True)
    logits = model.lm_head(hidden[row, at]).float()
    target, branch = ids[row, at + 1], sup[row, at + 1]
    key = row * (int(sup.max()) + 1) + branch
    w = 1.0 / torch.bincount(key)[key].float()
    loss = (F.cross_entropy(logits, target, reduction="none") * w).sum() / w.sum()
    return loss, logits, target, (row, branch)


def text_kl(model, lora, window: torch.Tensor) -> torch.Tensor:
    """KL(base || adapted) of the next-token distributions on a window of ordinary text [1, L]."""
    lm = model.model.language_model
    with torch.no_grad(), lora.disable_adapter():
        base = F.log_softmax(model.lm_head(lm(input_ids=window, use_cache=False).last_hidden_state).float(), -1)
    adapted = F.log_softmax(model.lm_head(lm(input_ids=window, use_cache=False).last_hidden_state).float(), -1)
    return F.kl_div(adapted, base, log_target=True, reduction="batchmean") / window.shape[1]


@torch.no_grad()
def joint_accuracy(model, loaded, seeds: list[int], device: str) -> dict[str, float]:
    """Teacher-forced answers (== greedy) on rendered scenes with their own test-style questions."""
    right: dict[str, list[bool]] = {}
    for seed in seeds:
        scene = render_scene(seed, data.RENDER_SIZE)
        tree = data.tree_example(loaded, [(qa.question, qa.answer) for qa in scene.qa])
        ids, pos, mask, sup = (t.to(device) for t in pad_trees([tree], loaded.tokenizer.eos_token_id))
        with autocast(device):
            feats = model.model.multi_modal_projector(
                patch_features(model, data.pixels(loaded, [scene.image]).to(device)))
            _, logits, target, (_, branch) = answers_loss(model, loaded, ids, pos, mask, sup, feats)
        tally_answers(right, scene.qa, logits.argmax(-1) == target, branch)
    return {t: sum(v) / len(v) for t, v in right.items()}


def train_joint(args) -> None:
    from peft import set_peft_model_state_dict

    loaded, model = frozen_model(args)
    if args.init:
        load_vision_state(model, read_state(args.init))
        log(f"init vision/projector from {args.init}")
    lora = add_lora(model, args.lora_rank)
    if args.init_lora:
        set_peft_model_state_dict(lora, read_state(args.init_lora))
        log(f"init adapter from {args.init_lora}")
    tower, proj = model.model.vision_tower, model.model.multi_modal_projector
    groups = [{"params": list(proj.parameters()), "lr": args.lr},
              {"params": list(tower.parameters()), "lr": args.tower_lr},
              {"params": [p for p in lora.parameters() if p.requires_grad], "lr": args.lora_lr}]
    for g in groups[:2]:
        for p in g["params"]:
            p.requires_grad_(True)
    groups = [g | {"base_lr": g["lr"]} for g in groups if g["lr"] > 0]
    params = [p for g in groups for p in g["params"]]
    opt = torch.optim.AdamW(groups, weight_decay=args.wd, betas=(0.9, 0.98))
    vocab = VocabIndex(word_grid.vocabulary(loaded.tokenizer))
    vocab_emb = model.get_input_embeddings().weight[vocab.ids.to(args.device)].detach()
    texts = text_corpus.windows(loaded.tokenizer, args.text_tokens) if args.text_weight > 0 else []

    ckpt = Checkpoint(Path(args.out), "J")

    def restore(ck):
        load_vision_state(model, ck["vision"])
        set_peft_model_state_dict(lora, ck["lora"])

    start, history = ckpt.resume(args, opt, restore)

    def save(step):
        vision = {k: v.cpu() for k, v in vision_state(model).items()}
        adapter = {k: v.cpu() for k, v in lora_state(lora).items()}
        ckpt.save({"step": step, "vision": vision, "lora": adapter, "opt": opt.state_dict(), "history": history,
                   "args": vars(args)},
                  {"vision_J.pt": vision, "lora_J.safetensors": adapter, "history_J.json": history})

    base = STAGE_BASE + 10_000 * args.seed
    eos = loaded.tokenizer.eos_token_id

    def make_batch(step):  # CPU side, in a worker when --workers > 0
        scenes, trees = [], []
        for i in range(args.batch):
            seed = base + step * args.batch + i
            rng = random.Random(seed * 31 + args.seed)
            scene = training_scene(seed, args.loose_share)
            scenes.append(scene)
            trees.append(data.tree_example(loaded, scene_branches(scene, rng, args.desc_prob, args.max_branches,
                                                                  args.casual)))
        pv = data.pixels(loaded, [s.image for s in scenes])
        cls = grid_classes(loaded.tokenizer, vocab, scenes, args.layout)
        window = torch.tensor([texts[step % len(texts)]]) if texts else torch.zeros(0)
        return (pv, cls, *pad_trees(trees, eos), window)

    feed = prefetch.batches(make_batch, start, args.steps, args.workers)

    def step_fn(step):
        pv, cls, ids, pos, mask, sup, window = (t.to(args.device, non_blocking=True) for t in next(feed))
        opt.zero_grad(set_to_none=True)
        with autocast(args.device):
            feats = proj(patch_features(model, pv))
            loss, logits, target, _ = answers_loss(model, loaded, ids, pos, mask, sup, feats)
            rec = {"answer_loss": loss.item(), "tok_acc": (logits.argmax(-1) == target).float().mean().item()}
            if args.grid_weight > 0:
                g, acc = grid_loss(feats, cls, vocab_emb, args.fill_weight)
                loss = loss + args.grid_weight * g
                rec |= {"grid_loss": g.item(), "acc_words": acc["acc_words"]}
            if texts:
                kl = text_kl(model, lora, window)
                loss = loss + args.text_weight * kl
                rec["text_kl"] = kl.item()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        return {"loss": loss.item(), **rec}

    evaluate = periodic_eval(args, model, history, lambda seeds: joint_accuracy(model, loaded, seeds, args.device),
                             "on rendered images")

    metrics = ("loss", "answer_loss", "tok_acc") + (("grid_loss", "acc_words") if args.grid_weight > 0 else ()) + (
        ("text_kl",) if texts else ())
    run_steps(args, "J", opt, start, history, step_fn, save, metrics, after_step=evaluate)
