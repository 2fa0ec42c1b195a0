"""The rank-r code fit of a ``lowrank`` layer (``surgery/lowrank.py``): on the inputs whose
moment it was given it is the best rank-r map (no other rank-r subspace does better), its
reported error is the measured one, and a full-width code is exact."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from hf_csa2.surgery.linalg import augmented_moment
from hf_csa2.surgery.lowrank import output_pca_codes


def projection_and_inputs(seed: int, bias: bool, d=10, out=8, n=200):
    g = torch.Generator().manual_seed(seed)
    proj = nn.Linear(d, out, bias=bias).double()
    with torch.no_grad():
        proj.weight.copy_(torch.randn(out, d, generator=g, dtype=torch.float64))
        if bias:
            proj.bias.copy_(torch.randn(out, generator=g, dtype=torch.float64))
    mix = torch.randn(d, d, generator=g, dtype=torch.float64) * torch.logspace(0, -2, d, dtype=torch.float64)
    x = torch.randn(n, d, generator=g, dtype=torch.float64) @ mix + 0.3  # correlated inputs, not centred
    return proj, x


def code_error(proj, x, down_w, down_b, up_w) -> float:
    with torch.no_grad():
        y = proj(x)
        code = x @ down_w.T + (0 if down_b is None else down_b)
        return float(((y - code @ up_w.T) ** 2).sum() / (y**2).sum())


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), rank=st.integers(1, 7), bias=st.booleans())
def test_pca_code_is_the_best_rank_r_map_and_reports_its_error(seed, rank, bias):
    proj, x = projection_and_inputs(seed, bias)
    down_w, down_b, up_w, rel_err = output_pca_codes(proj, augmented_moment(x), rank)
    measured = code_error(proj, x, down_w, down_b, up_w)
    assert abs(measured - rel_err) < 1e-9
    # Any other rank-r subspace of the outputs (projecting onto it) does no better.
    g = torch.Generator().manual_seed(seed + 1)
    for _ in range(5):
        u, _ = torch.linalg.qr(torch.randn(proj.out_features, rank, generator=g, dtype=torch.float64))
        w_aug = torch.cat([proj.weight, (proj.bias if bias else torch.zeros(proj.out_features, dtype=torch.float64))[:, None]], 1)
        down = u.T @ w_aug
        other = code_error(proj, x, down[:, :-1], down[:, -1], u)
        assert measured <= other + 1e-12


def test_full_width_code_is_exact_and_narrower_codes_lose_more():
    proj, x = projection_and_inputs(3, True)
    moment = augmented_moment(x)
    errors = [output_pca_codes(proj, moment, r)[3] for r in range(1, 9)]
    assert errors[-1] == 0.0 and code_error(proj, x, *output_pca_codes(proj, moment, 8)[:3]) < 1e-20
    assert all(a >= b for a, b in zip(errors, errors[1:])) and errors[0] > 0.01
