"""Stage J's pieces: scenes padded into one batch compute what each computes alone, batches built ahead in
worker processes are the in-process batches, and the ordinary-text corpus is disjoint from the text the
adapter's cost is measured on."""
import random

import torch

from training import data, prefetch, text_corpus
from training.joint_stage import answers_loss, pad_trees


def _square(step: int) -> tuple[torch.Tensor, int]:
    return torch.tensor([step, step * step]), step


def test_batches_are_the_same_with_workers():
    alone = list(prefetch.batches(_square, 3, 9, workers=0))
    ahead = list(prefetch.batches(_square, 3, 9, workers=2, ahead=2))
    assert [s for _, s in alone] == list(range(3, 9))
    assert len(ahead) == len(alone)
    for (a, s), (b, t) in zip(alone, ahead):
        assert s == t and torch.equal(a, b)


def test_padded_trees_equal_each_tree_alone(tiny_llama):
    """Two scenes of different lengths in one padded batch: every supervised logit equals the one the scene's
    tree gives alone (padding sees only itself, nobody sees padding), and the loss weighs answers equally."""
    model = tiny_llama.model.eval()
    eos = tiny_llama.tokenizer.eos_token_id
    trees = [data.tree_example(tiny_llama, [("What colour is the square?", "red"), ("How many stars?", "2")]),
             data.tree_example(tiny_llama, [("Where is the blue circle?", "top left"),
                                            ("Is there a cross?", "no"), ("What word is written?", "STOP")])]
    assert trees[0][0].shape[0] != trees[1][0].shape[0]
    gen = torch.Generator().manual_seed(0)
    dim = model.get_input_embeddings().weight.shape[1]
    images = torch.randn(2, tiny_llama.image_seq_length, dim, generator=gen) * 0.02
    with torch.no_grad():
        _, batch_logits, batch_targets, (row, branch) = answers_loss(model, tiny_llama, *pad_trees(trees, eos),
                                                                     images)
        for i, tree in enumerate(trees):
            _, logits, targets, (_, b) = answers_loss(model, tiny_llama, *pad_trees([tree], eos), images[i:i + 1])
            assert torch.equal(batch_targets[row == i], targets)
            assert torch.equal(branch[row == i], b)
            assert torch.allclose(batch_logits[row == i], logits, atol=1e-4)


def test_pad_trees_layout():
    ids = torch.tensor([5, 6, 7])
    tree = (ids, torch.arange(3), torch.tril(torch.ones(3, 3, dtype=torch.bool)), torch.tensor([0, 1, 1]))
    short = (ids[:2], torch.arange(2), torch.tril(torch.ones(2, 2, dtype=torch.bool)), torch.tensor([0, 1]))
    pids, pos, mask, sup = pad_trees([tree, short], pad_id=0)
    assert pids.tolist() == [[5, 6, 7], [5, 6, 0]] and sup.tolist() == [[0, 1, 1], [0, 1, 0]]
    assert pos.tolist() == [[0, 1, 2], [0, 1, 0]]
    assert mask[1, 2].tolist() == [False, False, True]  # the pad sees itself only
    assert not mask[1, :2, 2].any()  # and no real token sees the pad


def test_text_corpus_is_prose_and_not_the_measured_text():
    from pydoc_data.topics import topics

    text = text_corpus.corpus()
    assert len(text) > 100_000
    measured = "\n".join(topics.values())
    rng = random.Random(0)
    for _ in range(50):  # no 120-character passage of the corpus occurs in the Language Reference
        start = rng.randrange(0, len(text) - 120)
        assert text[start:start + 120] not in measured
