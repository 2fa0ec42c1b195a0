"""Sink attention ops against an fp64 oracle, and the seed-004 sink identities."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_csa2.model.sink_attention import eager_sink_attention, grouped_decode_attention, sdpa_sink_attention


def oracle(q, k, v, allowed, scale, sinks):
    """fp64, one query row at a time, sink as an extra zero-value slot."""
    b, hq, t, d = q.shape
    g = hq // k.shape[1]
    out = torch.zeros(b, t, hq, v.shape[-1], dtype=torch.float64)
    for bi in range(b):
        for h in range(hq):
            for i in range(t):
                idx = allowed[min(bi, allowed.shape[0] - 1), 0, i].nonzero().flatten()
                z = [(q[bi, h, i].double() @ k[bi, h // g, j].double()).item() * scale for j in idx]
                if sinks is not None:
                    z.append(float(sinks[h]))
                if not z:
                    continue
                m = max(z)
                e = [math.exp(x - m) for x in z]
                den = sum(e)
                for n, j in enumerate(idx):
                    out[bi, i, h] += e[n] / den * v[bi, h // g, j].double()
    return out


def random_case(b, t, s, hq, h, d, seed, empty_row=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, t, d, generator=g)
    k = torch.randn(b, h, s, d, generator=g)
    v = torch.randn(b, h, s, d, generator=g)
    allowed = torch.rand(b, 1, t, s, generator=g) < 0.7
    if empty_row:
        allowed[0, 0, 0] = False
    sinks = torch.randn(hq, generator=g) * 2
    return q, k, v, allowed, sinks


@pytest.mark.parametrize("impl", [eager_sink_attention, sdpa_sink_attention])
@pytest.mark.parametrize("with_sinks", [True, False])
def test_matches_fp64_oracle_awkward_sizes(impl, with_sinks):
    q, k, v, allowed, sinks = random_case(2, 9, 11, 6, 3, 10, seed=1, empty_row=True)
    sinks = sinks if with_sinks else None
    out, _ = impl(q, k, v, allowed, scaling=0.3, sinks=sinks)
    ref = oracle(q, k, v, allowed, 0.3, sinks)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("impl", [eager_sink_attention, sdpa_sink_attention])
def test_none_mask_is_bottom_right_causal(impl):
    q, k, v, _, sinks = random_case(1, 4, 9, 2, 1, 8, seed=2)
    causal = (torch.arange(9)[None, :] <= torch.arange(5, 9)[:, None])[None, None]
    out, _ = impl(q, k, v, None, scaling=0.5, sinks=sinks)
    ref, _ = impl(q, k, v, causal, scaling=0.5, sinks=sinks)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)


def test_additive_float_mask_equals_bool_mask():
    q, k, v, allowed, sinks = random_case(2, 5, 5, 4, 2, 8, seed=3)
    additive = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    a, _ = eager_sink_attention(q, k, v, allowed, scaling=0.4, sinks=sinks)
    b, _ = eager_sink_attention(q, k, v, additive, scaling=0.4, sinks=sinks)
    torch.testing.assert_close(a, b)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    t=st.integers(1, 7),
    s=st.integers(1, 9),
    sink=st.floats(-8, 8),
)
def test_sink_identity(seed, t, s, sink):
    """Seed 004 §4-5: real weights sum to Z/(Z+e^s); ratios unchanged; out = g * out_dense."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 1, t, 8, generator=g, dtype=torch.float64)
    k = torch.randn(1, 1, s, 8, generator=g, dtype=torch.float64)
    v = torch.randn(1, 1, s, 8, generator=g, dtype=torch.float64)
    allowed = torch.ones(1, 1, t, s, dtype=torch.bool)
    sinks = torch.tensor([sink], dtype=torch.float64)
    out, w = eager_sink_attention(q, k, v, allowed, scaling=0.35, sinks=sinks)
    dense_out, dense_w = eager_sink_attention(q, k, v, allowed, scaling=0.35, sinks=None)
    z = (q @ k.transpose(-1, -2)) * 0.35  # [1, 1, T, S]
    big_z = torch.exp(z.double()).sum(-1)  # Z per row
    gate = big_z / (big_z + math.exp(sink))
    torch.testing.assert_close(w.sum(-1), gate.to(w.dtype), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(w / w.sum(-1, keepdim=True), dense_w, atol=1e-6, rtol=1e-6)  # relative weights
    gate_sigmoid = torch.sigmoid(torch.logsumexp(z, -1) - sink)  # g = sigma(lse - s)
    torch.testing.assert_close(out, dense_out * gate_sigmoid.transpose(1, 2)[..., None].to(out.dtype), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("impl", [eager_sink_attention, sdpa_sink_attention])
def test_sink_gradient_matches_finite_differences(impl):
    """ds from autograd equals the central difference of a scalar loss (seed 004: ds = -sum a_sink (...))."""
    q, k, v, allowed, _ = random_case(1, 5, 6, 2, 1, 8, seed=4)
    q, k, v = q.double(), k.double(), v.double()
    sinks = torch.tensor([0.3, -0.7], dtype=torch.float64, requires_grad=True)
    weight = torch.randn(1, 5, 2, 8, dtype=torch.float64)
    loss = (impl(q, k, v, allowed, scaling=0.5, sinks=sinks)[0] * weight).sum()
    (grad,) = torch.autograd.grad(loss, sinks)
    eps = 1e-6
    for h in range(2):
        plus, minus = sinks.detach().clone(), sinks.detach().clone()
        plus[h] += eps
        minus[h] -= eps
        fd = ((impl(q, k, v, allowed, scaling=0.5, sinks=plus)[0] * weight).sum()
              - (impl(q, k, v, allowed, scaling=0.5, sinks=minus)[0] * weight).sum()) / (2 * eps)
        assert abs(fd.item() - grad[h].item()) < 1e-6


def test_very_negative_sink_is_exactly_dense():
    q, k, v, allowed, _ = random_case(2, 6, 6, 4, 2, 8, seed=5)
    sinks = torch.full((4,), -1e4)
    for impl in (eager_sink_attention, sdpa_sink_attention):
        a, _ = impl(q, k, v, allowed, scaling=0.3, sinks=sinks)
        b, _ = impl(q, k, v, allowed, scaling=0.3, sinks=None)
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("value_dim", [10, 6, 13])
@pytest.mark.parametrize("case", ["masked", "causal", "decode"])
def test_one_call_cpu_gate_equals_the_two_call_gate_and_the_oracle(case, value_dim):
    """Without gradients on CPU the sink gate comes from the fused call's logsumexp; with them, from
    a second call with the sink as a virtual key. Both are the oracle's read, empty rows zeros, also
    when values are narrower or wider than queries (MLA's explicit path)."""
    t, s = {"masked": (9, 11), "causal": (7, 7), "decode": (1, 12)}[case]
    q, k, v, allowed, sinks = random_case(2, t, s, 6, 3, 10, seed=7, empty_row=case == "masked")
    v = torch.randn(*v.shape[:-1], value_dim, generator=torch.Generator().manual_seed(8))
    mask = allowed if case == "masked" else None
    one, _ = sdpa_sink_attention(q, k, v, mask, scaling=0.3, sinks=sinks)
    two, _ = sdpa_sink_attention(q.clone().requires_grad_(True), k, v, mask, scaling=0.3, sinks=sinks)
    ref = oracle(q, k, v, allowed if mask is not None else
                 (torch.arange(s)[None, :] <= torch.arange(s - t, s)[:, None])[None, None], 0.3, sinks)
    torch.testing.assert_close(one.double(), ref, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(two.detach().double(), ref, atol=2e-5, rtol=2e-5)
    if case == "masked":
        assert torch.all(one[0, 0] == 0)


@pytest.mark.parametrize("kv_heads", [1, 2, 6])
@pytest.mark.parametrize("mask", ["none", "bool", "additive", "empty"])
@pytest.mark.parametrize("with_sinks", [True, False])
def test_decode_step_reads_per_kv_head_and_matches_the_oracle(kv_heads, mask, with_sinks):
    """One query position without gradients: one matmul per KV head group (no key repeated per query
    head) gives the oracle's read, with bool or additive masks, and zeros for a row with no key."""
    q, k, v, allowed, sinks = random_case(3, 1, 13, 6, kv_heads, 10, seed=11, empty_row=mask == "empty")
    sinks = sinks if with_sinks else None
    given = {"none": None, "bool": allowed, "empty": allowed,
             "additive": torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)}[mask]
    with torch.no_grad():
        out, _ = sdpa_sink_attention(q, k, v, given, scaling=0.3, sinks=sinks)
        direct, _ = grouped_decode_attention(q, k, v, given, scaling=0.3, sinks=sinks)
    ref = oracle(q, k, v, torch.ones_like(allowed) if mask == "none" else allowed, 0.3, sinks)
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=2e-6)
    assert torch.equal(out, direct)
    if mask == "empty":
        assert torch.equal(out[0, 0], torch.zeros_like(out[0, 0]))


def test_decode_step_takes_a_broadcast_head_as_one_head():
    """MLA's absorbed read: every query head reads one latent, passed expanded (stride 0) to the KV heads."""
    q, k, v, _, sinks = random_case(2, 1, 9, 6, 1, 8, seed=12)
    with torch.no_grad():
        shared, _ = grouped_decode_attention(q, k, v, None, scaling=0.3, sinks=sinks)
        expanded, _ = grouped_decode_attention(q, k.expand(-1, 3, -1, -1), v.expand(-1, 3, -1, -1), None,
                                               scaling=0.3, sinks=sinks)
        repeated, _ = grouped_decode_attention(q, k.repeat(1, 3, 1, 1), v.repeat(1, 3, 1, 1), None,
                                               scaling=0.3, sinks=sinks)
    torch.testing.assert_close(shared, expanded, atol=0, rtol=0)
    torch.testing.assert_close(shared, repeated, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("value_dim", [6, 13])
@pytest.mark.parametrize("case", ["masked", "causal"])
def test_keys_and_values_of_different_widths_take_the_fused_kernel(case, value_dim):
    """MLA's explicit prefill reads 10-wide keys and narrower (or wider) values: without sinks the
    call must still run on a fused SDPA kernel (the math fallback holds every score), and equal the
    oracle."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    t, s = {"masked": (9, 11), "causal": (7, 7)}[case]
    q, k, v, allowed, _ = random_case(2, t, s, 6, 3, 10, seed=3)
    v = torch.randn(*v.shape[:-1], value_dim, generator=torch.Generator().manual_seed(4))
    mask = allowed if case == "masked" else None
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):  # no math fallback allowed
        out, _ = sdpa_sink_attention(q, k, v, mask, scaling=0.3)
    ref = oracle(q, k, v, allowed if mask is not None else
                 (torch.arange(s)[None, :] <= torch.arange(s - t, s)[:, None])[None, None], 0.3, None)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)
