"""Triton indexer scores (hf_csa2.kernels.indexer) against the torch reference
(hf_csa2.model.indexer.masked_scores / select_top_k): scores, the -inf pattern, every gradient
(queries, head weights, keys) and the Top-K picks (torch on the kernel's scores, and the fused Top-K kernel), on awkward sizes -- T in {1, 63, 257},
decode chunks (S > T), S < K, left-padding starts, one index head or several.

Runs in Triton's CPU interpreter (tests/kernels/conftest.py sets TRITON_INTERPRET=1).
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton defines the kernels (see conftest.py)

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from hf_csa2 import kernels  # noqa: E402
from hf_csa2.kernels.indexer import fused_select_top_k, masked_index_scores  # noqa: E402
from hf_csa2.model.indexer import Indexer, masked_scores, select_top_k  # noqa: E402

DEVICE = "cpu" if kernels.interpreting() else "cuda"

pytestmark = pytest.mark.skipif(not kernels.available(), reason="no CUDA device and TRITON_INTERPRET is off")


def inputs(seed, b, t, s, heads, dim, dtype=torch.float32):
    """Queries scaled so a score is O(1): N(0, 1) dots over ``dim`` dims, averaged over heads."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, t, heads, dim, generator=gen) / dim ** 0.5
    w = torch.randn(b, t, heads, generator=gen) / heads ** 0.5
    k = torch.randn(b, s, dim, generator=gen)
    positions = torch.arange(s - t, s)
    return [x.to(device=DEVICE, dtype=dtype) for x in (q, w, k)] + [positions.to(DEVICE)]


def compare(q, w, k, positions, window, starts=None):
    """Max |kernel - reference| of the finite scores and of each gradient of a random linear loss
    over them; asserts both give -inf at the same places."""
    leaves = [x.detach().clone().requires_grad_(True) for x in (q, w, k)]
    got = masked_index_scores(*leaves, positions, window, starts)
    ref_leaves = [x.detach().clone().requires_grad_(True) for x in (q, w, k)]
    want = masked_scores(*ref_leaves, positions, window, starts)
    assert got.dtype == torch.float32 and got.shape == want.shape
    finite = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), finite)
    assert not torch.isnan(got).any()
    forward = (got[finite] - want[finite]).abs().max().item() if finite.any() else 0.0
    gen = torch.Generator().manual_seed(7)
    upstream = torch.randn(want.shape, generator=gen).to(DEVICE)
    got_grads = torch.autograd.grad(got.masked_fill(~finite, 0).mul(upstream).sum(), leaves, allow_unused=True)
    want_grads = torch.autograd.grad(want.masked_fill(~finite, 0).mul(upstream).sum(), ref_leaves, allow_unused=True)
    grads = {}
    for name, a, b_ in zip(("queries", "weights", "keys"), got_grads, want_grads):
        b_ = torch.zeros_like(a) if b_ is None else b_
        assert a.dtype == b_.dtype and a.shape == b_.shape, name
        grads[name] = (a - b_).abs().max().item()
    return forward, grads


@pytest.mark.parametrize("t", [1, 63, 257])
@pytest.mark.parametrize("heads, dim", [(1, 8), (4, 20)])
def test_prefill_scores_and_gradients_match_the_reference(t, heads, dim):
    q, w, k, positions = inputs(t + heads, 1, t, t, heads, dim)
    forward, grads = compare(q, w, k, positions, window=3)
    assert forward <= 1e-5
    assert max(grads.values()) <= 1e-4, grads


@pytest.mark.parametrize("t, s", [(1, 300), (5, 130), (63, 64)])
def test_decode_chunks_and_batches_match_the_reference(t, s):
    q, w, k, positions = inputs(s, 2, t, s, 3, 16)
    starts = torch.tensor([0, min(40, s - 1)], device=DEVICE)
    forward, grads = compare(q, w, k, positions, window=8, starts=starts)
    assert forward <= 1e-5
    assert max(grads.values()) <= 1e-4, grads


