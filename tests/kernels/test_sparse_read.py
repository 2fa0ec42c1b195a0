"""Triton sparse read (hf_csa2.kernels.sparse_read) against its torch reference
(hf_csa2.model.sparse_attention): forward and every gradient (queries, keys, values of each
segment, sinks) to 1e-4 in fp32 on awkward sizes -- T in {1, 63, 257}, -1 padding, rows with no
entry, G in {1, H} and G != G', sinks on and off, two segments merged, repeated entries.

Runs in Triton's CPU interpreter (tests/kernels/conftest.py sets TRITON_INTERPRET=1), which
costs ~10 ms per program on a busy CPU: sizes stay small (B = 1, H = 4, D <= 16, N <= 40).
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton defines the kernels (see conftest.py)

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from hf_csa2 import kernels  # noqa: E402
from hf_csa2.kernels import KernelUnavailableError  # noqa: E402
from hf_csa2.kernels.sparse_read import merge_segments, sparse_read, sparse_sink_attention  # noqa: E402
from hf_csa2.model import sparse_attention as reference  # noqa: E402
from hf_csa2.model.sparse_attention import SparseSegment, segment_logits, window_index  # noqa: E402

DEVICE = "cpu" if kernels.interpreting() else "cuda"
H = 4
TOL = 1e-4  # fp32, absolute; inputs ~N(0, 1), logits O(1)
FP16_TOL = 2e-3  # one fp16 ulp at |x| < 4: both sides round the same fp32 read
BF16_TOL = 1.6e-2  # one bf16 ulp at |x| < 4

pytestmark = pytest.mark.skipif(not kernels.available(), reason="no CUDA device and TRITON_INTERPRET is off")


def rand(gen, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=gen).to(device=DEVICE, dtype=dtype)


def random_index(gen, t, n, s, empty_rows=(), pad=0.3):
    """[1, T, N] rows of [0, S) (repeats allowed), a fraction ``pad`` set to -1, ``empty_rows`` all -1."""
    idx = torch.randint(0, s, (1, t, n), generator=gen)
    idx = idx.masked_fill(torch.rand(1, t, n, generator=gen) < pad, -1)
    for row in empty_rows:
        if row < t:
            idx[0, row] = -1
    return idx.to(DEVICE)


def awkward_empty_rows(t):
    """A few rows with no entry at all (never the only row: the T = 1 cases read something)."""
    return (1, t // 2, t - 1) if t > 2 else ()


def segment(gen, t, *, s, n, g, g_v, d_k, d_v, dtype=torch.float32, index=None):
    return SparseSegment(rand(gen, 1, t, H, d_k, dtype=dtype), rand(gen, 1, s, g, d_k, dtype=dtype),
                         rand(gen, 1, s, g_v, d_v, dtype=dtype),
                         random_index(gen, t, n, s, awkward_empty_rows(t)) if index is None else index)


def leaves(segments, sinks):
    xs = [x for seg in segments for x in (seg.query, seg.keys, seg.values)]
    return xs + ([sinks] if sinks is not None else [])


def compare(segments, sinks=None, scaling=0.25, tol=TOL):
    """Kernel vs reference: outputs and every gradient of a random linear loss. Returns the max
    absolute errors {"forward": ..., "grad": ...} (and asserts they are within ``tol``)."""
    xs = leaves(segments, sinks)
    for x in xs:
        x.requires_grad_(True)
    got, got_w = sparse_sink_attention(segments, scaling=scaling, sinks=sinks)
    want, _ = reference.sparse_sink_attention(segments, scaling=scaling, sinks=sinks)
    assert got_w is None
    gen = torch.Generator().manual_seed(123)
    upstream = [torch.randn(w.shape, generator=gen).to(w) for w in want]
    got_grads = torch.autograd.grad(sum((o * u).sum() for o, u in zip(got, upstream)), xs)
    want_grads = torch.autograd.grad(sum((o * u).sum() for o, u in zip(want, upstream)), xs)

    forward = max((a.float() - b.float()).abs().max().item() for a, b in zip(got, want))
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.dtype == b.dtype
    assert all(torch.isfinite(gr).all() for gr in got_grads)
    grad = max((a.float() - b.float()).abs().max().item() for a, b in zip(got_grads, want_grads))
    assert forward <= tol, f"forward error {forward}"
    assert grad <= tol, f"gradient error {grad} (per leaf: " \
        f"{[round((a - b).abs().max().item(), 8) for a, b in zip(got_grads, want_grads)]})"
    return {"forward": forward, "grad": grad}


def sink_logits(seed):
    return torch.tensor([0.5, -1.0, 2.0, -30.0], device=DEVICE) + 0.1 * seed


# -- one segment -----------------------------------------------------------------------------

def one_segment_cases():
    """T x G x sinks; two of the four T = 257 cases are enough for the quick run."""
    for t in (1, 63, 257):
        for groups in (1, H):
            for with_sinks in (False, True):
                slow = t == 257 and (groups, with_sinks) not in {(1, False), (H, True)}
                yield pytest.param(t, groups, with_sinks, id=f"T{t}-G{groups}-{'sink' if with_sinks else 'nosink'}",
                                   marks=[pytest.mark.slow] if slow else [])


@pytest.mark.parametrize("t,groups,with_sinks", list(one_segment_cases()))
def test_one_segment_matches_reference(t, groups, with_sinks):
    gen = torch.Generator().manual_seed(t + groups)
    seg = segment(gen, t, s=37, n=20, g=groups, g_v=groups, d_k=16, d_v=16)
    compare([seg], sink_logits(t) if with_sinks else None)


@pytest.mark.parametrize("groups,value_groups,h_size", [(2, 1, 4), (2, 3, 6), (3, 2, 6)])
def test_key_and_value_groups_differ(groups, value_groups, h_size):
    """G != G' (a head block is the heads sharing both groups: gcd(H / G, H / G') of them);
    odd head dims (Dk = 5, Dv = 3) pad to the 16-wide tiles."""
    gen = torch.Generator().manual_seed(groups * 10 + value_groups)
    seg = SparseSegment(rand(gen, 1, 9, h_size, 5), rand(gen, 1, 11, groups, 5), rand(gen, 1, 11, value_groups, 3),
                        random_index(gen, 9, 6, 11, empty_rows=(2,)))
    compare([seg], torch.linspace(-1, 1, h_size, device=DEVICE))


def test_several_entry_blocks_and_lse():
    """N = 40 read 16 at a time (three blocks, the last partial) through the one-segment op:
    o and lse against the reference's logits, with gradients flowing through both."""
    gen = torch.Generator().manual_seed(7)
    seg = segment(gen, 17, s=50, n=40, g=1, g_v=1, d_k=16, d_v=8)
    for x in (seg.query, seg.keys, seg.values):
        x.requires_grad_(True)
    o, lse = sparse_read(seg.query, seg.keys, seg.values, seg.index, 0.25, block_n=16)

    z = segment_logits(seg, 0.25)  # [1, T, H, N], -inf at padding
    peak = z.amax(-1, keepdim=True).detach()
    peak = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
    mass = torch.exp(z - peak).sum(-1)
    want_lse = torch.where(mass > 0, peak[..., 0] + torch.log(mass.clamp_min(1e-30)), torch.full_like(mass, -torch.inf))
    (want_o,), _ = reference.sparse_sink_attention([seg], scaling=0.25)

    empty = (seg.index < 0).all(-1)[..., None].expand_as(lse)
    assert empty.any() and torch.isneginf(lse[empty]).all() and (o[empty] == 0).all()
    assert (o - want_o).abs().max() <= TOL
    assert (lse[~empty] - want_lse[~empty]).abs().max() <= TOL

    gen = torch.Generator().manual_seed(0)
    u_o, u_lse = torch.randn(o.shape, generator=gen).to(o), torch.randn(lse.shape, generator=gen).to(lse)
    xs = [seg.query, seg.keys, seg.values]
    got = torch.autograd.grad((o * u_o).sum() + (torch.where(empty, 0.0, lse) * u_lse).sum(), xs)
    want = torch.autograd.grad((want_o * u_o).sum() + (torch.where(empty, 0.0, want_lse) * u_lse).sum(), xs)
    for a, b in zip(got, want):
        assert torch.isfinite(a).all() and (a - b).abs().max() <= TOL


