"""Reference sparse attention (Top-K + window, one softmax, sinks) against an fp64 dense
oracle, and the seed-000 properties of a read over frozen entries:

* the read-out lies in the convex hull of the selected entries (with a sink: of those
  entries and the zero vector) for any query (§5.2);
* its Jacobian w.r.t. the query is the weighted covariance of the entries over sqrt(d)
  (§5.3, finite differences);
* a sink is a gate on the sink-free read: ``o = sigmoid(lse(z) - s) * o_dense`` (seed 004 §1).
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_csa2.model import sparse_attention
from hf_csa2.model.sparse_attention import (TORCH_READ_PATHS, SparseSegment, crop_to_reads, sparse_sink_attention,
                                             window_index)


def random_index(b, t, n, s, seed, empty_rows=True):
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.stack([torch.randperm(s, generator=g)[:n] for _ in range(t)]) for _ in range(b)])
    drop = torch.rand(b, t, n, generator=g) < 0.3
    idx = idx.masked_fill(drop, -1)
    if empty_rows:
        idx[0, 1] = -1  # a query that reads nothing
    return idx


def dense_oracle(segments, scaling, sinks=None):
    """fp64 softmax over the full [T, S] logits of every segment with a boolean mask built from the indices."""
    logits, values = [], []
    for seg in segments:
        q, k, v, idx = (x.double() if x.is_floating_point() else x for x in (seg.query, seg.keys, seg.values, seg.index))
        b, t, h, _ = q.shape
        s, g = k.shape[1], k.shape[2]
        kh = k.repeat_interleave(h // g, dim=2)  # [B, S, H, D]
        z = torch.einsum("bthd,bshd->bths", q, kh) * scaling
        mask = torch.zeros(b, t, s, dtype=torch.bool)
        for bi in range(b):
            for ti in range(t):
                for j in idx[bi, ti]:
                    if j >= 0:
                        mask[bi, ti, j] = True
        logits.append(z.masked_fill(~mask[:, :, None], float("-inf")))
        values.append(v.repeat_interleave(h // v.shape[2], dim=2))
    z = torch.cat(logits, dim=-1)
    if sinks is not None:
        z = torch.cat([z, sinks.double().view(1, 1, -1, 1).expand(*z.shape[:3], 1)], dim=-1)
    p = torch.softmax(z, dim=-1).nan_to_num(0.0)
    if sinks is not None:
        p = p[..., :-1]
    outs, start = [], 0
    for v in values:
        s = v.shape[1]
        outs.append(torch.einsum("bths,bshd->bthd", p[..., start : start + s], v))
        start += s
    return outs


def make_segments(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    b, t, h = 2, 9, 4

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=dtype)

    latent = SparseSegment(r(b, t, h, 7), r(b, 11, 1, 7), r(b, 11, 1, 5), random_index(b, t, 4, 11, seed))
    own = SparseSegment(r(b, t, h, 6), r(b, 8, 2, 6), r(b, 8, 2, 3), random_index(b, t, 3, 8, seed + 1))
    return [latent, own]


@pytest.mark.parametrize("path", TORCH_READ_PATHS)
@pytest.mark.parametrize("with_sinks", [False, True])
def test_matches_dense_fp64_oracle(with_sinks, path):
    segments = make_segments()
    sinks = torch.tensor([0.3, -2.0, 1.5, -1e4]) if with_sinks else None
    outs, _ = sparse_sink_attention(segments, scaling=0.4, sinks=sinks, path=path)
    for got, want in zip(outs, dense_oracle(segments, 0.4, sinks)):
        assert got.shape == want.shape
        assert (got.double() - want).abs().max() <= 1e-5
    assert outs[0][0, 1].abs().max() == 0 and outs[1][0, 1].abs().max() == 0  # row with no entry reads zeros


@pytest.mark.parametrize("path", TORCH_READ_PATHS)
def test_gradients_match_dense_oracle(path):
    segments = make_segments(dtype=torch.float64)
    for seg in segments:
        for x in (seg.query, seg.keys, seg.values):
            x.requires_grad_(True)
    sinks = torch.tensor([0.3, -2.0, 1.5, 0.0], dtype=torch.float64, requires_grad=True)
    outs, _ = sparse_sink_attention(segments, scaling=0.4, sinks=sinks, path=path)
    loss = sum((o * torch.linspace(-1, 1, o.numel(), dtype=o.dtype).view_as(o)).sum() for o in outs)
    grads = torch.autograd.grad(loss, [sinks] + [x for s in segments for x in (s.query, s.keys, s.values)])
    ref = dense_oracle(segments, 0.4, sinks)
    ref_loss = sum((o * torch.linspace(-1, 1, o.numel(), dtype=o.dtype).view_as(o)).sum() for o in ref)
    ref_grads = torch.autograd.grad(ref_loss, [sinks] + [x for s in segments for x in (s.query, s.keys, s.values)])
    for a, b in zip(grads, ref_grads):
        assert torch.allclose(a, b, atol=1e-10)


def test_weights_sum_to_one_minus_sink():
    segments = make_segments()
    sinks = torch.tensor([0.3, -2.0, 1.5, 0.0])
    _, p = sparse_sink_attention(segments, scaling=0.4, sinks=sinks, return_weights=True)
    _, p0 = sparse_sink_attention(segments, scaling=0.4, return_weights=True)
    nonempty = p0.sum(-1) > 0
    assert torch.allclose(p0.sum(-1)[nonempty], torch.ones(()), atol=1e-6)
    assert (p.sum(-1) < p0.sum(-1) + 1e-7).all()


def test_window_index():
    idx = window_index(torch.tensor([0, 1, 5]), 3)
    assert idx.tolist() == [[-1, -1, 0], [-1, 0, 1], [3, 4, 5]]
    # a sliding store whose row 0 is absolute position 3
    assert window_index(torch.tensor([5]), 3, first_position=3).tolist() == [[0, 1, 2]]


# -- seed 000 properties: a read over frozen entries with K = V = c --------------------------


def shared_entry_read(q, entries, index, sinks=None, scaling=None):
    """One head group reading entries c_j as keys AND values: q [1, 1, H, d], entries [1, S, 1, d]."""
    d = entries.shape[-1]
    seg = SparseSegment(q, entries, entries, index)
    (out,), _ = sparse_sink_attention([seg], scaling=scaling or 1 / math.sqrt(d), sinks=sinks)
    return out  # [1, 1, H, d]


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), q_scale=st.floats(0.0, 30.0), with_sink=st.booleans())
def test_readout_lies_in_the_convex_hull_of_selected_entries(seed, q_scale, with_sink):
    """Support-function test: o is in conv(C) iff u.o <= max_j u.c_j for every direction u."""
    g = torch.Generator().manual_seed(seed)
    s, d, h = 12, 5, 3
    entries = torch.randn(1, s, 1, d, generator=g, dtype=torch.float64)
    chosen = torch.randperm(s, generator=g)[:4]
    index = chosen.view(1, 1, 4)
    q = q_scale * torch.randn(1, 1, h, d, generator=g, dtype=torch.float64)
    sinks = torch.randn(h, generator=g, dtype=torch.float64) if with_sink else None
    o = shared_entry_read(q, entries, index, sinks)[0, 0]  # [H, d]
    vertices = entries[0, chosen, 0]  # [4, d]
    if with_sink:
        vertices = torch.cat([vertices, torch.zeros(1, d, dtype=torch.float64)])
    directions = torch.cat([torch.randn(200, d, generator=g, dtype=torch.float64), vertices, -vertices])
    support = (directions @ vertices.T).amax(dim=1)  # [U]
    assert ((o @ directions.T) <= support[None] + 1e-9).all()
    # an entry left out of the index is never read: moving it changes nothing
    moved = entries.clone()
    left_out = [j for j in range(s) if j not in set(chosen.tolist())]
    moved[0, left_out] += 100.0
    assert torch.equal(shared_entry_read(q, moved, index, sinks)[0, 0], o)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000))
def test_query_jacobian_is_entry_covariance_over_sqrt_d(seed):
    """do/dq = Sigma_p / sqrt(d), Sigma_p = sum_j p_j c_j c_j^T - o o^T (finite differences)."""
    g = torch.Generator().manual_seed(seed)
    s, d = 7, 4
    entries = torch.randn(1, s, 1, d, generator=g, dtype=torch.float64)
    index = torch.tensor([[[0, 2, 3, 5, -1]]])
    q = torch.randn(1, 1, 1, d, generator=g, dtype=torch.float64)

    def read(qv):
        return shared_entry_read(qv.view(1, 1, 1, d), entries, index)[0, 0, 0]

    eps = 1e-6
    jac_fd = torch.stack([(read(q.flatten() + eps * e) - read(q.flatten() - eps * e)) / (2 * eps) for e in torch.eye(d, dtype=torch.float64)], dim=1)
    sel = entries[0, [0, 2, 3, 5], 0]  # [4, d]
    p = torch.softmax(sel @ q.flatten() / math.sqrt(d), dim=0)
    o = p @ sel
    sigma = (sel.T * p) @ sel - torch.outer(o, o)
    assert torch.allclose(jac_fd, sigma / math.sqrt(d), atol=1e-7)
    assert torch.allclose(read(q.flatten()), o, atol=1e-12)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000))
def test_sink_is_a_gate_on_the_sparse_read(seed):
    """o_sink = sigmoid(lse(z) - s) * o_no_sink over the same selected entries."""
    segments = make_segments(seed, dtype=torch.float64)
    g = torch.Generator().manual_seed(seed)
    sinks = 3 * torch.randn(4, generator=g, dtype=torch.float64)
    with_sink, _ = sparse_sink_attention(segments, scaling=0.4, sinks=sinks)
    without, _ = sparse_sink_attention(segments, scaling=0.4)
    from hf_csa2.model.sparse_attention import segment_logits

    z = torch.cat([segment_logits(s, 0.4) for s in segments], dim=-1)
    lse = torch.logsumexp(z, dim=-1)  # [B, T, H]
    gate = torch.sigmoid(lse - sinks.view(1, 1, -1)).nan_to_num(0.0)[..., None]
    for a, b in zip(with_sink, without):
        assert torch.allclose(a, gate * b, atol=1e-12)


@pytest.mark.parametrize("path", TORCH_READ_PATHS)
def test_query_blocks_do_not_change_the_result(path):
    segments = make_segments(dtype=torch.float64)
    sinks = torch.tensor([0.3, -2.0, 1.5, 0.0], dtype=torch.float64)
    whole, w1 = sparse_sink_attention(segments, scaling=0.4, sinks=sinks, return_weights=True, path=path)
    blocked, w2 = sparse_sink_attention(segments, scaling=0.4, sinks=sinks, return_weights=True, query_block=4, path=path)
    # gathering is exact per row; the scores path's matmuls may round differently per block shape
    tol = 0.0 if path == "gather" else 1e-13
    for a, b in zip(whole, blocked):
        assert (a - b).abs().max() <= tol
    assert (w1 - w2).abs().max() <= tol


def test_query_block_counts_rows_of_the_whole_batch(monkeypatch):
    """A batch of 2 with query_block=6 reads 3 positions per block (6 query rows), so the gathered
    entries of a block take the same memory whatever the batch size."""
    segments = make_segments(dtype=torch.float64)  # batch 2, 9 positions
    seen = []
    block_read = sparse_attention._sparse_block

    def spy(block, *args):
        seen.append(tuple(block[0].query.shape[:2]))
        return block_read(block, *args)

    monkeypatch.setattr(sparse_attention, "_sparse_block", spy)
    blocked, _ = sparse_sink_attention(segments, scaling=0.4, query_block=6)
    assert seen == [(2, 3)] * 3
    whole, _ = sparse_sink_attention(segments, scaling=0.4)
    for a, b in zip(whole, blocked):
        assert torch.equal(a, b)


def test_read_paths_agree_with_repeated_indices():
    """An entry listed twice is read twice on both paths (the scores path sums its weights)."""
    segments = make_segments(seed=3, dtype=torch.float64)
    for seg in segments:
        seg.index[..., -1] = seg.index[..., 0]
    sinks = torch.tensor([0.3, -2.0, 1.5, 0.0], dtype=torch.float64)
    gathered, w1 = sparse_sink_attention(segments, scaling=0.4, sinks=sinks, return_weights=True)
    scored, w2 = sparse_sink_attention(segments, scaling=0.4, sinks=sinks, return_weights=True, path="scores")
    for a, b in zip(gathered, scored):
        assert (a - b).abs().max() <= 1e-12
    assert (w1 - w2).abs().max() <= 1e-12


def test_unknown_read_path_is_refused():
    with pytest.raises(ValueError, match="path='dense'; allowed: auto, gather, scores, triton"):
        sparse_sink_attention(make_segments(), scaling=0.4, path="dense")


def window_segments(t=40, window=6, first=0, dtype=torch.float64):
    """A prefill of ``t`` queries that read only their last ``window`` positions of a ``t``-row store
    (and its ``first`` rows, where the window does not hold them: attention sinks)."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, t, 4, d, generator=g, dtype=dtype) if i == 0 else torch.randn(1, t, 2, d, generator=g,
               dtype=dtype) for i, d in enumerate((8, 8, 5)))
    positions = torch.arange(t)
    index = window_index(positions, window)
    sinks = torch.arange(first).expand(t, first)
    index = torch.cat([torch.where(sinks <= positions[:, None] - window, sinks, -1), index], -1)
    return [SparseSegment(q, k, v, index[None])]


