"""The cache's growable entry stores and the batched decode step built on them: appends and rewrites happen in
place, capacity grows without losing entries, a row's eviction or merge inside a batch's shared store equals
the same edit on a plain copy, and decode steps keep rows where they are instead of copying them."""
import pytest
import torch

from prefixkv_core.decoding import runner
from prefixkv_core.kv.attention import tracked_attention_enabled
from prefixkv_core.kv.cache import ENTRY_FIELDS, TrackedCache, TrackedLayer
from prefixkv_core.kv.stores import EntryStore, spare_for
from prefixkv_core.kv.joint_eviction import gather_many
from prefixkv_core.models import encode, format_prompt

PROMPT = "describe the picture in detail and name every object you can see in it"


def _layer(t: int, seed: int, heads: int = 2, dim: int = 4) -> TrackedLayer:
    g = torch.Generator().manual_seed(seed)
    layer = TrackedLayer()
    keys, values = torch.randn(1, heads, t, dim, generator=g), torch.randn(1, heads, t, dim, generator=g)
    layer.update(keys, values)
    layer.append_meta(torch.arange(t).view(1, -1), torch.arange(t).view(1, -1) % 3 == 0, heads)
    layer.scores.add_(torch.rand(1, heads, t, generator=g))
    return layer


def _fields(layer: TrackedLayer) -> dict[str, torch.Tensor]:
    return {name: getattr(layer, name).clone() for name in ENTRY_FIELDS}


def test_capacity_grows_and_keeps_every_entry():
    store = EntryStore.holding(torch.arange(6.0).view(1, 1, 6, 1), spare=2)
    assert store.capacity == 8
    expected = list(range(6))
    for step in range(20):  # past the spare room several times
        store.append((0, 1), torch.full((1, 1, 1, 1), 100.0 + step))
        expected.append(100 + step)
    assert store.capacity >= 26 and store.lengths == [26]
    assert store.view((0, 1)).flatten().tolist() == expected


def test_appends_write_in_place_until_the_room_runs_out():
    layer = _layer(5, 0)
    data = layer._stores["keys"].data
    spare = spare_for(5)
    assert data.shape[2] == 5 + spare
    for _ in range(spare):
        layer.update(torch.ones(1, 2, 1, 4), torch.ones(1, 2, 1, 4))
    assert layer._stores["keys"].data is data  # the spare room took every one
    layer.update(torch.ones(1, 2, 1, 4), torch.ones(1, 2, 1, 4))
    assert layer._stores["keys"].data is not data and layer.keys.shape[2] == 5 + spare + 1


def test_writing_a_slice_of_itself_is_safe():
    layer = _layer(7, 1)
    reference = layer.keys[:, :, 2:].clone()
    layer.keys = layer.keys[:, :, 2:]  # overlaps the slot it is written into
    assert torch.equal(layer.keys, reference)


def _shared(layers: list[TrackedLayer]) -> dict[str, EntryStore]:
    longest = max(layer.length for layer in layers)
    stores = {name: EntryStore(getattr(layers[0], name).new_zeros(len(layers), 2, longest + 3,
                                                                  *getattr(layers[0], name).shape[3:]),
                               [0] * len(layers)) for name in ENTRY_FIELDS}
    for r, layer in enumerate(layers):
        layer.move_into(stores, r)
    return stores


@pytest.mark.parametrize("empty_slots", [False, True])
def test_eviction_in_a_shared_store_equals_the_naive_reference(empty_slots):
    layers = [_layer(t, seed) for seed, t in enumerate((9, 12, 7))]
    before = [_fields(layer) for layer in layers]
    stores = _shared(layers)
    assert all(layer.lives_in(stores, r) for r, layer in enumerate(layers))
    keep = torch.tensor([[[0, 2, 3, 7, 10], [1, 4, 5, 6, 11]]])  # a head-wise eviction of row 1
    if empty_slots:
        keep[0, 1, 0] = -1  # and one empty slot
    reference = TrackedLayer()
    for name, value in before[1].items():
        setattr(reference, name, value)
    reference.gather(keep, empty_slots=empty_slots)
    layers[1].gather(keep, empty_slots=empty_slots)
    assert layers[1].lives_in(stores, 1)  # compacted in its own slot
    for name in ENTRY_FIELDS:
        assert torch.equal(getattr(layers[1], name), getattr(reference, name)), name
        for r in (0, 2):  # the neighbours are untouched
            assert torch.equal(getattr(layers[r], name), before[r][name]), name