def test_non_contiguous_inputs():
    """Strided views (a [B, H, T, D] query transposed, every other store row) read as the copies would."""
    gen = torch.Generator().manual_seed(3)
    query = rand(gen, 1, H, 12, 16).transpose(1, 2)
    keys = rand(gen, 1, 40, H, 16)[:, ::2]
    values = rand(gen, 1, 20, H, 24)[..., 4:20]
    seg = SparseSegment(query, keys, values, random_index(gen, 12, 9, 20, empty_rows=(5,)))
    assert not (query.is_contiguous() or keys.is_contiguous() or values.is_contiguous())
    compare([seg], sink_logits(0))


# -- two segments: latent (G = 1) + own window (G = H, another Dk) -----------------------------


def latent_and_window(t, seed):
    gen = torch.Generator().manual_seed(seed)
    latent = segment(gen, t, s=41, n=12, g=1, g_v=1, d_k=16, d_v=16)
    window = window_index(torch.arange(t, device=DEVICE), 8)[None]  # -1 before the start of the store
    own = segment(gen, t, s=t, n=8, g=H, g_v=H, d_k=8, d_v=12, index=window)
    return [latent, own]


@pytest.mark.parametrize("with_sinks", [False, True], ids=["nosink", "sink"])
@pytest.mark.parametrize("t", [1, 63])
def test_two_segments_merge_into_one_softmax(t, with_sinks):
    compare(latent_and_window(t, seed=t), sink_logits(1) if with_sinks else None)


