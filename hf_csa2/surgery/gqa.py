"""GQA/MQA surgery: merge KV heads so ``h_q`` query heads share ``h_kv`` KV heads.

Query head ``r`` reads KV head ``r // (h_q / h_kv)`` (seed 004 §GQA). Two inits:

* ``mean`` -- Ainslie et al. (2023): each new KV head is the mean of the old KV heads its
  query heads used (weighted by how many of them used each); Q and O are untouched.
* ``calibrated`` -- a calibration-aware merge that is exact when nothing is merged and is
  optimal for a weighted reconstruction objective on calibration activations:

  - Keys, RoPE-aware: RoPE rotates each frequency pair ``f`` as a complex number, so the
    only per-head maps that commute with it are complex scalars. For each new head and each
    pair, the old heads' keys ``k_j^f`` (weighted by the energy ``w_j^f`` of the queries that
    read them) are approximated as ``c_j^f k'^f`` with one shared ``k'^f``: the top
    eigenvector of their Hermitian second moment (a per-frequency complex PCA). ``conj(c_j)``
    is folded into those heads' query rows, so scores ``Re(q conj(k))`` are preserved up to
    the discarded components. Sources with QK-norm (Qwen3, Gemma3) normalise keys after the
    projection, which no linear fold survives; their keys use the mean merge.
  - Values: the old heads' values, weighted by the output projection that reads them
    (``L_j^T L_j = sum_r W_O,r^T W_O,r``), are compressed to one ``D``-dim value by PCA on
    calibration activations; the per-head reconstruction ``L_j^{-1} U_j`` is folded into
    ``W_O``.

All maths runs in float64 on weight matrices and the input second moment ``E[x~ x~^T]``
(``x~ = [x, 1]`` so biases are handled by the same algebra).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..model.configuration_hf_csa2 import attention_head_dim
from .calibration import decoder_layers
from .layerwise import (
    calibrate_layerwise,
    refine_layer_output,
    refit_output_projection,
    source_attention_outputs,
)
from .linalg import augment as _augment
from .linalg import augmented_moment, eigh
from .linalg import split_augmented as _split
from .plan import GqaPlan
from .rebuild import is_csa2, native_specs, to_csa2


@dataclass
class AttentionWeights:
    """Projection weights of one attention layer; biases are None when absent.

    q_w [HQ*D, d], k_w/v_w [H*D, d], o_w [d, HQ*D]; o's bias never changes.
    """

    q_w: torch.Tensor
    k_w: torch.Tensor
    v_w: torch.Tensor
    o_w: torch.Tensor
    q_b: torch.Tensor | None = None
    k_b: torch.Tensor | None = None
    v_b: torch.Tensor | None = None

    @classmethod
    def from_module(cls, attn) -> "AttentionWeights":
        def bias(lin):
            return None if lin.bias is None else lin.bias.detach()

        return cls(
            attn.q_proj.weight.detach(), attn.k_proj.weight.detach(), attn.v_proj.weight.detach(),
            attn.o_proj.weight.detach(), bias(attn.q_proj), bias(attn.k_proj), bias(attn.v_proj),
        )

    def state_dict(self, prefix: str) -> dict[str, torch.Tensor]:
        out = {f"{prefix}q_proj.weight": self.q_w, f"{prefix}k_proj.weight": self.k_w,
               f"{prefix}v_proj.weight": self.v_w, f"{prefix}o_proj.weight": self.o_w}
        for name in ("q", "k", "v"):
            b = getattr(self, f"{name}_b")
            if b is not None:
                out[f"{prefix}{name}_proj.bias"] = b
        return out


def head_groups(num_q: int, old_kv: int, new_kv: int) -> list[list[tuple[int, int]]]:
    """For each new KV head, the (query head, old KV head) pairs it will serve."""
    old_g, new_g = num_q // old_kv, num_q // new_kv
    groups: list[list[tuple[int, int]]] = [[] for _ in range(new_kv)]
    for r in range(num_q):
        groups[r // new_g].append((r, r // old_g))
    return groups


def merge_kv_heads(
    weights: AttentionWeights,
    *,
    num_q_heads: int,
    old_kv_heads: int,
    new_kv_heads: int,
    head_dim: int,
    method: str,
    moment: torch.Tensor | None = None,
    rope_aware_keys: bool = True,
) -> AttentionWeights:
    """Return the weights of the same layer with ``new_kv_heads`` KV heads.

    Args:
        weights: the layer's projections (see :class:`AttentionWeights` for shapes).
        method: ``"mean"`` or ``"calibrated"`` (needs ``moment``).
        moment: float64 [d+1, d+1] second moment of the augmented attention input.
        rope_aware_keys: False for QK-norm sources (keys then use the mean merge).
    """
    if num_q_heads % new_kv_heads or num_q_heads % old_kv_heads:
        raise ValueError(f"new_kv_heads={new_kv_heads} must divide num_q_heads={num_q_heads}")
    if method == "calibrated" and moment is None:
        raise ValueError("method='calibrated' needs calibration moments")
    D = head_dim
    q = _augment(weights.q_w, weights.q_b).view(num_q_heads, D, -1)  # [HQ, D, d+1]
    k = _augment(weights.k_w, weights.k_b).view(old_kv_heads, D, -1)  # [H, D, d+1]
    v = _augment(weights.v_w, weights.v_b).view(old_kv_heads, D, -1)  # [H, D, d+1]
    o = weights.o_w.double().view(weights.o_w.shape[0], num_q_heads, D).clone()  # [d, HQ, D]
    new_q = q.clone()
    new_k, new_v = [], []
    for members in head_groups(num_q_heads, old_kv_heads, new_kv_heads):
        old_heads = sorted({j for _, j in members})
        if method == "mean" or not rope_aware_keys:
            new_k.append(_reader_weighted_mean(k, members, old_heads))
        else:
            new_k.append(_rope_aware_key_merge(q, k, members, old_heads, moment, new_q))
        if method == "mean":
            new_v.append(_reader_weighted_mean(v, members, old_heads))
        else:
            new_v.append(_value_pca_merge(v, o, members, old_heads, moment))
    q_w, q_b = _split(new_q.reshape(num_q_heads * D, -1), weights.q_w, weights.q_b)
    k_w, k_b = _split(torch.stack(new_k).reshape(new_kv_heads * D, -1), weights.k_w, weights.k_b)
    v_w, v_b = _split(torch.stack(new_v).reshape(new_kv_heads * D, -1), weights.v_w, weights.v_b)
    o_w = o.reshape(weights.o_w.shape).to(weights.o_w.dtype).contiguous()
    return AttentionWeights(q_w, k_w, v_w, o_w, q_b, k_b, v_b)


def _reader_weighted_mean(rows: torch.Tensor, members, old_heads) -> torch.Tensor:
    """Mean of the old heads' rows [H, D, d+1], each weighted by how many query heads read it."""
    counts = torch.tensor([sum(1 for _, j in members if j == h) for h in old_heads], dtype=torch.float64)
    return (rows[old_heads] * counts[:, None, None]).sum(0) / counts.sum()


