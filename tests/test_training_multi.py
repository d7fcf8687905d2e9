"""Stage M's examples: a multi-image sample and a clip become, branch by branch, exactly the token ids the engine
feeds the model for that prompt (format_prompt with n images, encode), with only the answer and its end-of-turn
token supervised, and every branch of a packed example computes what its prompt computes alone."""
import random

import torch

from prefixkv_core.models import encode, format_prompt
from scenes.multi import multi_sample, multi_seeds
from scenes.video import video_sample, video_seeds
from training import multi_stage as M


def _branch_tokens(tree, k):
    ids, pos, mask, sup = tree
    last = int((sup == k).nonzero()[-1])
    keep = mask[last]  # what the branch's last token sees: the prefix and the branch itself
    return ids[keep], pos[keep], sup[keep]


def _check(loaded, images, branches):
    tree = M.tree_example(loaded, len(images), [(q, a) for q, a, _ in branches])
    eos = loaded.tokenizer.eos_token_id
    for k, (prompt, answer, _) in enumerate(branches, start=1):
        want = encode(loaded, images, format_prompt(loaded, prompt, with_image=len(images)))["input_ids"][0]
        ids, pos, sup = _branch_tokens(tree, k)
        n = want.shape[0]
        assert torch.equal(ids[:n], want), f"branch {k}: not the engine's prompt"
        assert torch.equal(pos, torch.arange(ids.shape[0]))
        ans = loaded.tokenizer(answer, add_special_tokens=False)["input_ids"] + [eos]
        assert ids[n:].tolist() == ans
        assert (sup[:n] == 0).all() and (sup[n:] == k).all()
    return tree


def test_multi_sample_is_the_engines_prompt_with_the_answer_supervised(tiny_llama):
    seed = multi_seeds("train", 8)[5]
    sample = multi_sample(seed, n_images=3, size=64)
    from scenes import render_scene
    scenes = [render_scene(s, 64) for s in sample.scene_seeds]
    branches = M.multi_branches(sample, scenes, random.Random(0), per_subtask=2)
    assert branches[0] == (sample.prompt, sample.answer, sample.subtask)
    assert {b[2] for b in branches} >= {"which", "colour_k", "count"}
    _check(tiny_llama, list(sample.images), branches)


def test_clip_is_the_engines_prompt_with_the_answer_supervised(tiny_llama):
    sample = video_sample(video_seeds("train", 3)[2], 16, size=64)
    frames = M.clip_frames(sample, 4)
    assert len(frames) == 4 and frames[0] is sample.frames[0] and frames[-1] is sample.frames[-1]
    branches = M.video_branches(sample, random.Random(0), per_subtask=3)
    assert branches[0] == (sample.question, sample.answer, sample.subtask)
    _check(tiny_llama, frames, branches)


def test_every_branch_computes_its_prompt_alone(tiny_llama):
    model = tiny_llama.model.eval()
    sample = multi_sample(multi_seeds("train", 4)[0], n_images=2, size=64)
    from scenes import render_scene
    scenes = [render_scene(s, 64) for s in sample.scene_seeds]
    branches = M.multi_branches(sample, scenes, random.Random(1), per_subtask=1)[:4]
    tree = M.tree_example(tiny_llama, 2, [(q, a) for q, a, _ in branches])
    dim = model.get_input_embeddings().weight.shape[1]
    feats = torch.randn(2 * tiny_llama.image_seq_length, dim, generator=torch.Generator().manual_seed(0)) * 0.02
    with torch.no_grad():
        _, logits, target, branch, _ = M.tree_loss(model, tiny_llama, tree, feats)
        for k in range(1, len(branches) + 1):
            ids, pos, sup = _branch_tokens(tree, k)
            alone = (ids, pos, torch.tril(torch.ones(len(ids), len(ids), dtype=torch.bool)), torch.where(sup > 0, 1, 0))
            _, solo, solo_target, _, _ = M.tree_loss(model, tiny_llama, alone, feats)
            assert torch.equal(target[branch == k], solo_target)
            assert torch.allclose(logits[branch == k], solo, atol=1e-4)


def test_derived_questions_have_one_answer():
    from scenes import render_scene
    sample = multi_sample(multi_seeds("train", 12)[9], n_images=4, images=False)
    scenes = [render_scene(s, 32) for s in sample.scene_seeds]
    qs = M.multi_questions(scenes)
    for q, a, _ in qs["which"]:
        words = q.removeprefix("Which image shows ").rstrip("?").split()
        colour, shape = words[-2], words[-1]
        holders = [k + 1 for k, s in enumerate(scenes) if any((o.colour, o.shape) == (colour, shape) for o in s.objects)]
        assert holders == [int(a)]
    for q, a, _ in qs["count"]:
        assert 1 <= int(a) <= 9
    video = video_sample(video_seeds("train", 30, "appears_last")[4], draw=False)
    vq = M.video_questions(video.movers)
    assert (video.question, video.answer) in vq["appears_last"]