def test_two_segments_257_queries():
    compare(latent_and_window(257, seed=257), sink_logits(2))


@pytest.mark.slow
def test_two_segments_257_queries_no_sink():
    compare(latent_and_window(257, seed=258))


# -- rows with no entry -----------------------------------------------------------------------


@pytest.mark.parametrize("with_sinks", [False, True], ids=["nosink", "sink"])
def test_rows_with_no_entry_read_zeros_with_finite_gradients(with_sinks):
    """Whole segments with no entry (and all segments empty on some rows): zeros, no NaN in
    either pass, gradients as the reference's."""
    segments = latent_and_window(6, seed=11)
    segments[0].index[:] = -1  # the latent segment reads nothing at all
    segments[1].index[0, 2:4] = -1  # rows 2, 3 read nothing from either segment
    sinks = sink_logits(3) if with_sinks else None
    compare(segments, sinks)
    outs, _ = sparse_sink_attention(segments, scaling=0.25, sinks=sinks)
    assert (outs[0] == 0).all() and (outs[1][0, 2:4] == 0).all()
    assert all(torch.isfinite(o).all() for o in outs)


def test_merge_guards_all_empty_rows():
    """The torch merge alone: all -inf (and sink -inf) rows give zeros and zero, finite gradients."""
    lses = [torch.full((1, 2, H), -torch.inf, requires_grad=True), torch.tensor([[[0.0] * H, [-torch.inf] * H]], requires_grad=True)]
    outs = [torch.zeros(1, 2, H, 3, requires_grad=True), torch.ones(1, 2, H, 5, requires_grad=True)]
    sinks = torch.tensor([-torch.inf, 0.0, 1.0, -torch.inf], requires_grad=True)
    merged, lse_total = merge_segments(outs, lses, sinks)
    assert torch.isneginf(lse_total[0, 1, [0, 3]]).all()
    assert torch.allclose(merged[1][0, 0, :, 0], torch.sigmoid(-torch.tensor([-torch.inf, 0.0, 1.0, -torch.inf])))
    assert (merged[1][0, 1] == 0).all()
    grads = torch.autograd.grad(sum(m.sum() for m in merged) + lse_total.clamp_min(-5).sum(), lses + outs + [sinks])
    assert all(torch.isfinite(g).all() for g in grads)


# -- repeated entries: dk / dv add up over queries and within one list -------------------------