def test_nothing_selectable_gives_minus_infinity_and_zero_gradients():
    # window longer than the prefix: no query may pick anything
    q, w, k, positions = inputs(0, 1, 9, 9, 2, 16)
    leaves = [x.requires_grad_(True) for x in (q, w, k)]
    scores = masked_index_scores(*leaves, positions, 16)
    assert torch.isneginf(scores).all()
    grads = torch.autograd.grad(scores.masked_fill(torch.isneginf(scores), 0).sum(), leaves)
    assert all(torch.count_nonzero(g) == 0 for g in grads)


def test_left_padding_is_never_selectable():
    q, w, k, positions = inputs(1, 2, 40, 40, 2, 16)
    starts = torch.tensor([0, 25], device=DEVICE)
    scores = masked_index_scores(q, w, k, positions, 1, starts)
    assert torch.isneginf(scores[1, :, :25]).all()
    assert torch.isfinite(scores[1, 26:, 25]).all()  # the first real position, for queries past it


def test_fp16_inputs_give_the_fp32_scores_of_the_same_values():
    q, w, k, positions = inputs(2, 1, 63, 63, 4, 16, dtype=torch.float16)
    got = masked_index_scores(q, w, k, positions, 2)
    want = masked_scores(q, w, k, positions, 2)  # the reference upcasts to fp32 too
    finite = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), finite)
    assert (got[finite] - want[finite]).abs().max() <= 1e-5


@pytest.mark.parametrize("t, s, top_k", [(1, 300, 16), (63, 63, 8), (20, 12, 16), (257, 257, 32)])
def test_top_k_picks_equal_the_references(t, s, top_k):
    q, w, k, positions = inputs(t + s, 2, t, s, 4, 16)
    starts = torch.tensor([0, 3], device=DEVICE)
    got = select_top_k(q, w, k, positions, top_k, 4, chunk=64, starts=starts, scores=masked_index_scores)
    want = select_top_k(q, w, k, positions, top_k, 4, chunk=64, starts=starts)
    assert got.shape == (2, t, top_k)
    assert torch.equal(got, want)
    assert (got == -1).any() or s - t > top_k  # short prefixes pad with -1


def test_relu_ties_break_to_the_earlier_position_as_in_the_reference():
    # every dot negative for half the keys: their scores are exact zeros, ordered by position
    q, w, k, positions = inputs(3, 1, 30, 30, 1, 16)
    w = w.abs()
    k[:, ::2] = -q[0, -1, 0] * 10  # the last query's dots with even keys are negative
    got = select_top_k(q, w, k, positions, 20, 1, scores=masked_index_scores)
    want = select_top_k(q, w, k, positions, 20, 1)
    assert torch.equal(got, want)


def test_indexer_module_fused_path_selects_what_the_reference_does():
    torch.manual_seed(0)
    indexer = Indexer(32, 4, 16, [0, 1], rotary_dim=8, with_key=True).to(DEVICE)
    x = torch.randn(1, 50, 32, device=DEVICE)
    cos, sin = torch.ones(1, 50, 8, device=DEVICE), torch.zeros(1, 50, 8, device=DEVICE)
    keys = indexer.keys(x, (cos, sin))
    iq, iw = indexer.queries(x, (cos, sin))
    positions = torch.arange(50, device=DEVICE)
    with torch.no_grad():
        assert torch.equal(indexer.select(iq, iw, keys, positions, 8, 4, fused=True),
                           indexer.select(iq, iw, keys, positions, 8, 4))


def test_bad_shapes_name_the_argument():
    q, w, k, positions = inputs(0, 1, 5, 9, 2, 16)
    with pytest.raises(ValueError, match=r"weights \(1, 5\)"):
        masked_index_scores(q, w[..., 0], k, positions, 1)
    with pytest.raises(ValueError, match=r"keys \(1, 9, 8\)"):
        masked_index_scores(q, w, k[..., :8], positions, 1)
    with pytest.raises(ValueError, match="query_positions"):
        masked_index_scores(q, w, k, positions[:3], 1)


def test_refused_where_the_kernel_cannot_run(monkeypatch):
    import hf_csa2.kernels as package

    monkeypatch.setattr(package, "available", lambda: False)
    q, w, k, positions = inputs(0, 1, 5, 9, 2, 16)
    with pytest.raises(kernels.KernelUnavailableError, match="hf_csa2.model.indexer.masked_scores"):
        masked_index_scores(q, w, k, positions, 1)


