"""Training sequences for the embedded model's vision tower equal what the engine feeds the model, and
only answer tokens are supervised (checked on the tiny model: same helpers, any LLaVA)."""
import random

import torch

from prefixkv_core.models import encode, format_prompt
from scenes import render_scene
from training import data


def test_first_turn_matches_the_processor(tiny_llama, noise_image):
    prompt = "What colour is the square?"
    want = encode(tiny_llama, noise_image, format_prompt(tiny_llama, prompt, with_image=True))["input_ids"][0]
    got = torch.tensor(data.first_turn_ids(tiny_llama, prompt))
    assert torch.equal(got, want)
    assert int((got == tiny_llama.image_token_id).sum()) == tiny_llama.image_seq_length


def test_only_answers_are_supervised(tiny_llama):
    turns = [("What colour is the square?", "red"), ("How many circles are there?", "2")]
    ids, sup = data.conversation(tiny_llama, turns)
    assert ids.shape == sup.shape
    tok = tiny_llama.tokenizer
    for k, (_, answer) in enumerate(turns, start=1):
        marked = ids[sup == k].tolist()
        assert tok.decode(marked[: len(tok(answer, add_special_tokens=False)["input_ids"])]) == answer
        assert marked[-1] == tok.eos_token_id  # the end of each answer is learnt too
    assert not bool((sup[ids == tiny_llama.image_token_id] != 0).any())


def test_scene_turns_single_turn_and_targets():
    scene = render_scene(5)
    turns = data.scene_turns(scene, random.Random(0), with_description=True)
    assert len(turns) == len(scene.qa) + 1
    t = data.vision_targets(scene)
    assert int((t["colour"] > 0).sum()) == len(scene.objects) == int(t["total"])
    assert int(t["counts"].sum()) == len(scene.objects)


def test_tree_branches_compute_exactly_the_single_turn_prompts(tiny_llama, noise_image):
    """A tree-packed example (one image prefix, many question branches) gives every branch the same
    logits as its own single-turn prompt: no branch sees another branch's answer."""
    from training.train_embedded import supervised_logits

    branches = [("What colour is the square?", "red"), ("How many circles are there?", "2"),
                ("Where is the blue star?", "top-left")]
    ids, pos, mask, sup = data.tree_example(tiny_llama, branches)
    assert ids.shape == pos.shape == sup.shape and mask.shape == (len(ids), len(ids))
    model = tiny_llama.model.eval()
    pv = data.pixels(tiny_llama, [noise_image])
    with torch.no_grad():
        tree_logits, tree_targets, turn = supervised_logits(model, ids, sup, pv, pos, mask)
        for k, branch in enumerate(branches, start=1):
            single_ids, single_sup = data.conversation(tiny_llama, [branch])
            logits, targets, _ = supervised_logits(model, single_ids, single_sup, pv)
            assert torch.equal(tree_targets[turn == k], targets)
            assert torch.allclose(tree_logits[turn == k], logits, atol=1e-4)
    # a branch's tokens never attend to another branch
    first = (sup == 1).nonzero()[0].item()
    assert not bool(mask[first, (sup == 2).nonzero().squeeze(1)].any())


def test_all_qa_asks_the_test_phrasings():
    """Training's exhaustive questions use the same templates as the scenes' own (test) questions."""
    from scenes import all_qa

    for seed in range(20):
        scene = render_scene(seed)
        every = {(q.question, q.answer) for q in all_qa(scene, random.Random(seed))}
        own_yes = [q for q in scene.qa if q.answer not in ("no", "0")]  # negatives are sampled
        assert {(q.question, q.answer) for q in own_yes} <= every
        assert any(q.answer == "no" for q in all_qa(scene, random.Random(seed)))


def test_shipped_lora_adapter_merges_to_the_adapted_model(tiny_llama, noise_image, tmp_path):
    """The embedded loader's merge of a LoRA adapter file gives the logits of the live adapted model."""
    import copy

    from peft import get_peft_model, get_peft_model_state_dict
    from safetensors.torch import save_file

    from prefixkv_core.models import embedded_lora_config, merge_embedded_lora

    base = tiny_llama.model.eval()
    adapted = copy.deepcopy(base)
    merged = copy.deepcopy(base)
    peft_model = get_peft_model(adapted.model.language_model, embedded_lora_config(4))
    torch.manual_seed(0)
    for name, p in peft_model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.05)  # B starts at zero: make the adapter do something
    path = tmp_path / "lm_lora.safetensors"
    save_file({k: v.contiguous() for k, v in get_peft_model_state_dict(peft_model).items()}, str(path))
    merge_embedded_lora(merged, path)

    ids, sup = data.conversation(tiny_llama, [("What colour is the square?", "red")])
    pv = data.pixels(tiny_llama, [noise_image])
    with torch.no_grad():
        want = adapted(input_ids=ids[None], pixel_values=pv).logits
        got = merged(input_ids=ids[None], pixel_values=pv).logits
        before = base(input_ids=ids[None], pixel_values=pv).logits
    assert torch.allclose(got, want, atol=1e-4)
    assert not torch.allclose(got, before, atol=1e-3)
    assert not any("lora" in n for n, _ in merged.named_parameters())


def test_snapshot_keeps_trained_parts_in_fp16_and_reads_back(tmp_path):
    """The committed checkpoints a later run continues from: fp16 files that read back as float32."""
    import json as _json

    from safetensors.torch import save_file

    from training.grid_stages import read_state, snapshot

    run = tmp_path / "run"
    run.mkdir()
    vision = {"vision_tower.w": torch.randn(4, 3), "multi_modal_projector.b": torch.randn(5)}
    torch.save(vision, run / "vision_W.pt")
    save_file({"base_model.x.lora_A.weight": torch.randn(2, 6)}, str(run / "lora_L.safetensors"))
    (run / "history_W.json").write_text(_json.dumps([{"step": 3, "loss": 1.0, "acc_words": 0.5}]))
    (run / "history_L.json").write_text(_json.dumps([{"step": 2, "loss": 0.5, "val": {"colour": 1.0}}]))

    class Args:
        out, dest = str(run), str(tmp_path / "snap")
    snapshot(Args)
    back = read_state(tmp_path / "snap" / "vision_W.safetensors")
    assert set(back) == set(vision) and all(v.dtype == torch.float32 for v in back.values())
    assert all(torch.allclose(back[k], vision[k], atol=1e-2) for k in vision)
    progress = _json.loads((tmp_path / "snap" / "progress.json").read_text())
    assert progress["W"]["steps"] == 3 and progress["L"]["val_from_true_grids"] == {"colour": 1.0}
