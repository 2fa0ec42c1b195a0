"""The linear algebra shared by the surgery fits: augmented inputs, ridge solves, the guarded
eigendecomposition (its retry path forced) and the PSD square root."""

import pytest
import torch

from hf_csa2.surgery import linalg
from hf_csa2.surgery.linalg import (
    augment,
    augmented_moment,
    eigh,
    psd_sqrt,
    ridge_solve,
    solve_ridge_normal,
    split_augmented,
)


def test_ridge_solve_recovers_an_exact_linear_map():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200, 6, generator=g, dtype=torch.float64)
    w = torch.randn(6, 4, generator=g, dtype=torch.float64)
    assert torch.allclose(ridge_solve(x, x @ w, 1e-12), w, atol=1e-8)


def test_ridge_toward_a_prior_stays_there_under_a_huge_penalty_and_is_exact_without_one():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(100, 5, generator=g, dtype=torch.float64)
    w, w0 = torch.randn(5, 3, generator=g, dtype=torch.float64), torch.randn(5, 3, generator=g, dtype=torch.float64)
    gram, cross = x.T @ x, x.T @ (x @ w)
    assert torch.allclose(solve_ridge_normal(gram, cross, 1e-12, toward=w0), w, atol=1e-8)
    assert torch.allclose(solve_ridge_normal(gram, cross, 1e12, toward=w0), w0, atol=1e-6)


def test_augmented_rows_carry_the_bias_and_split_back():
    g = torch.Generator().manual_seed(2)
    w, b = torch.randn(4, 3, generator=g), torch.randn(4, generator=g)
    x = torch.randn(7, 3, generator=g)
    aug = augment(w, b)
    assert torch.allclose(torch.cat([x, torch.ones(7, 1)], 1).double() @ aug.T, (x @ w.T + b).double(), atol=1e-6)
    w2, b2 = split_augmented(aug, w, b)
    assert torch.equal(w2, w) and torch.equal(b2, b)
    assert split_augmented(augment(w, None), w, None)[1] is None
    moment = augmented_moment(x)
    assert moment.shape == (4, 4) and moment[-1, -1] == 1 and torch.allclose(moment[:3, -1], x.double().mean(0))


def _flaky_eigh(monkeypatch, failures: int):
    """torch.linalg.eigh that raises LinAlgError on its first ``failures`` calls."""
    real = torch.linalg.eigh
    calls = []

    def flaky(mat, *args, **kwargs):
        calls.append(mat.dtype)
        if len(calls) <= failures:
            raise torch.linalg.LinAlgError("linalg.eigh: The algorithm failed to converge (forced by the test)")
        return real(mat, *args, **kwargs)

    monkeypatch.setattr(torch.linalg, "eigh", flaky)
    return calls, real


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.complex64])
def test_eigh_retries_with_jitter_when_lapack_does_not_converge(monkeypatch, dtype):
    g = torch.Generator().manual_seed(3)
    a = torch.randn(6, 6, generator=g, dtype=torch.float64)
    if dtype.is_complex:
        a = torch.complex(a, torch.randn(6, 6, generator=g, dtype=torch.float64))
    mat = (a @ a.mH).to(dtype)
    calls, real = _flaky_eigh(monkeypatch, failures=1)
    vals, vecs = eigh(mat)
    assert calls == [dtype, dtype]  # the plain try, then the jittered one in the same dtype
    want_vals, _ = real(mat)
    assert vals.dtype == want_vals.dtype and vecs.dtype == dtype
    assert torch.allclose(vals, want_vals, rtol=1e-4, atol=1e-4)
    assert torch.allclose((vecs * vals) @ vecs.mH, mat, rtol=1e-4, atol=1e-4)


def test_eigh_falls_back_to_double_precision_then_gives_up(monkeypatch):
    g = torch.Generator().manual_seed(4)
    a = torch.randn(5, 5, generator=g)
    mat = a @ a.T
    calls, _ = _flaky_eigh(monkeypatch, failures=2)
    vals, vecs = eigh(mat)
    assert calls == [torch.float32, torch.float32, torch.float64]
    assert vals.dtype == vecs.dtype == torch.float32
    assert torch.allclose((vecs * vals) @ vecs.T, mat, rtol=1e-4, atol=1e-4)
    calls, _ = _flaky_eigh(monkeypatch, failures=3)
    with pytest.raises(torch.linalg.LinAlgError, match="forced by the test"):
        eigh(mat)


def test_eigh_is_torch_eigh_when_it_converges_and_handles_batches():
    g = torch.Generator().manual_seed(5)
    a = torch.randn(3, 4, 4, generator=g, dtype=torch.float64)
    mat = a @ a.transpose(-1, -2)
    vals, vecs = eigh(mat)
    want = torch.linalg.eigh(mat)
    assert torch.equal(vals, want[0]) and torch.equal(vecs, want[1])


def test_eigh_jitter_is_relative_per_matrix_in_a_batch(monkeypatch):
    mats = torch.stack([torch.diag(torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)) * s for s in (1e-6, 1e6)])
    _flaky_eigh(monkeypatch, failures=1)
    vals, _ = eigh(mats)
    assert torch.allclose(vals, torch.stack([torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64) * s for s in (1e-6, 1e6)]),
                          rtol=1e-9)
    assert linalg.EIGH_JITTER[0] < 1e-6


def test_psd_sqrt_squares_back_and_inverts():
    g = torch.Generator().manual_seed(6)
    a = torch.randn(5, 5, generator=g, dtype=torch.float64)
    mat = a @ a.T + 0.1 * torch.eye(5, dtype=torch.float64)
    root, inv = psd_sqrt(mat)
    assert torch.allclose(root @ root, mat, atol=1e-10) and torch.allclose(root @ inv, torch.eye(5, dtype=torch.float64), atol=1e-10)