def integer_inputs(seed, b, t, s, heads, dim):
    """Small integers: every dot, ReLU and head sum is exact in fp32, so kernel and torch scores
    are bit-equal and the picks (many exact ties among them) must be too."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-2, 3, (b, t, heads, dim), generator=gen).float()
    w = torch.randint(-2, 3, (b, t, heads), generator=gen).float()
    k = torch.randint(-2, 3, (b, s, dim), generator=gen).float()
    return [x.to(DEVICE) for x in (q, w, k)] + [torch.arange(s - t, s).to(DEVICE)]


@pytest.mark.parametrize("t, s, top_k", [(1, 300, 16), (63, 63, 8), (20, 12, 16), (40, 100, 12), (257, 257, 32)])
def test_fused_top_k_equals_the_selection_on_the_kernels_scores(t, s, top_k):
    q, w, k, positions = inputs(t + s + top_k, 2, t, s, 3, 16)
    starts = torch.tensor([0, 5], device=DEVICE)
    got = fused_select_top_k(q, w, k, positions, top_k, 4, starts)
    want = select_top_k(q, w, k, positions, top_k, 4, chunk=64, starts=starts, scores=masked_index_scores)
    assert got.dtype == torch.long and got.shape == (2, t, top_k)
    assert torch.equal(got, want)
    assert (got[1] < 5).logical_and(got[1] >= 0).sum() == 0  # left padding never picked


@pytest.mark.parametrize("window", [1, 6])
def test_fused_top_k_breaks_exact_ties_as_the_torch_reference(window):
    q, w, k, positions = integer_inputs(window, 2, 37, 80, 2, 16)
    starts = torch.tensor([0, 9], device=DEVICE)
    scores = masked_scores(q, w, k, positions, window, starts)
    finite = scores[torch.isfinite(scores)]
    assert finite.numel() > finite.unique().numel() * 4  # ties are the rule here, not the exception
    got = fused_select_top_k(q, w, k, positions, 24, window, starts)
    assert torch.equal(got, select_top_k(q, w, k, positions, 24, window, starts=starts))


def test_fused_top_k_rows_with_nothing_selectable_are_all_minus_one():
    q, w, k, positions = inputs(4, 1, 9, 9, 2, 16)
    assert torch.equal(fused_select_top_k(q, w, k, positions, 4, 16), torch.full((1, 9, 4), -1, device=DEVICE))
    # one selectable key: the first query past the window picks it, the rest of its row is -1
    got = fused_select_top_k(q, w, k, positions, 4, 8)
    assert got[0, 8].tolist() == [0, -1, -1, -1] and (got[0, :8] == -1).all()


def test_fused_top_k_refuses_a_k_below_one():
    q, w, k, positions = inputs(5, 1, 4, 4, 1, 16)
    with pytest.raises(ValueError, match="top_k is 0"):
        fused_select_top_k(q, w, k, positions, 0, 1)


def test_fused_block_selection_is_the_torch_block_pick_on_the_kernels_scores():
    torch.manual_seed(1)
    indexer = Indexer(32, 4, 16, [0, 1], rotary_dim=8, with_key=True).to(DEVICE)
    x = torch.randn(2, 40, 32, device=DEVICE)
    cos, sin = torch.ones(2, 40, 8, device=DEVICE), torch.zeros(2, 40, 8, device=DEVICE)
    keys = indexer.keys(x, (cos, sin))
    iq, iw = indexer.queries(x, (cos, sin))
    positions, starts = torch.arange(40, device=DEVICE), torch.tensor([0, 7], device=DEVICE)
    with torch.no_grad():
        got = indexer.select(iq, iw, keys, positions, 8, 3, starts=starts, fused=True, block=4)
        want = select_top_k(iq, iw, keys, positions, 8, 3, starts=starts, scores=masked_index_scores, block=4)
        token = indexer.select(iq, iw, keys, positions, 8, 3, starts=starts, fused=True)
    assert torch.equal(got, want)
    assert not torch.equal(got, token)
