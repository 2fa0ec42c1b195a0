"""Linear algebra shared by the surgery fits.

* Augmented inputs: a projection ``W x + b`` is the single matrix ``[W, b]`` acting on
  ``x~ = [x, 1]``, so biases ride through the same algebra as weights (:func:`augment`,
  :func:`split_augmented`, :func:`augmented_inputs`, :func:`augmented_moment`).
* Ridge least squares with the penalty relative to the Gram matrix's mean diagonal, shrinking
  toward zero or toward a current solution (:func:`ridge_solve`, :func:`solve_ridge_normal`).
* Symmetric / Hermitian eigendecomposition that survives LAPACK's rare non-convergence on
  ill-conditioned covariances (:func:`eigh`), and the PSD square root built on it.

Everything here runs in float64 (complex128 for Hermitian matrices) on small matrices.
"""

from __future__ import annotations

import torch

#: Diagonal jitter of the retries in :func:`eigh`, relative to the mean |diagonal|:
#: first in the input's dtype, then in double precision.
EIGH_JITTER = (1e-9, 1e-6)


def augment(w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """[rows, d] weight + bias -> [rows, d+1] in float64 (bias as the last column)."""
    b = torch.zeros(w.shape[0], dtype=torch.float64) if b is None else b.double()
    return torch.cat([w.double(), b[:, None]], dim=1)


def split_augmented(aug: torch.Tensor, like_w: torch.Tensor, like_b: torch.Tensor | None):
    """Inverse of :func:`augment`: [rows, d+1] -> (weight, bias or None) in the dtypes of
    ``like_w`` / ``like_b`` (the bias column is dropped when the layer has no bias)."""
    w = aug[:, :-1].to(like_w.dtype).contiguous()
    b = None if like_b is None else aug[:, -1].to(like_b.dtype).contiguous()
    return w, b


def augmented_inputs(hidden: torch.Tensor) -> torch.Tensor:
    """hidden [..., d] -> float64 [M, d+1] rows ``x~ = [x, 1]``."""
    x = hidden.reshape(-1, hidden.shape[-1]).double()
    return torch.cat([x, x.new_ones(x.shape[0], 1)], dim=1)


def augmented_moment(hidden: torch.Tensor) -> torch.Tensor:
    """hidden [..., d] -> float64 [d+1, d+1] mean of x~ x~^T with x~ = [x, 1]."""
    x = augmented_inputs(hidden)
    return x.T @ x / x.shape[0]


def solve_ridge_normal(gram: torch.Tensor, cross: torch.Tensor, ridge: float,
                       toward: torch.Tensor | None = None) -> torch.Tensor:
    """``argmin_W ||x W - y||^2 + lam ||W - W0||^2`` from its normal equations: ``gram = x^T x``
    [a, a], ``cross = x^T y`` [a, b], ``W0 = toward`` [a, b] (None: zero), with
    ``lam = ridge * mean(diag(gram))`` -> [a, b]."""
    lam = ridge * gram.diagonal().mean().clamp_min(1e-12)
    rhs = cross if toward is None else cross + lam * toward
    return torch.linalg.solve(gram + lam * torch.eye(gram.shape[0], dtype=gram.dtype), rhs)


def ridge_solve(x: torch.Tensor, y: torch.Tensor, ridge: float) -> torch.Tensor:
    """argmin_W ||x W - y||^2 + lam ||W||^2 with lam = ridge * mean(diag(x^T x)); x [N, a], y [N, b] -> [a, b] (fp64)."""
    x, y = x.double(), y.double()
    return solve_ridge_normal(x.T @ x, x.T @ y, ridge)


def eigh(mat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.linalg.eigh`` (ascending eigenvalues, eigenvectors as columns; batched or not)
    that retries when LAPACK does not converge: with a diagonal jitter ``EIGH_JITTER[0]`` times
    the mean |diagonal|, then in double precision with ``EIGH_JITTER[1]``. The jitter only
    shifts the eigenvalues (subtracted again); the eigenvectors are those of the jittered
    matrix. A matrix that fails every try raises the last error."""
    try:
        return torch.linalg.eigh(mat)
    except torch.linalg.LinAlgError as err:
        error = err
    wide = torch.complex128 if mat.is_complex() else torch.float64
    for dtype, jitter in zip((mat.dtype, wide), EIGH_JITTER):
        m = mat.to(dtype)
        shift = jitter * m.diagonal(dim1=-2, dim2=-1).abs().mean(-1).clamp_min(1e-30)  # one per matrix
        try:
            vals, vecs = torch.linalg.eigh(m + shift[..., None, None] * torch.eye(m.shape[-1], dtype=dtype))
        except torch.linalg.LinAlgError as err:
            error = err
            continue
        return (vals - shift[..., None]).to(mat.real.dtype), vecs.to(mat.dtype)
    raise error


def psd_sqrt(mat: torch.Tensor, floor: float = 1e-8) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric square root of a PSD matrix and its inverse (eigenvalues floored at ``floor``
    times the largest)."""
    vals, vecs = eigh(mat)
    vals = vals.clamp_min(floor * max(vals.max().item(), 1e-30))
    return (vecs * vals.sqrt()) @ vecs.T, (vecs / vals.sqrt()) @ vecs.T


__all__ = ["EIGH_JITTER", "augment", "augmented_inputs", "augmented_moment", "eigh", "psd_sqrt", "ridge_solve",
           "solve_ridge_normal", "split_augmented"]