@pytest.mark.parametrize("evicted, untouched_row", [((2, 0, 1), 3), ((3, 0, 1), 2)])  # a block, and rows apart
def test_joint_eviction_of_several_rows_equals_each_row_alone(evicted, untouched_row):
    """`gather_many`: rows of one set of shared stores evicted together (head-shared and head-wise indices,
    different counts) hold exactly what each row's own gather gives, their image counts included; a row of its
    own stores and an untouched neighbour stay as they should."""
    layers = [_layer(t, seed) for seed, t in enumerate((9, 12, 7, 10))]
    loner = _layer(8, 9)
    stores = _shared(layers)
    by_row = {0: torch.tensor([[[0, 3, 4, 8]]]), 1: torch.tensor([[[0, 2, 3, 7, 10, 11], [1, 4, 5, 6, 9, 11]]]),
              2: torch.tensor([[[0, 1, 2, 3, 4, 5]]]), 3: torch.tensor([[[0, 1, 2, 3, 4, 9]]])}
    keeps = {r: by_row[r] for r in evicted}  # given out of row order
    references = {}
    for r, keep in keeps.items():
        references[r] = TrackedLayer()
        for name, value in _fields(layers[r]).items():
            setattr(references[r], name, value)
        references[r].gather(keep)
    untouched = _fields(layers[untouched_row])
    loner_reference = _layer(8, 9)
    loner_reference.gather(torch.tensor([[[0, 5, 7]]]))
    gather_many([(layers[r], keep) for r, keep in keeps.items()] + [(loner, torch.tensor([[[0, 5, 7]]]))])
    for r, reference in references.items():
        assert layers[r].lives_in(stores, r)
        for name in ENTRY_FIELDS:
            assert torch.equal(getattr(layers[r], name), getattr(reference, name)), (r, name)
        assert layers[r].image_count() == reference.image_count()
    for name in ENTRY_FIELDS:
        assert torch.equal(getattr(layers[untouched_row], name), untouched[name]), name
        assert torch.equal(getattr(loner, name), getattr(loner_reference, name)), name


@pytest.mark.parametrize("split", [False, True])
def test_layers_stacked_in_one_store_evict_together_and_grow_together(split, monkeypatch):
    """`StepBuffers.form` stacks the stores of every layer when all layers group their rows alike (one group, or
    the same two): one joint eviction over several layers and rows gives what each row's own gather gives (a
    permutation too, and only the entries that change are written), the untouched rows stay; each layer's part is
    as long as its own longest row, and when one layer runs out of room it grows, with the layers nearly full,
    without losing an entry anywhere."""
    from prefixkv_core.decoding import step_buffers

    if split:  # every layer puts its longest row (row 1) in a group of its own
        monkeypatch.setattr(step_buffers, "SPLIT_MIN_BYTES", 0)
        monkeypatch.setattr(step_buffers, "SPLIT_SHARE", 1.0)
    lengths = [(9, 12, 7), (10, 16, 8), (7, 14, 7)]  # [layer][row]
    by_layer = [[_layer(t, 10 * i + r) for r, t in enumerate(row)] for i, row in enumerate(lengths)]
    buffers = step_buffers.StepBuffers()
    buffers.form(by_layer)
    assert [g.rows for g in buffers._groups[0]] == ([[1], [0, 2]] if split else [[0, 1, 2]])
    where = {(i, r): buffers._where[i][r] for i in range(3) for r in range(3)}  # (group, row in it)
    for (i, r), (group, k) in where.items():
        assert by_layer[i][r].lives_in(group.stores, k)
        assert group.stores["keys"].stack is where[0, r][0].stores["keys"].stack is not None
    keeps = {(0, 0): torch.tensor([[[0, 3, 4, 8]]]), (0, 1): torch.tensor([[[0, 2, 3, 7, 10, 11], [1, 4, 5, 6, 9, 11]]]),
             (1, 2): torch.tensor([[[0, 1, 2, 3, 4, 5]]]), (2, 0): torch.tensor([[[6, 5, 4, 3, 2, 1, 0]]]),
             (1, 0): torch.tensor([[[0, 1, 2, 3, 4, 9]]])}
    references, untouched = {}, {}
    for (i, r), keep in keeps.items():
        references[i, r] = TrackedLayer()
        for name, value in _fields(by_layer[i][r]).items():
            setattr(references[i, r], name, value)
        references[i, r].gather(keep)
    for i, rows in enumerate(by_layer):
        for r, layer in enumerate(rows):
            if (i, r) not in keeps:
                untouched[i, r] = _fields(layer)
    gather_many([(by_layer[i][r], keep) for (i, r), keep in keeps.items()])
    for (i, r), reference in references.items():
        for name in ENTRY_FIELDS:
            assert torch.equal(getattr(by_layer[i][r], name), getattr(reference, name)), (i, r, name)
        assert by_layer[i][r].image_count() == reference.image_count()
    for (i, r), fields in untouched.items():
        for name in ENTRY_FIELDS:
            assert torch.equal(getattr(by_layer[i][r], name), fields[name]), (i, r, name)
    group, _ = where[1, 0]
    stack = group.stores["keys"].stack
    members = group.rows
    longest = [max(lengths[i][r] for r in members) for i in range(3)]  # as formed, before the evictions
    assert stack.capacities == [n + spare_for(n) for n in longest]  # each layer sized to its own longest row
    # layer 2 of the group nearly full: its longest row takes entries until less room is left than it would get
    crowded = max(members, key=lambda r: by_layer[2][r].length)
    while stack.capacities[2] - by_layer[2][crowded].length >= spare_for(by_layer[2][crowded].length):
        by_layer[2][crowded]._append("keys", torch.randn(1, 2, 1, 4))
        by_layer[2][crowded]._append("values", torch.randn(1, 2, 1, 4))
        by_layer[2][crowded].append_meta_per_head(torch.tensor([[[50], [50]]]), torch.tensor([[[True], [True]]]),
                                                  torch.zeros(1, 2, 1), has_image=True)
    before = {(i, r): _fields(layer) for i, rows in enumerate(by_layer) for r, layer in enumerate(rows)}
    capacities = list(stack.capacities)
    for name in ENTRY_FIELDS:  # layer 1's store runs out of room
        group.stores[name].reserve(capacities[1] + 1)
    grown = stack.capacities
    # layer 1 grows, and so does the nearly full layer 2; layer 0, with room to spare, keeps its capacity
    assert grown[1] > capacities[1] and grown[2] > capacities[2] and grown[0] == capacities[0]
    assert all(where[i, members[0]][0].stores[name].capacity == grown[i] for i in range(3) for name in ENTRY_FIELDS)
    for (i, r), fields in before.items():
        assert by_layer[i][r].lives_in(where[i, r][0].stores, where[i, r][1])
        for name in ENTRY_FIELDS:
            assert torch.equal(getattr(by_layer[i][r], name), fields[name]), (i, r, name)