def _to_complex(rows: torch.Tensor) -> torch.Tensor:
    """[..., D, d+1] real rows in half-split RoPE layout -> [..., D/2, d+1] complex rows."""
    half = rows.shape[-2] // 2
    return torch.complex(rows[..., :half, :], rows[..., half:, :])


def _from_complex(rows: torch.Tensor) -> torch.Tensor:
    return torch.cat([rows.real, rows.imag], dim=-2)


def _rope_aware_key_merge(q, k, members, old_heads, moment, new_q) -> torch.Tensor:
    """Shared key for one new head by per-frequency complex PCA; folds conj(c_j) into new_q."""
    sigma = moment.to(torch.complex128)
    a = _to_complex(k[old_heads])  # [J, F, d+1]
    # Energy of the queries reading each old head, per frequency pair: E|q^f|^2.
    energy = torch.zeros(a.shape[0], a.shape[1], dtype=torch.float64)
    for r, j in members:
        qc = _to_complex(q[r])  # [F, d+1]
        energy[old_heads.index(j)] += ((qc @ sigma) * qc.conj()).sum(-1).real
    w = energy.clamp_min(1e-12).sqrt()  # [J, F]
    y = (w[..., None] * a).permute(1, 0, 2)  # [F, J, d+1]
    cov = y @ sigma @ y.conj().transpose(-1, -2)  # [F, J, J] Hermitian
    _, vecs = eigh(cov)
    u = vecs[..., -1]  # [F, J] top eigenvector per frequency
    shared = (u.conj()[..., None] * y).sum(1)  # [F, d+1]: k'^f = sum_j conj(u_j) w_j k_j^f
    scale = (u / w.T).T  # [J, F]: k_j^f ~= c_j^f k'^f with c = u / w
    for r, j in members:
        qc = _to_complex(q[r]) * scale[old_heads.index(j)].conj()[:, None]
        new_q[r] = _from_complex(qc)
    return _from_complex(shared)