def test_crop_keeps_only_the_rows_a_block_reads():
    (seg,) = window_segments()
    block = SparseSegment(seg.query[:, 20:30], seg.keys, seg.values, seg.index[:, 20:30])
    cropped = crop_to_reads(block)
    assert cropped.keys.shape[1] == 10 + 6 - 1  # positions 15..29
    assert torch.equal(cropped.keys, seg.keys[:, 15:30]) and torch.equal(cropped.values, seg.values[:, 15:30])
    assert torch.equal(cropped.index + 15, block.index)
    first = crop_to_reads(SparseSegment(seg.query[:, :3], seg.keys, seg.values, seg.index[:, :3]))
    assert first.keys.shape[1] == 3 and (first.index == -1).sum() == 5 + 4 + 3  # -1 (before the start) stays -1
    empty = SparseSegment(seg.query[:, :1], seg.keys, seg.values, torch.full((1, 1, 6), -1))
    assert crop_to_reads(empty).keys.shape[1] == 1
    # a window plus the first 2 tokens kept as sinks: two runs of rows, renumbered in store order
    sinks = torch.tensor([0, 1]).expand(1, 10, 2)
    block = SparseSegment(seg.query[:, 20:30], seg.keys, seg.values, torch.cat([sinks, seg.index[:, 20:30]], -1))
    cropped = crop_to_reads(block)
    rows = torch.tensor([0, 1, *range(15, 30)])
    assert torch.equal(cropped.keys, seg.keys[:, rows]) and torch.equal(cropped.values, seg.values[:, rows])
    assert torch.equal(rows[cropped.index], block.index)