def test_merge_in_a_shared_store_equals_the_naive_reference():
    layers = [_layer(t, seed) for seed, t in enumerate((8, 10))]
    reference = TrackedLayer()
    for name, value in _fields(layers[0]).items():
        setattr(reference, name, value)
    _shared(layers)
    args = (torch.tensor([[[5, 6]]]), torch.tensor([[[1, 2]]]), torch.tensor([[[1.0, 2.0]]]), torch.ones(1, 1, 8))
    reference.merge(*args)
    layers[0].merge(*args)
    torch.testing.assert_close(layers[0].keys, reference.keys)
    torch.testing.assert_close(layers[0].values, reference.values)


def test_a_compressed_layer_gives_its_room_back():
    layer = _layer(400, 3)
    layer.gather(torch.arange(0, 400, 10).view(1, 1, -1))
    assert layer.length == 40 and layer._stores["keys"].capacity == 40 + spare_for(40)


def test_clone_copies_into_stores_of_its_own():
    """A clone holds what its original holds, field by field (empty slots and packed segments included), in stores
    and segments of its own."""
    cache = TrackedCache(3)
    cache.layers[0] = _layer(6, 4)
    cache.layers[1] = _layer(9, 5)
    cache.layers[1].gather(torch.tensor([[[-1, 0, 3, 8], [1, 2, 4, 7]]]), empty_slots=True)
    cache.layers[2] = _layer(8, 6)
    cache.layers[2].quantize_fp_part((torch.arange(8) % 2 == 0).view(1, 1, -1), 4, 2, None)
    twin = cache.clone()
    for mine, theirs in zip(cache.layers, twin.layers):
        for name in ENTRY_FIELDS:
            assert torch.equal(getattr(mine, name), getattr(theirs, name)), name
            assert theirs._stores[name] is not mine._stores[name]
        assert (theirs.has_empty_slots, theirs.image_count(), theirs.length, theirs.nbytes()) == \
               (mine.has_empty_slots, mine.image_count(), mine.length, mine.nbytes())
        assert torch.equal(theirs.full_keys(), mine.full_keys())
    assert twin.layers[1].has_empty_slots and twin.layers[2].segments[0] is not cache.layers[2].segments[0]
    twin.layers[0].keys.zero_()
    assert cache.layers[0].keys.abs().sum() > 0


@pytest.fixture
def prefilled(tiny_qwen2, noise_image):
    inputs = encode(tiny_qwen2, noise_image, format_prompt(tiny_qwen2, PROMPT, with_image=True))
    ids = inputs["input_ids"]
    with tracked_attention_enabled(tiny_qwen2.model):
        shared = runner.prefill(tiny_qwen2.model, ids, ids == tiny_qwen2.image_token_id, inputs["pixel_values"], [],
                                tiny_qwen2.num_layers, tiny_qwen2.device)
    return shared.cache, ids.shape[1]


