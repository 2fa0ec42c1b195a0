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
