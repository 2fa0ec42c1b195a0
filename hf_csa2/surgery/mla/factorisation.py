"""The latent of an MLA layer: factorise the stacked position-free key rows and value rows.

The layer caches ``c = W_DKV x`` and its keys/values are up-projections ``K_h = c W_UK,h``,
``V_h = c W_UV,h`` (DeepSeek-V2/V3's multi-head latent attention). ``activation_aware``
(default): the stacked rows ``M`` [m, d+1] (bias as a column, input ``x~ = [x, 1]``) are
factorised to minimise ``E || S (M - B A) x~ ||^2`` where ``S`` weights each block by what its
error costs downstream: key rows by the second moment of the queries that read them
(``scaling^2 E[q q^T]``: the logit error), value rows by ``W_O^T W_O`` of the reading heads (the
output error), and the key block by a balance factor ``alpha`` chosen per layer on the
calibration data from :data:`BALANCE_GRID` (the layer-output error decides). The optimum is
``A = U_r^T S M``, ``B = S^{-1} U_r`` with ``U_r`` the top eigenvectors of
``S M E[x~ x~^T] M^T S`` (:func:`factorise_kv`). ``weight_svd``: the same with ``S = I`` and
``E[x~ x~^T] = I`` (plain SVD of the weights, MHA2MLA's init), kept as the baseline.

At full rank (:func:`full_stack_width`) ``B A = M`` exactly, so with every pair kept the
converted layer reproduces the source.

Latent norm (DeepSeek-V3's ``kv_a_layernorm``, needed for its export): an RMS norm on the latent
would erase each token's latent magnitude, so one latent coordinate is held at a large constant
(:func:`scale_anchor`) and the up-projection is refitted by least squares after the norm
(:func:`refit_up_projection`).
"""

from __future__ import annotations

import math

import torch

from ...model.configuration_hf_csa2 import attention_head_dim
from ...model.latent_attention import LatentAttention
from ..linalg import augment, augmented_inputs, eigh, psd_sqrt, ridge_solve, split_augmented
from .rope_slots import RopeSplit, pre_rope_qk, split_key_rows

BALANCE_GRID = (0.25, 0.5, 1.0, 2.0, 4.0)


def full_stack_width(config, num_key_value_heads: int, num_pairs: int, shared: bool = False) -> int:
    """The rank at which the factorisation is exact: H * (D_nope + D) (D_nope = D for a mixed
    shared rope key, D - 2n per head otherwise)."""
    d = attention_head_dim(config)
    nope = d if shared and num_key_value_heads > 1 else d - 2 * num_pairs
    return num_key_value_heads * (nope + d)


def stacked_kv_rows(k_aug: torch.Tensor, v_aug: torch.Tensor, nope_dims: torch.Tensor, rope_of_kv: torch.Tensor) -> torch.Tensor:
    """Per KV head: its position-free key rows then its value rows -> [H*(D_nope + D), d+1],
    the row order of ``kv_b_proj``. k_aug/v_aug [H, D, d+1]."""
    rows = [torch.cat([k_aug[h, nope_dims[rope_of_kv[h]]], v_aug[h]]) for h in range(k_aug.shape[0])]
    return torch.cat(rows)