def _value_pca_merge(v, o, members, old_heads, moment) -> torch.Tensor:
    """Shared value for one new head by O-weighted PCA; folds the reconstruction into o (in place)."""
    D = v.shape[1]
    chol_t, blocks = [], []
    for h in old_heads:
        readers = [r for r, j in members if j == h]
        gram = sum(o[:, r, :].T @ o[:, r, :] for r in readers)  # [D, D]
        gram = gram + 1e-8 * (gram.diagonal().mean() + 1e-12) * torch.eye(D, dtype=torch.float64)
        upper = torch.linalg.cholesky(gram).T  # gram = upper^T upper
        chol_t.append(upper)
        blocks.append(upper @ v[h])  # [D, d+1]
    y = torch.cat(blocks)  # [J*D, d+1]
    cov = y @ moment @ y.T
    _, vecs = eigh(cov)
    basis = vecs[:, -D:]  # [J*D, D] top-D principal directions
    for idx, h in enumerate(old_heads):
        recon = torch.linalg.solve_triangular(chol_t[idx], basis[idx * D : (idx + 1) * D], upper=True)  # [D, D]
        for r, j in members:
            if j == h:
                o[:, r, :] = o[:, r, :] @ recon
    return basis.T @ y  # [D, d+1]


def has_qk_norm(model) -> bool:
    return getattr(decoder_layers(model)[0].self_attn, "q_norm", None) is not None


@dataclass
class GqaLayerFit:
    """One layer's ``o_proj`` refit (``init: calibrated`` with ``refit_output``): relative squared
    error of the layer's attention output against the source layer's, before and after; then
    the Adam refinement's error on held-out windows (``refine_steps``)."""

    rel_err_before: float | None = None
    rel_err_after: float | None = None
    refine_heldout_err_before: float | None = None
    refine_heldout_err_after: float | None = None
    refine_kept_step: int | None = None  # the refinement step whose state was kept (0: the start)


@dataclass
class GqaFitReport:
    """What :func:`apply_gqa` did: the plan it followed, whether keys fell back to the mean
    merge (QK-norm sources) and, per layer, the refit (None where nothing was refitted)."""

    plan: GqaPlan
    keys_by_mean: bool
    layers: list[GqaLayerFit | None]

    def stage_notes(self) -> dict:
        notes: dict = {"init": self.plan.init}
        if self.plan.keep_layers:
            notes["kept_layers"] = sorted(self.plan.keep_layers)
        fits = [f for f in self.layers if f is not None]
        for key, name in (("rel_err_before", "attn_out_rel_err_before_refit"), ("rel_err_after", "attn_out_rel_err_after_refit"),
                          ("refine_heldout_err_before", "refine_heldout_err_before"),
                          ("refine_heldout_err_after", "refine_heldout_err_after")):
            values = [getattr(f, key) for f in fits if getattr(f, key) is not None]
            if values:
                notes[name] = sum(values) / len(values)
        if self.keys_by_mean:
            notes["keys"] = ("QK-norm source: keys merged by mean (a linear RoPE-aware fold cannot pass the norm); "
                             "values by O-weighted PCA")
        return notes


