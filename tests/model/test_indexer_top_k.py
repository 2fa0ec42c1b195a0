"""The indexer's Top-K is a stable descending sort's first K (ties to the earlier position),
computed with integer keys and ``topk``: equal on every input, ties and infinities included."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_csa2.model.indexer import top_k_earliest_first

VALUES = st.sampled_from([0.0, -0.0, 1.0, -1.0, 2.5, 1e-40, -1e-40, 3.4e38, -3.4e38, float("inf"), float("-inf")])


def stable_reference(scores: torch.Tensor, k: int) -> torch.Tensor:
    return scores.sort(dim=-1, descending=True, stable=True).indices[..., :k]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(VALUES, st.floats(-1e6, 1e6, width=32)), min_size=1, max_size=40), st.integers(1, 40))
def test_equals_a_stable_sort(values, k):
    scores = torch.tensor(values, dtype=torch.float32)
    k = min(k, len(values))
    assert torch.equal(top_k_earliest_first(scores, k), stable_reference(scores, k))


def test_batches_of_relu_scores_with_many_ties():
    g = torch.Generator().manual_seed(0)
    scores = (torch.randn(3, 50, 700, generator=g).relu() * torch.randint(0, 3, (3, 50, 1), generator=g)).round(decimals=1)
    scores[:, :, 600:] = float("-inf")  # masked positions
    for k in (1, 17, 256, 700):
        assert torch.equal(top_k_earliest_first(scores, k), stable_reference(scores, k))


def test_negative_zero_ties_with_positive_zero():
    scores = torch.tensor([-0.0, 0.0, -0.0, 0.0])
    assert top_k_earliest_first(scores, 4).tolist() == [0, 1, 2, 3]


# -- block-level selection -------------------------------------------------------------------------

from hf_csa2.model.indexer import masked_scores, select_top_k, top_blocks_earliest_first  # noqa: E402


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 60), st.sampled_from([2, 3, 4, 8]), st.integers(1, 4), st.integers(0, 5), st.integers(0, 10 ** 6))
def test_block_selection_reads_whole_best_blocks_of_selectable_positions(s, block, blocks_k, window, seed):
    """Every pick is selectable and picked once; picks come from at most K / B blocks, each read
    whole (all its selectable positions), best block first; the best selectable position is picked."""
    g = torch.Generator().manual_seed(seed)
    t, top_k = min(s, 7), block * blocks_k
    q, w, k = torch.randn(1, t, 2, 4, generator=g), torch.randn(1, t, 2, generator=g), torch.randn(1, s, 4, generator=g)
    positions = torch.arange(s - t, s)
    picks = select_top_k(q, w, k, positions, top_k, window, block=block)
    scores = masked_scores(q, w, k, positions, window)
    assert picks.shape == (1, t, top_k)
    for row in range(t):
        got = [p for p in picks[0, row].tolist() if p >= 0]
        assert len(set(got)) == len(got)
        finite = torch.isfinite(scores[0, row])
        assert all(finite[p] for p in got)
        chosen = list(dict.fromkeys(p // block for p in got))
        assert len(chosen) <= blocks_k
        for b in chosen:  # whole blocks
            members = [p for p in range(b * block, min(s, (b + 1) * block)) if finite[p]]
            assert [p for p in got if p // block == b] == members
        maxima = [scores[0, row, b * block:(b + 1) * block].max().item() for b in chosen]
        assert maxima == sorted(maxima, reverse=True)
        if finite.any():
            assert int(torch.where(finite, scores[0, row], float("-inf")).argmax()) in got


def test_blocks_of_one_position_are_the_token_top_k():
    g = torch.Generator().manual_seed(1)
    scores = torch.randn(2, 5, 40, generator=g).relu().round(decimals=1)  # ties
    assert torch.equal(top_blocks_earliest_first(scores, 12, 1), top_k_earliest_first(scores, 12))


def test_block_selection_is_aligned_to_each_rows_first_real_position():
    # the same row, alone and behind 3 pads: the same picks, shifted by 3
    g = torch.Generator().manual_seed(2)
    q, w, k = torch.randn(1, 6, 2, 4, generator=g), torch.randn(1, 6, 2, generator=g), torch.randn(1, 30, 4, generator=g)
    alone = select_top_k(q, w, k, torch.arange(24, 30), 8, 2, block=4)
    padded_k = torch.cat([torch.randn(1, 3, 4, generator=g), k], dim=1)
    padded = select_top_k(q, w, padded_k, torch.arange(27, 33), 8, 2, starts=torch.tensor([3]), block=4)
    assert torch.equal(padded, torch.where(alone >= 0, alone + 3, alone))