def test_decode_steps_keep_rows_in_place(tiny_qwen2, prefilled):
    """Rows move into the shared stores at the first step and stay: later steps write one entry per row (no
    copy of any row while there is room), and the rows read back exactly what a plain row holds."""
    cache, n = prefilled
    rows = [cache.clone() for _ in range(3)]
    for r, row in enumerate(rows):  # different lengths per row and layer
        for layer in row.layers:
            layer.gather(torch.arange(0, n, r + 1).view(1, 1, -1))
    plain = [row.clone() for row in rows]
    buffers = runner.StepBuffers()
    with tracked_attention_enabled(tiny_qwen2.model):
        for step in range(4):
            tokens = [[5 + step], [6 + step], [7 + step]]
            starts = [n + step] * 3
            runner.forward_rows(tiny_qwen2.model, rows, tokens, starts, [True] * 3, tiny_qwen2.device, buffers)
            if step == 0:
                data = {i: groups[0].stores["keys"].data for i, groups in buffers._groups.items()}
            for row, tok, start in zip(plain, tokens, starts):
                runner.forward_rows(tiny_qwen2.model, [row], [tok], [start], [True], tiny_qwen2.device)
    assert all(buffers._groups[i][0].stores["keys"].data is data[i] for i in data)  # written in place, never re-copied
    for r, (row, ref) in enumerate(zip(rows, plain)):
        for i, (mine, theirs) in enumerate(zip(row.layers, ref.layers)):
            assert mine.lives_in(buffers._groups[i][0].stores, r)
            assert torch.equal(mine.positions, theirs.positions)
            torch.testing.assert_close(mine.keys, theirs.keys, atol=1e-5, rtol=1e-5)


def test_a_row_replaced_in_the_batch_keeps_its_entries(tiny_qwen2, prefilled):
    """When another row takes a row's place in the shared stores, the row that left keeps its own entries."""
    cache, n = prefilled
    a, b, c = (cache.clone() for _ in range(3))
    kept = b.clone()
    buffers = runner.StepBuffers()
    with tracked_attention_enabled(tiny_qwen2.model):
        runner.forward_rows(tiny_qwen2.model, [a, b], [[5], [6]], [n, n], [False, False], tiny_qwen2.device, buffers)
        runner.forward_rows(tiny_qwen2.model, [kept], [[6]], [n], [False], tiny_qwen2.device)
        runner.forward_rows(tiny_qwen2.model, [a, c], [[7], [8]], [n + 1, n], [False, False], tiny_qwen2.device,
                            buffers)
    for mine, theirs in zip(b.layers, kept.layers):
        assert torch.equal(mine.positions, theirs.positions)
        torch.testing.assert_close(mine.keys, theirs.keys, atol=1e-5, rtol=1e-5)


def test_a_formed_batch_is_where_the_steps_find_it(tiny_qwen2, prefilled):
    """`form_batch` moves the rows in before the first step, in the order the steps hold them (rows that want
    attention first): the steps then find every row in place and allocate nothing, and give what plain rows
    give."""
    cache, n = prefilled
    rows = [cache.clone() for _ in range(3)]
    for r, row in enumerate(rows):
        for layer in row.layers:
            layer.gather(torch.arange(0, n, r + 1).view(1, 1, -1))
    plain = [row.clone() for row in rows]
    want = [False, True, False]
    buffers = runner.StepBuffers()
    runner.form_batch(rows, want, buffers)
    groups = {i: buffers._groups[i] for i in buffers._groups}
    assert len(groups) == tiny_qwen2.num_layers
    for i, (g,) in groups.items():  # small caches: one group, row 1 (wants attention) first
        assert g.rows == [0, 1, 2]
        for k, r in enumerate((1, 0, 2)):
            assert rows[r].layers[i].lives_in(g.stores, k)
    with tracked_attention_enabled(tiny_qwen2.model):
        out = runner.forward_rows(tiny_qwen2.model, rows, [[5], [6], [7]], [n] * 3, want, tiny_qwen2.device, buffers)
        alone = [runner.forward_rows(tiny_qwen2.model, [row], [[t]], [n], [w], tiny_qwen2.device)
                 for row, t, w in zip(plain, (5, 6, 7), want)]
    assert all(buffers._groups[i] is groups[i] for i in groups)  # nothing re-formed
    for r, single in enumerate(alone):
        torch.testing.assert_close(out.logits[r], single.logits[0], atol=1e-5, rtol=1e-5)
    for layer, att in alone[1].attention[0].items():
        torch.testing.assert_close(out.attention[1][layer], att, atol=1e-6, rtol=1e-5)