@pytest.mark.parametrize("first", [0, 2])
@pytest.mark.parametrize("path", ["auto", "scores"])
def test_windowed_prefill_in_blocks_reads_cropped_stores_and_matches_the_oracle(path, first, monkeypatch):
    segments = window_segments(first=first)
    for x in (segments[0].query, segments[0].keys, segments[0].values):
        x.requires_grad_(True)
    sinks = torch.tensor([0.3, -2.0, 1.5, 0.0], dtype=torch.float64)
    seen = []
    block_read = sparse_attention._sparse_block

    def spy(block, *args):
        seen.append((args[-1], block[0].keys.shape[1]))
        return block_read(block, *args)

    monkeypatch.setattr(sparse_attention, "_sparse_block", spy)
    (out,), _ = sparse_sink_attention(segments, scaling=0.4, sinks=sinks, query_block=8, path=path)
    # each block of 8 queries reads at most 8 + 6 - 1 rows of the 40 (+ the sinks), so "auto" takes the one-matmul path
    assert seen == [("scores", 8)] + [("scores", 13 + first)] * 4
    (want,) = dense_oracle(segments, 0.4, sinks)
    assert (out - want).abs().max() <= 1e-12
    grads = torch.autograd.grad(out.sum(), [segments[0].query, segments[0].keys, segments[0].values])
    want_grads = torch.autograd.grad(want.sum(), [segments[0].query, segments[0].keys, segments[0].values])
    for a, b in zip(grads, want_grads):
        assert torch.allclose(a, b, atol=1e-10)


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_gather_entries_reads_each_indexed_row_and_routes_its_gradient(batch, layout):
    """Every store layout a layer passes (a contiguous latent, a transposed [B, H, S, D] cache) gives
    row ``index[b, t, n]`` of batch row b (padding -1 reads row 0), and the gradient adds up per row."""
    g = torch.Generator().manual_seed(batch)
    s, groups, d = 10, 2, 3
    base = torch.randn(batch, s, groups, d, generator=g, dtype=torch.float64)
    if layout == "transposed":
        base = base.transpose(1, 2).contiguous()
    base.requires_grad_(True)
    store = base.transpose(1, 2) if layout == "transposed" else base
    assert store.is_contiguous() == (layout == "contiguous")
    index = random_index(batch, 4, 5, s, seed=batch)
    out = sparse_attention.gather_entries(store, index)
    expected = torch.stack([torch.stack([torch.stack([store[bi, max(int(j), 0)] for j in index[bi, ti]])
                                         for ti in range(4)]) for bi in range(batch)])
    assert torch.equal(out, expected)
    weights = torch.randn(out.shape, generator=g, dtype=torch.float64)
    (grad,) = torch.autograd.grad((out * weights).sum(), base)
    (expected_grad,) = torch.autograd.grad((expected * weights).sum(), base)
    assert torch.allclose(grad, expected_grad)