def test_repeated_entries_accumulate_key_and_value_gradients_by_hand():
    """Every query reads row 3 only (twice per list, amid padding), no sink: o = v[3] for every
    head, so dv[3] = sum over queries and heads of dO, and dk = dq = 0 (the weights cannot move)."""
    gen = torch.Generator().manual_seed(5)
    t, s = 10, 6
    index = torch.tensor([3, -1, 3, -1, -1]).expand(1, t, 5).contiguous().to(DEVICE)
    seg = SparseSegment(rand(gen, 1, t, H, 16), rand(gen, 1, s, 1, 16), rand(gen, 1, s, 1, 8), index)
    for x in (seg.query, seg.keys, seg.values):
        x.requires_grad_(True)
    (out,), _ = sparse_sink_attention([seg], scaling=0.25)
    assert torch.allclose(out, seg.values[0, 3, 0].expand_as(out), atol=1e-6)
    upstream = torch.randn(out.shape, generator=gen).to(out)
    dq, dk, dv = torch.autograd.grad((out * upstream).sum(), [seg.query, seg.keys, seg.values])
    want_dv = torch.zeros_like(dv)
    want_dv[0, 3, 0] = upstream.sum(dim=(0, 1, 2))
    assert (dv - want_dv).abs().max() <= TOL
    assert dk.abs().max() <= TOL and dq.abs().max() <= TOL


@pytest.mark.parametrize("groups", [1, H], ids=["G1", "GH"])
def test_repeated_entries_across_queries_match_reference(groups):
    """A 5-row store read by 63 queries through 12-entry lists: every row is hit many times."""
    gen = torch.Generator().manual_seed(groups)
    seg = segment(gen, 63, s=5, n=12, g=groups, g_v=groups, d_k=16, d_v=16)
    compare([seg], sink_logits(4))


# -- half precision ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,tol", [(torch.float16, FP16_TOL), (torch.bfloat16, BF16_TOL)], ids=["fp16", "bf16"])
def test_half_precision_forward(dtype, tol):
    """Both sides compute in fp32 and round the read to the input dtype: at most one ulp apart."""
    segments = latent_and_window(33, seed=9)
    segments = [SparseSegment(s.query.to(dtype), s.keys.to(dtype), s.values.to(dtype), s.index) for s in segments]
    got, _ = sparse_sink_attention(segments, scaling=0.25, sinks=sink_logits(5))
    want, _ = reference.sparse_sink_attention(segments, scaling=0.25, sinks=sink_logits(5))
    for a, b in zip(got, want):
        assert a.dtype == dtype
        assert (a.float() - b.float()).abs().max() <= tol


def test_fp16_gradients():
    """Gradients come back in fp16 (fp32 buffers cast at the end); within a few fp16 ulps."""
    segments = latent_and_window(17, seed=10)
    segments = [SparseSegment(s.query.half(), s.keys.half(), s.values.half(), s.index) for s in segments]
    compare(segments, sink_logits(6), tol=1e-2)


# -- contract ----------------------------------------------------------------------------------


def test_return_weights_points_to_the_reference():
    seg = latent_and_window(3, seed=0)[:1]
    with pytest.raises(ValueError, match="hf_csa2.model.sparse_attention"):
        sparse_sink_attention(seg, scaling=0.25, return_weights=True)
    with pytest.raises(ValueError, match="allowed: gather, scores"):
        sparse_sink_attention(seg, scaling=0.25, path="dense")
    (a,), _ = sparse_sink_attention(seg, scaling=0.25, path="scores", query_block=2)
    (b,), _ = sparse_sink_attention(seg, scaling=0.25)
    assert torch.equal(a, b)


def test_bad_shapes_are_refused():
    gen = torch.Generator().manual_seed(0)
    q, idx = rand(gen, 1, 3, H, 8), random_index(gen, 3, 4, 6)
    with pytest.raises(ValueError, match="G dividing 4"):
        sparse_sink_attention([SparseSegment(q, rand(gen, 1, 6, 3, 8), rand(gen, 1, 6, 1, 8), idx)], scaling=1.0)
    with pytest.raises(ValueError, match="float64"):
        sparse_sink_attention([SparseSegment(q.double(), rand(gen, 1, 6, 1, 8).double(), rand(gen, 1, 6, 1, 8).double(), idx)],
                              scaling=1.0)


def test_unavailable_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not kernels.available()
    with pytest.raises(KernelUnavailableError, match="hf_csa2.model.sparse_attention"):
        sparse_sink_attention(latent_and_window(3, seed=0), scaling=0.25)


def test_read_paths_are_the_references():
    from hf_csa2.kernels.sparse_read import READ_PATHS

    assert READ_PATHS == reference.TORCH_READ_PATHS