def test_a_quantised_row_decodes_in_its_working_copy(tiny_qwen2, prefilled, monkeypatch):
    """A row holding quantised entries (ZipVL) decodes in the batch through a working copy of its entries,
    dequantised. Its own full-precision entries and metadata become views of that copy, so a step writes the new
    entry once; re-quantising mid-batch and the stores growing past their room still give what a plain row
    gives, step by step."""
    from prefixkv_core.decoding import step_buffers

    monkeypatch.setattr(step_buffers, "spare_for", lambda entries: 2)  # the shared stores grow within a few steps
    cache, n = prefilled
    rows = [cache.clone() for _ in range(2)]
    important = (torch.arange(n) % 3 == 0).view(1, 1, -1)
    for layer in rows[1].layers:
        layer.quantize_fp_part(important, 4, 2, None)
    plain = [row.clone() for row in rows]
    buffers = runner.StepBuffers()
    with tracked_attention_enabled(tiny_qwen2.model):
        for step in range(7):
            if step == 3:  # a new quantised block: the working copy is written again
                for row in (rows[1], plain[1]):
                    for layer in row.layers:
                        layer.quantize_fp_part(torch.tensor([[[True, False, True]]]), 4, 2, None)
            tokens, starts = [[5 + step], [9 + step]], [n + step] * 2
            out = runner.forward_rows(tiny_qwen2.model, rows, tokens, starts, [False, False], tiny_qwen2.device,
                                      buffers)
            for r, (row, tok, start) in enumerate(zip(plain, tokens, starts)):
                alone = runner.forward_rows(tiny_qwen2.model, [row], [tok], [start], [False], tiny_qwen2.device)
                torch.testing.assert_close(out.logits[r], alone.logits[0], atol=1e-5, rtol=1e-5)
            if step in (1, 6):  # the row's full-precision keys live in its working copy (again after it grew)
                for i, layer in enumerate(rows[1].layers):
                    shared = buffers._groups[i][0].stores["keys"].data
                    assert layer.keys.untyped_storage().data_ptr() == shared.untyped_storage().data_ptr()
                grown = [g[0].stores["keys"].capacity for g in buffers._groups.values()]
    assert all(c >= n + 7 for c in grown)  # the stores grew past their first room (n + 2)
    for mine, theirs in zip(rows[1].layers, plain[1].layers):
        assert len(mine.segments) == len(theirs.segments) == 4 and mine.length == theirs.length == n + 7
        assert torch.equal(mine.positions, theirs.positions) and torch.equal(mine.is_image, theirs.is_image)
        # fp32 keys of a batched step differ from a lone row's in the last bits; packing carries that along
        torch.testing.assert_close(mine.full_keys(), theirs.full_keys(), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(mine.full_values(), theirs.full_values(), atol=1e-4, rtol=1e-4)
        assert mine.nbytes() == theirs.nbytes()


def test_a_quantised_row_replaced_in_the_batch_and_back(tiny_qwen2, prefilled):
    """A quantised row whose slot another row takes keeps its entries, and when it comes back its working copy is
    written again: every step gives what plain rows give."""
    cache, n = prefilled
    a, b, c = (cache.clone() for _ in range(3))
    important = (torch.arange(n) % 2 == 0).view(1, 1, -1)
    for layer in a.layers:
        layer.quantize_fp_part(important, 4, 2, None)
    plain = {"a": a.clone(), "b": b.clone(), "c": c.clone()}
    rows = {"a": a, "b": b, "c": c}
    starts = {"a": n, "b": n, "c": n}
    buffers = runner.StepBuffers()
    with tracked_attention_enabled(tiny_qwen2.model):
        for step, names in enumerate((("a", "b"), ("c", "b"), ("a", "b"))):
            tokens = [[5 + step + k] for k in range(2)]
            out = runner.forward_rows(tiny_qwen2.model, [rows[m] for m in names], tokens, [starts[m] for m in names],
                                      [False, False], tiny_qwen2.device, buffers)
            for k, m in enumerate(names):
                alone = runner.forward_rows(tiny_qwen2.model, [plain[m]], [tokens[k]], [starts[m]], [False],
                                            tiny_qwen2.device)
                torch.testing.assert_close(out.logits[k], alone.logits[0], atol=1e-5, rtol=1e-5)
                starts[m] += 1
    for mine, theirs in zip(a.layers, plain["a"].layers):
        assert mine.length == theirs.length == n + 2 and torch.equal(mine.positions, theirs.positions)
        torch.testing.assert_close(mine.full_keys(), theirs.full_keys(), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("split", [False, True])
def test_range_drops_over_stacked_layers_equal_each_row_alone(split, monkeypatch):
    """`drop_ranges` (a fixed-point eviction of every row and layer at once, from a few numbers per row) leaves
    exactly what each row's own gather of the kept indices leaves, image counts included: a range in the middle,
    one at the start, one at the end (nothing moves), a row filled to its capacity, a layer of its own stores;
    the rows that drop nothing stay as they were."""
    from prefixkv_core.decoding import step_buffers
    from prefixkv_core.kv.joint_eviction import drop_ranges
    from prefixkv_core.policies.base import drop_range_keep

    if split:
        monkeypatch.setattr(step_buffers, "SPLIT_MIN_BYTES", 0)
        monkeypatch.setattr(step_buffers, "SPLIT_SHARE", 1.0)
    lengths = [(9, 12, 7), (10, 16, 8), (7, 14, 7)]  # [layer][row]
    by_layer = [[_layer(t, 10 * i + r) for r, t in enumerate(row)] for i, row in enumerate(lengths)]
    step_buffers.StepBuffers().form(by_layer)
    full = by_layer[1][1]  # fill one row to its capacity: its last slot holds an entry that moves
    for _ in range(full._stores["keys"].capacity - full.length):
        full._append("keys", torch.randn(1, 2, 1, 4))
        full._append("values", torch.randn(1, 2, 1, 4))
        full.append_meta_per_head(torch.tensor([[[99], [99]]]), torch.tensor([[[True], [False]]]),
                                  torch.zeros(1, 2, 1), has_image=True)
    assert full.length == full._stores["keys"].capacity
    loner = _layer(11, 99)
    drops = {(0, 0): (3, 2), (0, 1): (0, 2), (1, 1): (5, 3), (1, 2): (6, 2), (2, 1): (4, 6)}
    references = {}
    for (i, r), (start, count) in drops.items():
        references[i, r] = TrackedLayer()
        for name, value in _fields(by_layer[i][r]).items():
            setattr(references[i, r], name, value)
        references[i, r].gather(drop_range_keep(by_layer[i][r].length, start, count, "cpu"))
    loner_reference = _layer(11, 99)
    loner_reference.gather(drop_range_keep(11, 2, 4, "cpu"))
    untouched = {(i, r): _fields(layer) for i, rows in enumerate(by_layer) for r, layer in enumerate(rows)
                 if (i, r) not in drops}
    drop_ranges([(by_layer[i][r], start, count) for (i, r), (start, count) in drops.items()] + [(loner, 2, 4)])
    for (i, r), reference in references.items():
        for name in ENTRY_FIELDS:
            assert torch.equal(getattr(by_layer[i][r], name), getattr(reference, name)), (i, r, name)
        assert by_layer[i][r].image_count() == reference.image_count()
    for name in ENTRY_FIELDS:
        assert torch.equal(getattr(loner, name), getattr(loner_reference, name)), name
    for (i, r), fields in untouched.items():
        for name in ENTRY_FIELDS:
            assert torch.equal(getattr(by_layer[i][r], name), fields[name]), (i, r, name)


def _cache(lengths: list[int], rows: int, seed: int = 0, heads: int = 2, dim: int = 4) -> TrackedCache:
    """A cache of `rows` prompts whose layer i holds lengths[i] entries (each layer in stores of its own)."""
    g = torch.Generator().manual_seed(seed)
    cache = TrackedCache(len(lengths))
    for layer, t in zip(cache.layers, lengths):
        layer.update(torch.randn(rows, heads, t, dim, generator=g), torch.randn(rows, heads, t, dim, generator=g))
        positions = torch.arange(t).repeat(rows, 1)
        layer.append_meta(positions, (positions + torch.arange(rows)[:, None]) % 3 == 0, heads)
        layer.scores.add_(torch.rand(rows, heads, t, generator=g))
    return cache


@pytest.mark.parametrize("rows", [1, 3])
def test_a_cache_s_stacked_layers_evict_together_as_each_layer_alone(rows):
    """`TrackedCache.stack_layers` (what an every-step method's cache gets after its prompt is compressed): every
    layer's fields in one tensor each, a layer's part as long as it holds plus room. A joint eviction of all its
    layers (different counts per layer, head-shared and head-wise indices, one row or several) and then a range
    drop leave exactly what each layer's own edit leaves on a copy, image counts included, in operators that do
    not grow with the layers beyond a view of each index; appends after them grow the stack without losing an
    entry."""
    from prefixkv_core.kv.joint_eviction import drop_ranges
    from benchmarks.step_ops import _Operators

    lengths = [9, 12, 7, 10]
    cache, plain = _cache(lengths, rows), _cache(lengths, rows)
    assert cache.stack_layers() and cache.stack_layers()  # a second call finds them stacked
    stacks = {name: cache.layers[0]._stores[name].stack for name in ENTRY_FIELDS}
    assert all(layer._stores[name].stack is stacks[name] for layer in cache.layers for name in ENTRY_FIELDS)
    assert stacks["keys"].capacities == [n + spare_for(n) for n in lengths]
    for mine, theirs in zip(cache.layers, plain.layers):
        for name in ENTRY_FIELDS:
            assert torch.equal(getattr(mine, name), getattr(theirs, name)), name
    g = torch.Generator().manual_seed(1)
    keeps = [torch.sort(torch.randperm(n, generator=g)[:k]).values.view(1, 1, -1).expand(rows, 1, -1)
             for n, k in zip(lengths, (4, 6, 7, 3))]
    keeps[1] = torch.stack([torch.sort(torch.randperm(12, generator=g)[:6]).values for _ in range(2)]).expand(
        rows, 2, 6)  # head-wise
    ops = _Operators()
    with ops:
        gather_many(list(zip(cache.layers, keeps)))
    few = _Operators()
    with few:
        gather_many(list(zip(_cache(lengths[:2], rows).layers, keeps[:2])))  # no stack: each layer alone
    for layer, keep in zip(plain.layers, keeps):
        layer.gather(keep)
    drop_ranges([(layer, 1, 2) for layer in cache.layers])
    for layer in plain.layers:
        layer.drop_range(1, 2)
    for mine, theirs in zip(cache.layers, plain.layers):
        for name in ENTRY_FIELDS:
            assert torch.equal(getattr(mine, name), getattr(theirs, name)), name
        assert mine.image_count() == theirs.image_count()
        assert mine._stores["keys"].stack is stacks["keys"]  # evicted where they lie
    assert ops.operators < 2 * few.operators  # four layers at once cost less than two each on its own
    for step in range(20):  # past every layer's room: the stack grows
        for mine, theirs in zip(cache.layers, plain.layers):
            new = torch.full((rows, 2, 1, 4), float(step))
            for layer in (mine, theirs):
                layer.update(new, new)
                layer.append_meta(torch.full((rows, 1), 100 + step), torch.zeros(rows, 1, dtype=torch.bool), 2)
    for mine, theirs in zip(cache.layers, plain.layers):
        for name in ENTRY_FIELDS:
            assert torch.equal(getattr(mine, name), getattr(theirs, name)), name


def test_only_caches_of_their_own_full_precision_entries_are_stacked():
    """A cache whose layers are rows of a batch's shared stores, or hold quantised entries, is left as it is."""
    cache = _cache([5, 6], 1)
    buffers_rows = [_cache([5, 6], 1, seed=s) for s in (1, 2)]
    from prefixkv_core.decoding.step_buffers import StepBuffers

    StepBuffers().form([[c.layers[i] for c in buffers_rows] for i in range(2)])
    before = buffers_rows[0].layers[0]._stores
    assert not buffers_rows[0].stack_layers() and buffers_rows[0].layers[0]._stores is before
    cache.layers[1].quantize_fp_part(torch.ones(1, 1, 6, dtype=torch.bool), 4, 2, None)
    assert not cache.stack_layers() and cache.layers[0]._stores["keys"].stack is None


def test_a_step_adds_every_row_s_attention_into_its_scores_at_once(tiny_qwen2, prefilled):
    """Where the rows that want attention keep their scores in one shared store (a quantised row's in its working
    copy), a step's statistic is added into all of them at once: each row's scores are what adding its own part
    gives, step after step; a row's part is what its own step records."""
    cache, n = prefilled
    rows = [cache.clone() for _ in range(3)]
    for r, row in enumerate(rows):  # different lengths: the shorter rows' slots after their entries get zeros
        for layer in row.layers:
            layer.gather(torch.arange(0, n, r + 1).view(1, 1, -1))
    for layer in rows[1].layers:
        layer.quantize_fp_part((torch.arange(layer.length) % 2 == 0).view(1, 1, -1), 4, 2, None)
    plain = [row.clone() for row in rows]
    want = [True, True, False]
    buffers = runner.StepBuffers()
    with tracked_attention_enabled(tiny_qwen2.model):
        for step in range(3):
            tokens = [[5 + step + r] for r in range(3)]
            starts = [n + step] * 3
            out = runner.forward_rows(tiny_qwen2.model, rows, tokens, starts, want, tiny_qwen2.device, buffers)
            assert out.attention[0].step is out.attention[1].step and out.attention[2] is None
            assert out.attention[0].step.add_to_scores()  # one shared store a layer: added at once
            assert out.attention[0].scores_added and out.attention[1].scores_added
            for r, (row, tok, start, w) in enumerate(zip(plain, tokens, starts, want)):
                alone = runner.forward_rows(tiny_qwen2.model, [row], [tok], [start], [w], tiny_qwen2.device)
                if w:
                    row.add_scores(alone.attention[0])
                    for layer, att in alone.attention[0].items():
                        torch.testing.assert_close(out.attention[r][layer], att, atol=1e-6, rtol=1e-5)
    for mine, theirs in zip(rows, plain):
        for a, b in zip(mine.layers, theirs.layers):
            assert a.length == b.length
            torch.testing.assert_close(a.scores, b.scores, atol=1e-5, rtol=1e-5)
    assert any(bool(layer.scores[..., -3:].sum() > 0) for layer in rows[0].layers)  # the steps did add scores


@pytest.mark.parametrize("rows", [1, 2])
def test_a_prompt_only_cache_writes_every_layer_s_metadata_at_once(tiny_qwen2, prefilled, rows, monkeypatch):
    """A cache that only grows keeps its metadata stacked over the layers (`stack_layers(META_FIELDS)`): a decode
    step then writes every layer's new position, flag and score at once, and moves the slots on from step to
    step. Layers of different lengths, the stack growing past its room, one row or several: each step's logits
    and every field are what a plain copy appending layer by layer holds."""
    from prefixkv_core.kv import cache as cache_module
    from prefixkv_core.kv.cache import META_FIELDS

    monkeypatch.setattr(cache_module, "spare_for", lambda entries: 2)  # the stack grows within a few steps
    full, n = prefilled
    mine = full.clone()
    for i, layer in enumerate(mine.layers):  # each layer its own count, as a per-layer budget leaves them
        layer.gather(torch.arange(0, n, i + 1).view(1, 1, -1))
    if rows > 1:  # the same prompt in every row, as one cache (the speed benchmark's shared plan)
        one, mine = mine, TrackedCache(len(mine.layers))
        for theirs, layer in zip(one.layers, mine.layers):
            layer.lazy_initialization(theirs.keys, theirs.values)
            for name in ENTRY_FIELDS:
                setattr(layer, name, getattr(theirs, name).expand(rows, *getattr(theirs, name).shape[1:]).clone())
    plain = mine.clone()
    assert mine.stack_layers(META_FIELDS)
    stacks = {name: mine.layers[0].store_of(name).stack for name in META_FIELDS}
    assert all(layer.store_of(name).stack is stacks[name] for layer in mine.layers for name in META_FIELDS)
    assert mine.layers[0].store_of("keys").stack is None  # keys and values stay where they are
    grown = []
    with tracked_attention_enabled(tiny_qwen2.model):
        for step in range(6):
            ids = torch.tensor([[5 + step]] * rows)
            got, _ = runner.forward_group(tiny_qwen2.model, mine, ids, n + step, runner.StatRequest())
            assert mine._meta_of_every_layer
            want, _ = runner.forward_group(tiny_qwen2.model, plain, ids, n + step, runner.StatRequest())
            assert not plain._meta_of_every_layer
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
            grown.append(mine.layers[0].store_of("positions").stack.capacities[0])
    assert grown[-1] > grown[0]  # the stack grew on the way
    for a, b in zip(mine.layers, plain.layers):
        assert a.length == b.length
        for name in ENTRY_FIELDS:
            torch.testing.assert_close(getattr(a, name), getattr(b, name), atol=1e-5, rtol=1e-5)
        assert int(a.positions[0, 0, -1]) == n + 5 and not bool(a.is_image[..., -6:].any())


def test_the_step_lengths_move_on_in_place():
    """`StepLengths` keeps every layer's row lengths on the device from step to step: one more entry in every row
    moves them on in place (the views made of them with them), the same counts keep them, anything else makes them
    anew; the key mask and the metadata slots are what they would be made from the lengths."""
    from prefixkv_core.decoding.step_lengths import StepLengths

    lengths = StepLengths()
    lengths.start([[3, 5], [4, 2]], torch.device("cpu"))
    ends = lengths.ends
    index = lengths.append_index(1, heads=2, dim=3)
    starts = torch.tensor([[[0, 10], [20, 30]], [[40, 50], [60, 70]]])
    slots = lengths.meta_slots(("layout",), lambda: starts)
    assert slots.tolist() == (starts + torch.tensor([[3, 5], [4, 2]])[:, :, None]).view(-1).tolist()
    for before in ([[4, 6], [5, 3]], [[4, 6], [5, 3]], [[5, 7], [6, 4]]):  # one more, the same, one more
        lengths.start(before, torch.device("cpu"))
        assert lengths.ends is ends and lengths.ends.tolist() == before
        assert index[:, 0, 0, 0].tolist() == before[1] and lengths.layer_ends(0).tolist() == before[0]
        want = torch.arange(8)[None, None, :] <= torch.tensor(before)[:, :, None]
        for layer in (0, 1):
            assert torch.equal(lengths.key_mask(layer, 8), want[layer][:, None, :8])
        assert lengths.meta_slots(("layout",), lambda: starts).tolist() == \
            (starts + torch.tensor(before)[:, :, None]).view(-1).tolist()
    lengths.start([[2, 2], [2, 2]], torch.device("cpu"))  # an eviction that changed the counts: made anew
    assert lengths.ends is not ends and lengths.ends.tolist() == [[2, 2], [2, 2]]
    assert lengths.meta_slots(("layout",), lambda: starts).tolist() == (starts + 2).view(-1).tolist()