def factorise_kv(rows: torch.Tensor, rank: int, moment: torch.Tensor | None = None,
                 weight: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank-``rank`` factorisation ``rows ~= B A`` minimising ``E||S (rows - B A) x~||^2``.

    Args:
        rows: [m, d+1] (bias as the last column).
        moment: ``E[x~ x~^T]`` [d+1, d+1]; None = identity (plain weight SVD).
        weight: ``S`` [m, m] (symmetric, invertible); None = identity.
    Returns:
        ``A`` [rank, d+1] (the latent's down-projection, bias last) and ``B`` [m, rank].
    """
    s = torch.eye(rows.shape[0], dtype=torch.float64) if weight is None else weight
    y = s @ rows
    cov = y @ (y.T if moment is None else moment @ y.T)
    vals, vecs = eigh(cov)
    u = vecs[:, torch.argsort(vals, descending=True)[:rank]]  # [m, rank]
    a = u.T @ y
    b = torch.linalg.solve(s, u)
    return a, b


def balance_blocks(attn, hidden: torch.Tensor, o_w: torch.Tensor, nope_dims, rope_of_kv, num_kv: int,
                   key_gain: torch.Tensor | None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per KV head, the key weight ``scaling * E[q_nope q_nope^T]^{1/2}`` over its readers and
    the value weight ``(sum W_O,r^T W_O,r)^{1/2}`` -> two lists of [D_nope, D_nope] / [D, D]."""
    q, _ = pre_rope_qk(attn, hidden)  # [N, HQ, T, D]
    hq, d = q.shape[1], q.shape[-1]
    group = hq // num_kv
    o = o_w.double().view(o_w.shape[0], hq, d)
    key_blocks, value_blocks = [], []
    for h in range(num_kv):
        dims = nope_dims[rope_of_kv[h]]
        qq = torch.zeros(len(dims), len(dims), dtype=torch.float64)
        gram = torch.zeros(d, d, dtype=torch.float64)
        for r in range(h * group, (h + 1) * group):
            gram += o[:, r].T @ o[:, r]
            if len(dims):
                x = q[:, r][..., dims].reshape(-1, len(dims)).double()
                qq += x.T @ x / x.shape[0]
        if key_gain is not None:
            g = key_gain[dims].double()
            qq = qq * g[:, None] * g[None, :]
        # No position-free key rows (every pair keeps RoPE): an empty key block.
        key_blocks.append(psd_sqrt(qq * attn.scaling**2)[0] if len(dims) else qq)
        value_blocks.append(psd_sqrt(gram)[0])
    return key_blocks, value_blocks


def base_balance(key_blocks, value_blocks) -> float:
    """The key-block factor that gives the key and value weights the same energy."""
    k_energy = sum(b.pow(2).sum() for b in key_blocks)
    v_energy = sum(b.pow(2).sum() for b in value_blocks)
    return math.sqrt(v_energy / k_energy) if k_energy > 0 else 1.0


def block_diag_weight(key_blocks, value_blocks, alpha: float) -> torch.Tensor:
    """``S``: per KV head its key block times ``alpha``, then its value block (row order of
    :func:`stacked_kv_rows`)."""
    blocks = []
    for kb, vb in zip(key_blocks, value_blocks):
        blocks += [alpha * kb, vb]
    return torch.block_diag(*blocks)


def scale_anchor(down: torch.Tensor, hidden: torch.Tensor | None, ratio: float = 100.0) -> torch.Tensor:
    """A latent row [1, d+1] that is a large constant (bias only).

    An RMS norm on the latent throws away each token's latent magnitude, which keys and values
    need. With one coordinate held at ``beta`` >> ``|c|`` the RMS is ~``beta / sqrt(r)`` for
    every token, so the norm becomes a constant rescale (relative wobble ``|c|^2 / 2 beta^2``,
    5e-5 at ``ratio`` 100) and the up-projection, refitted after it, sees the magnitudes again.
    """
    if hidden is None:
        raise ValueError("a normalised latent needs calibration activations")
    x = augmented_inputs(hidden)
    beta = ratio * (x @ down.T).pow(2).sum(-1).max().sqrt().clamp_min(1.0)
    row = torch.zeros(1, down.shape[1], dtype=torch.float64)
    row[0, -1] = beta
    return row


def refit_up_projection(attn: LatentAttention, rows: torch.Tensor, down: torch.Tensor, hidden: torch.Tensor,
                        ridge: float = 1e-6) -> torch.Tensor:
    """Up-projection ``B`` [m, r] for a normalised latent: least squares of the target rows'
    outputs ``rows x~`` on ``norm(down x~)`` over the calibration tokens ``hidden`` [N, T, d]
    (the same ``B`` for any invertible row weighting). The norm's gain is reset to 1."""
    x = augmented_inputs(hidden)
    c = x @ down.T
    c = c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + attn.kv_a_layernorm.variance_epsilon)
    attn.kv_a_layernorm.weight.fill_(1.0)
    return ridge_solve(c, x @ rows.T, ridge).T


def set_latent(attn: LatentAttention, src, split: RopeSplit, rank: int, moment: torch.Tensor | None = None,
               weight: torch.Tensor | None = None, hidden: torch.Tensor | None = None) -> None:
    """Factorise the dense source module ``src``'s key/value rows into ``attn.kv_a_proj`` /
    ``attn.kv_b_proj`` (+ the rope rows of ``split``); a normalised latent refits the
    up-projection on ``hidden`` [N, T, d]."""
    h, d = attn.num_key_value_heads, attn.head_dim

    def rows_of(lin):
        return augment(lin.weight.detach(), None if lin.bias is None else lin.bias.detach()).view(h, d, -1)

    rope_rows, k_free, coef = split_key_rows(rows_of(src.k_proj), split)
    rows = stacked_kv_rows(k_free, rows_of(src.v_proj), attn.nope_dims, attn.rope_of_kv)
    keep_scale = attn.kv_a_layernorm is not None and rank > 1
    a, b = factorise_kv(rows, rank - 1 if keep_scale else rank, moment, weight)
    if keep_scale:
        a = torch.cat([a, scale_anchor(a, hidden)])
    if attn.kv_a_layernorm is not None:
        if hidden is None:
            raise ValueError("a normalised latent needs calibration activations to fit its up-projection")
        b = refit_up_projection(attn, rows, a, hidden)
    down = torch.cat([a, rope_rows])  # [r + R*2n, d+1]
    w, bias = split_augmented(down, attn.kv_a_proj.weight, attn.kv_a_proj.bias)
    attn.kv_a_proj.weight.copy_(w)
    if bias is not None:
        attn.kv_a_proj.bias.copy_(bias)
    attn.kv_b_proj.weight.copy_(b.to(attn.kv_b_proj.weight.dtype))
    if attn.kv_b_proj.bias is not None:
        attn.kv_b_proj.bias.zero_()
    if coef is not None:
        attn.q_rope_coef.copy_(coef.to(attn.q_rope_coef.dtype))


__all__ = ["BALANCE_GRID", "balance_blocks", "base_balance", "block_diag_weight", "factorise_kv",
           "full_stack_width", "refit_up_projection", "scale_anchor", "set_latent", "stacked_kv_rows"]