def apply_gqa(model, plan: GqaPlan, *, windows: torch.Tensor | None = None) -> tuple[object, GqaFitReport]:
    """Rewrite ``model`` (native or hf_csa2) so every layer has ``plan.num_key_value_heads`` KV
    heads, except ``plan.keep_layers``, which stay exactly as they are; returns the new model (the
    source is not changed) and a :class:`GqaFitReport`.

    ``init: mean`` needs nothing else. ``init: calibrated`` needs calibration ``windows`` [N, T]:
    layer by layer (see :mod:`~hf_csa2.surgery.layerwise`) it merges the heads with
    :func:`merge_kv_heads` from the statistics of the converted model's own inputs to that
    layer, then (``refit_output``) refits ``o_proj`` so the layer reproduces the source
    layer's attention output.
    """
    calibrated = plan.init == "calibrated"
    if calibrated and windows is None:
        raise ValueError("gqa init='calibrated' needs calibration windows")
    cfg = model.config
    head_dim = attention_head_dim(cfg)
    specs = [dict(s) for s in (cfg.attention_layers if is_csa2(model) else native_specs(cfg))]
    rope_aware = not has_qk_norm(model)
    old_layers = decoder_layers(model)
    keep = set(plan.keep_layers or ())
    if keep and max(keep) >= len(old_layers):
        raise ValueError(f"gqa.keep_layers names layer {max(keep)}; the model has {len(old_layers)} layers")
    merged_layers = [i for i in range(len(old_layers)) if i not in keep]
    kv = plan.num_key_value_heads

    def merged(i, moment=None):
        return merge_kv_heads(
            AttentionWeights.from_module(old_layers[i].self_attn),
            num_q_heads=cfg.num_attention_heads, old_kv_heads=specs[i]["num_key_value_heads"],
            new_kv_heads=kv, head_dim=head_dim, method="mean" if moment is None else "calibrated",
            moment=moment, rope_aware_keys=rope_aware,
        )

    state = dict(model.state_dict())
    for i in merged_layers:
        state.update(merged(i).state_dict(f"model.layers.{i}.self_attn."))
    new = to_csa2(model, [s if i in keep else {**s, "num_key_value_heads": kv} for i, s in enumerate(specs)], state=state)
    report = GqaFitReport(plan=plan, keys_by_mean=calibrated and not rope_aware, layers=[None] * len(old_layers))
    if not calibrated:
        return new, report

    targets = source_attention_outputs(model, windows) if plan.refit_output or plan.refine_steps else None

    def fit_layer(i, attn, hidden, attn_kwargs):
        if i in keep:
            return None
        weights = merged(i, augmented_moment(hidden)).state_dict("")
        attn.load_state_dict({**attn.state_dict(), **weights})
        fit = GqaLayerFit()
        if plan.refit_output:
            fit = dataclasses.replace(fit, **refit_output_projection(attn, hidden, attn_kwargs, targets[i], ridge=plan.ridge))
        if plan.refine_steps:
            # The closed forms fit keys and values through second moments only; the softmax between
            # key error and output error is what these steps see (LoLCATs' attention transfer).
            fit = dataclasses.replace(fit, **refine_layer_output(attn, hidden, attn_kwargs, targets[i], list(attn.parameters()),
                                                                 steps=plan.refine_steps, lr=plan.refine_lr))
        return fit if plan.refit_output or plan.refine_steps else None

    report.layers = calibrate_layerwise(new, windows, fit_layer)
    return new, report


__all__ = ["AttentionWeights", "GqaFitReport", "GqaLayerFit", "apply_gqa", "has_qk_norm", "head_groups", "merge_kv_heads"]
