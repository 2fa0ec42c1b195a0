"""Cache layers that append in place hold and return exactly what their transformers parents do."""

from unittest import mock

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.cache_utils import DynamicIndexedLayer, DynamicLayer, DynamicSlidingWindowLayer

from hf_csa2.model import preallocated_cache
from hf_csa2.model.preallocated_cache import (
    PreallocatedIndexedLayer,
    PreallocatedLayer,
    PreallocatedSlidingWindowLayer,
    append_rows,
)

chunks_strategy = st.lists(st.sampled_from([1, 1, 1, 2, 3, 7]), min_size=1, max_size=16)


def states(gen, t, heads=2, dim=3):
    return torch.randn(2, heads, t, dim, generator=gen), torch.randn(2, heads, t, dim, generator=gen)


# One spare row at least: stores fill up and move within a few steps, so every branch runs.
few_spare_rows = mock.patch.object(preallocated_cache, "MIN_SPARE_ROWS", 1)


@settings(max_examples=40, deadline=None)
@given(chunks=chunks_strategy, window=st.one_of(st.none(), st.integers(2, 17)), seed=st.integers(0, 99))
@few_spare_rows
def test_layers_match_their_parents_step_by_step(chunks, window, seed):
    gen = torch.Generator().manual_seed(seed)
    if window is None:
        ours, theirs = PreallocatedLayer(), DynamicLayer()
    else:
        ours, theirs = PreallocatedSlidingWindowLayer(window), DynamicSlidingWindowLayer(window)
    returned = []
    for t in chunks:
        k, v = states(gen, t)
        got, want = ours.update(k, v), theirs.update(k.clone(), v.clone())
        for a, b in zip(got, want):
            assert torch.equal(a, b)
        assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values)
        assert ours.get_seq_length() == theirs.get_seq_length()
        returned.append((got[0], got[0].clone()))
    # what a step returned is never overwritten by a later step
    for view, copy in returned:
        assert torch.equal(view, copy)


@few_spare_rows
def test_decode_steps_write_into_the_store_without_copying_what_is_held():
    layer = PreallocatedLayer()
    gen = torch.Generator().manual_seed(0)
    layer.update(*states(gen, 100))
    store = layer.key_store
    assert store.shape[-2] == 100 + 100 // 8  # 1/8 spare rows
    for _ in range(12):
        keys, _ = layer.update(*states(gen, 1))
        assert layer.key_store is store and keys.data_ptr() == store.data_ptr()
    keys, _ = layer.update(*states(gen, 1))  # the 13th row does not fit: a new, larger store
    assert layer.key_store is not store and keys.shape[-2] == 113


@few_spare_rows
def test_a_window_keeps_only_its_rows_and_spare_ones():
    layer = PreallocatedSlidingWindowLayer(sliding_window=9)
    gen = torch.Generator().manual_seed(0)
    full, _ = layer.update(*states(gen, 50))  # a long prefill: returned whole, the store holds the last 8
    assert full.shape[-2] == 50 and layer.keys.shape[-2] == 8
    assert layer.key_store.shape[-2] == 8 + 2  # window / 4 spare rows
    store = layer.key_store
    full, _ = layer.update(*states(gen, 1))
    assert layer.key_store is store and full.shape[-2] == 9 and layer.keys.data_ptr() == store[:, :, 1:].data_ptr()
    full, _ = layer.update(*states(gen, 1))  # the last spare row
    assert layer.key_store is store and full.data_ptr() == store[:, :, 1:].data_ptr()
    layer.update(*states(gen, 1))
    assert layer.key_store is not store  # the window moved


@few_spare_rows
def test_a_window_decoding_in_its_spare_rows_matches_its_parent():
    ours, theirs = PreallocatedSlidingWindowLayer(sliding_window=13), DynamicSlidingWindowLayer(sliding_window=13)
    gen = torch.Generator().manual_seed(0)
    for t in (20, 1, 1, 1, 1, 2, 1, 1, 1, 1, 1, 1):  # 3 spare rows: decode steps at offsets 0..3 of a store
        k, v = states(gen, t)
        for a, b in zip(ours.update(k, v), theirs.update(k, v)):
            assert torch.equal(a, b)


@few_spare_rows
def test_indexer_keys_append_in_place_too():
    ours, theirs = PreallocatedIndexedLayer(), DynamicIndexedLayer()
    gen = torch.Generator().manual_seed(0)
    for t in (5, 1, 1, 3, 1):
        keys = torch.randn(2, t, 4, generator=gen)
        assert torch.equal(ours.update_indexer(keys), theirs.update_indexer(keys))
    assert ours.indexer_keys.data_ptr() == ours.indexer_store.data_ptr()


@few_spare_rows
def test_replaced_tensors_start_a_new_store():
    """Beam reorder / batch select swap the held tensors: the next step must not write into the old store."""
    ours, theirs = PreallocatedLayer(), DynamicLayer()
    gen = torch.Generator().manual_seed(0)
    for layer in (ours, theirs):
        layer.update(*states(torch.Generator().manual_seed(0), 6))
    beams = torch.tensor([1, 1])
    ours.reorder_cache(beams)
    theirs.reorder_cache(beams)
    k, v = states(gen, 1)
    for a, b in zip(ours.update(k, v), theirs.update(k, v)):
        assert torch.equal(a, b)
    ours.crop(-3)
    theirs.crop(-3)
    k, v = states(gen, 2)
    for a, b in zip(ours.update(k, v), theirs.update(k, v)):
        assert torch.equal(a, b)


def test_under_autograd_rows_are_concatenated_not_written_in_place():
    held = torch.randn(1, 1, 4, 2, requires_grad=True)
    new = torch.randn(1, 1, 1, 2)
    store, full, kept = append_rows(None, held, new, -2)
    assert store is None and full.grad_fn is not None and torch.equal(full[:, :, :4], held)
    full.sum().backward()
    assert torch.equal(held.grad, torch.ones_like(held))


def test_derived_rows_are_computed_once_per_row_and_dropped_when_the_cache_changes():
    layer = PreallocatedLayer()
    gen = torch.Generator().manual_seed(0)
    asked = []

    def derive(lo, hi):  # a row-wise function of the held keys
        asked.append((lo, hi))
        return layer.keys[:, :, lo:hi] * 2 + 1

    for t in (5, 1, 1, 3):
        layer.update(*states(gen, t))
        got = layer.derived_rows("twice", derive, layer.get_seq_length())
        assert torch.equal(got, layer.keys * 2 + 1)
    assert asked == [(0, 5), (5, 6), (6, 7), (7, 10)]
    for change in (lambda: layer.reorder_cache(torch.tensor([1, 0])), lambda: layer.crop(-2),
                   lambda: layer.batch_select_indices(torch.tensor([1]))):
        change()
        layer.update(*states(gen, 1))
        got = layer.derived_rows("twice", derive, layer.get_seq_length())
        assert asked[-1] == (0, layer.get_seq_length()) and torch.equal(got, layer.keys * 2 + 1)