def test_a_cut_longer_than_the_limit_leaves_the_segment_as_it_is():
    (seg,) = window_segments()
    block = SparseSegment(seg.query[:, 20:30], seg.keys, seg.values, seg.index[:, 20:30])
    assert crop_to_reads(block, max_rows=15).keys.shape[1] == 15  # 15 rows read: cut
    assert crop_to_reads(block, max_rows=14) is block  # a cut of 15 rows is not worth its copy


def test_values_that_are_the_keys_leading_columns_are_sliced_from_the_gathered_keys(monkeypatch):
    """An absorbed latent store: keys [latent, 1, rope], values [latent, 1] = a view of the keys' first
    columns. One gather serves both, with the same result as separate values."""
    g = torch.Generator().manual_seed(0)
    store = torch.randn(2, 11, 1, 9, generator=g, dtype=torch.float64)
    query = torch.randn(2, 5, 4, 9, generator=g, dtype=torch.float64)
    index = random_index(2, 5, 4, 11, 0)
    shared = SparseSegment(query, store, store[..., :6], index)
    separate = SparseSegment(query, store, store[..., :6].clone(), index)
    calls = []
    gather = sparse_attention.gather_entries
    monkeypatch.setattr(sparse_attention, "gather_entries", lambda *a: calls.append(1) or gather(*a))
    (a,), _ = sparse_sink_attention([shared], scaling=0.3, path="gather")
    assert len(calls) == 1
    (b,), _ = sparse_sink_attention([separate], scaling=0.3, path="gather")
    assert len(calls) == 3 and torch.equal(a, b)
