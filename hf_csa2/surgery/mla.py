"""MLA surgery: rewrite dense (MHA/GQA/MQA) attention into multi-head latent attention.

Seed 004 §8-§12: the layer caches ``c = W_DKV x`` and the keys/values are up-projections
``K_h = c W_UK,h``, ``V_h = c W_UV,h``; RoPE cannot pass through that factorisation, so a few
frequency pairs per head keep RoPE in a small separate rope key and the rest become
position-free. Two decisions per layer:

1. **Which pairs keep RoPE** (:func:`rope_pair_scores`). ``perturbation`` (ours, default):
   making pair ``f`` position-free changes each logit by ``Re(q^f conj(k^f) (e^{i theta_f (m-n)} - 1))``
   (``q^f, k^f`` the pair as complex numbers before rotation); its expected square under the
   source layer's own attention weights is exactly the damage, so the pairs with the largest
   one keep RoPE. ``norm``: MHA2MLA's 2-norm score ``E|q^f| E|k^f|`` summed over the query
   heads that read the KV head.
2. **The latent** (:func:`factorise_kv`). ``activation_aware`` (default): the stacked
   position-free key rows and value rows ``M`` [m, d+1] (bias as a column, input ``x~ = [x, 1]``)
   are factorised to minimise ``E || S (M - B A) x~ ||^2`` where ``S`` weights each block by
   what its error costs downstream: key rows by the second moment of the queries that read
   them (``scaling^2 E[q q^T]``: the logit error), value rows by ``W_O^T W_O`` of the reading
   heads (the output error), and the key block by a balance factor ``alpha`` chosen per layer
   on the calibration data from a small grid (the layer-output error decides). The optimum is
   ``A = U_r^T S M``, ``B = S^{-1} U_r`` with ``U_r`` the top eigenvectors of
   ``S M E[x~ x~^T] M^T S``. ``weight_svd``: the same with ``S = I`` and ``E[x~ x~^T] = I``
   (plain SVD of the weights), kept as the baseline.

At full rank (``kv_lora_rank`` = the stacked width) ``B A = M`` exactly, so with every pair
kept the converted layer reproduces the source.

Layers are fitted one after another on the converted model's own inputs (see
:mod:`.layerwise`), then ``o_proj`` is refitted to the source layer's output.
"""

from __future__ import annotations

import math

import torch

from ..model.latent_attention import Csa2LatentAttention, rope_dim_indices
from .calibration import augmented_moment, decoder_layers, run_with_attention_hooks
from .gqa import _augment, _split, has_qk_norm
from .layerwise import calibrate_layerwise, refit_output_projection, source_attention_outputs
from .rebuild import is_csa2, native_specs, to_csa2

ROPE_CRITERIA = ("perturbation", "norm")
FACTORISATIONS = ("activation_aware", "weight_svd")
BALANCE_GRID = (0.25, 0.5, 1.0, 2.0, 4.0)


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def pre_rope_qk(attn, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries [N, HQ, T, D] and keys [N, H, T, D] of a dense attention module after QK-norm,
    before RoPE (native source modules and :class:`Csa2Attention` alike)."""
    n, t, _ = hidden.shape
    d = attn.head_dim
    q = attn.q_proj(hidden).view(n, t, -1, d)
    k = attn.k_proj(hidden).view(n, t, -1, d)
    if getattr(attn, "q_norm", None) is not None:
        q, k = attn.q_norm(q), attn.k_norm(k)
    return q.transpose(1, 2), k.transpose(1, 2)


def _complex_pairs(x: torch.Tensor) -> torch.Tensor:
    """[..., D] half-split -> [..., D/2] complex."""
    half = x.shape[-1] // 2
    return torch.complex(x[..., :half].float(), x[..., half:].float())


@torch.no_grad()
def rope_pair_scores(attn, hidden: torch.Tensor, inv_freq: torch.Tensor, criterion: str = "perturbation",
                     max_tokens: int = 256) -> torch.Tensor:
    """Importance of keeping RoPE on each frequency pair, per KV head: [H, D/2] (higher = keep).

    Args:
        attn: the source (dense) attention module of the layer.
        hidden: its input [N, T, hidden] on calibration windows.
        inv_freq: RoPE angular frequency of each pair [D/2].
        criterion: ``perturbation`` or ``norm`` (see the module docstring).
        max_tokens: the first ``max_tokens`` positions of each window are used (the
            perturbation score costs O(T^2) per head).
    """
    if criterion not in ROPE_CRITERIA:
        raise ValueError(f"criterion={criterion!r}; allowed: {', '.join(ROPE_CRITERIA)}")
    hidden = hidden[:, :max_tokens]
    q, k = pre_rope_qk(attn, hidden)
    qc, kc = _complex_pairs(q), _complex_pairs(k)  # [N, HQ, T, F], [N, H, T, F]
    hq, h = qc.shape[1], kc.shape[1]
    group = hq // h
    scores = torch.zeros(h, qc.shape[-1], dtype=torch.float64)
    if criterion == "norm":
        for r in range(hq):
            scores[r // group] += (qc[:, r].abs().mean((0, 1)) * kc[:, r // group].abs().mean((0, 1))).double()
        return scores
    t = qc.shape[2]
    pos = torch.arange(t, dtype=torch.float32)
    delta = pos[:, None] - pos[None, :]  # [T, T] query minus key position
    causal = delta >= 0
    phase = torch.polar(torch.ones(()), delta[..., None] * inv_freq.float()) - 1  # [T, T, F]
    # Source attention weights (rotated scores) decide which (m, n) pairs matter.
    cos, sin = torch.cos(delta[..., None] * inv_freq.float()), torch.sin(delta[..., None] * inv_freq.float())
    for r in range(hq):
        j = r // group
        for w in range(qc.shape[0]):
            prod = qc[w, r][:, None, :] * kc[w, j].conj()[None, :, :]  # [T, T, F]
            logits = (prod.real * cos - prod.imag * sin).sum(-1) * attn.scaling
            p = torch.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1)  # [T, T]
            change = (prod * phase).real * attn.scaling  # logit change if the pair loses RoPE
            scores[j] += (p[..., None] * change.pow(2)).sum((0, 1)).double()
    return scores


def choose_rope_pairs(scores: torch.Tensor, num_pairs: int, shared: bool) -> list[list[int]]:
    """Top ``num_pairs`` pairs per KV head (or one list for all heads when ``shared``)."""
    if shared:
        scores = scores.sum(0, keepdim=True)
    return [sorted(torch.topk(s, num_pairs).indices.tolist()) if num_pairs else [] for s in scores]


def _psd_sqrt(mat: torch.Tensor, floor: float = 1e-8) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric square root of a PSD matrix and its inverse (eigenvalues floored)."""
    vals, vecs = torch.linalg.eigh(mat)
    vals = vals.clamp_min(floor * max(vals.max().item(), 1e-30))
    return (vecs * vals.sqrt()) @ vecs.T, (vecs / vals.sqrt()) @ vecs.T


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
    vals, vecs = torch.linalg.eigh(cov)
    u = vecs[:, torch.argsort(vals, descending=True)[:rank]]  # [m, rank]
    a = u.T @ y
    b = torch.linalg.solve(s, u)
    return a, b


def _balance_blocks(attn, hidden: torch.Tensor, o_w: torch.Tensor, nope_dims, rope_of_kv, num_kv: int,
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
            x = q[:, r][..., dims].reshape(-1, len(dims)).double()
            qq += x.T @ x / x.shape[0]
            gram += o[:, r].T @ o[:, r]
        if key_gain is not None:
            g = key_gain[dims].double()
            qq = qq * g[:, None] * g[None, :]
        key_blocks.append(_psd_sqrt(qq * attn.scaling**2)[0])
        value_blocks.append(_psd_sqrt(gram)[0])
    return key_blocks, value_blocks


def _block_diag_weight(key_blocks, value_blocks, alpha: float) -> torch.Tensor:
    blocks = []
    for kb, vb in zip(key_blocks, value_blocks):
        blocks += [alpha * kb, vb]
    return torch.block_diag(*blocks)


def mla_specs(specs: list[dict], rank: int, rope_pairs: list[list[list[int]]]) -> list[dict]:
    """Turn dense specs into MLA specs (same KV-head count and sinks)."""
    return [{"kind": "mla", "num_key_value_heads": s["num_key_value_heads"], "kv_lora_rank": rank,
             "rope_pairs": pairs, "sinks": s.get("sinks", False)} for s, pairs in zip(specs, rope_pairs)]


def _set_latent(attn: Csa2LatentAttention, k_w, k_b, v_w, v_b, rank: int, moment=None, weight=None) -> None:
    """Factorise the source rows into ``attn.kv_a_proj`` / ``attn.kv_b_proj`` (rope rows copied)."""
    h, d = attn.num_key_value_heads, attn.head_dim
    k_aug = _augment(k_w, k_b).view(h, d, -1)
    v_aug = _augment(v_w, v_b).view(h, d, -1)
    rows = stacked_kv_rows(k_aug, v_aug, attn.nope_dims, attn.rope_of_kv)
    a, b = factorise_kv(rows, rank, moment, weight)
    rope_rows = torch.cat([k_aug[j, attn.rope_dims[j]] for j in range(attn.num_rope_heads)]) if attn.rope_width else a[:0]
    down = torch.cat([a, rope_rows])  # [r + R*2n, d+1]
    w, bias = _split(down, attn.kv_a_proj.weight, attn.kv_a_proj.bias)
    attn.kv_a_proj.weight.copy_(w)
    if bias is not None:
        attn.kv_a_proj.bias.copy_(bias)
    elif down[:, -1].abs().max() > 0:
        raise ValueError("a bias-free source produced a latent bias")
    attn.kv_b_proj.weight.copy_(b.to(attn.kv_b_proj.weight.dtype))
    if attn.kv_b_proj.bias is not None:
        attn.kv_b_proj.bias.zero_()


def full_stack_width(config, num_key_value_heads: int, num_pairs: int) -> int:
    """The rank at which the factorisation is exact: H * (D_nope + D)."""
    d = _head_dim(config)
    return num_key_value_heads * (2 * d - 2 * num_pairs)


@torch.no_grad()
def apply_mla(model, kv_lora_rank: int, num_rope_pairs: int, *, windows: torch.Tensor | None = None,
              rope_criterion: str = "perturbation", factorisation: str = "activation_aware",
              shared_rope_key: bool = False, refit_output: bool = True, ridge: float = 0.3,
              rope_pairs: list[list[list[int]]] | None = None):
    """Return a copy of ``model`` (native or hf_csa2 with dense layers) with MLA layers.

    Args:
        kv_lora_rank: latent width ``r`` (at most the stacked width H*(2D - 2n)).
        num_rope_pairs: frequency pairs ``n`` that keep RoPE per rope-key head.
        windows: calibration token ids [N, T]; needed unless ``factorisation == 'weight_svd'``
            and ``rope_pairs`` are given.
        shared_rope_key: one rope key for all KV heads (DeepSeek-V3 layout); only possible
            as is for a single KV head (MQA sources).
        rope_pairs: explicit per-layer choice (overrides the criterion).
    The returned model carries ``fit_notes`` (per-layer dicts) and ``rope_pairs``.
    """
    if rope_criterion not in ROPE_CRITERIA:
        raise ValueError(f"rope_criterion={rope_criterion!r}; allowed: {', '.join(ROPE_CRITERIA)}")
    if factorisation not in FACTORISATIONS:
        raise ValueError(f"factorisation={factorisation!r}; allowed: {', '.join(FACTORISATIONS)}")
    cfg = model.config
    specs = [dict(s) for s in (cfg.attention_layers if is_csa2(model) else native_specs(cfg))]
    if any(s["kind"] != "dense" for s in specs):
        raise ValueError("MLA surgery needs dense attention layers as input")
    d = _head_dim(cfg)
    if not 0 <= num_rope_pairs <= d // 2:
        raise ValueError(f"num_rope_pairs={num_rope_pairs}; allowed: 0..{d // 2}")
    kv_heads = {s["num_key_value_heads"] for s in specs}
    if shared_rope_key and kv_heads != {1}:
        raise ValueError(f"shared_rope_key needs a single KV head per layer (MQA); this model has {sorted(kv_heads)}")
    for s in specs:
        width = full_stack_width(cfg, s["num_key_value_heads"], num_rope_pairs)
        if not 1 <= kv_lora_rank <= width:
            raise ValueError(f"kv_lora_rank={kv_lora_rank}; allowed: 1..{width} (= H*(2D - 2n), the exact rank)")
    layers = decoder_layers(model)

    if rope_pairs is None:
        if num_rope_pairs == d // 2:
            rope_pairs = [[list(range(d // 2))] * (1 if shared_rope_key else s["num_key_value_heads"]) for s in specs]
        else:
            if windows is None:
                raise ValueError("choosing rope pairs needs calibration windows")
            rope_pairs = [None] * len(layers)

            def make_hook(i):
                def hook(attn, args, kwargs):
                    hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
                    s = rope_pair_scores(attn, hidden, _layer_inv_freq(model, i, d), rope_criterion)
                    rope_pairs[i] = choose_rope_pairs(s, num_rope_pairs, shared_rope_key)

                return hook

            run_with_attention_hooks(model, windows[:4], lambda i, a: a.register_forward_pre_hook(make_hook(i), with_kwargs=True))
    new = to_csa2(model, mla_specs(specs, kv_lora_rank, rope_pairs))
    new_layers = decoder_layers(new)
    new.rope_pairs = rope_pairs

    def source_rows(i):
        src = layers[i].self_attn
        bias = src.k_proj.bias
        return (src.k_proj.weight.detach(), None if bias is None else bias.detach(),
                src.v_proj.weight.detach(), None if src.v_proj.bias is None else src.v_proj.bias.detach())

    if factorisation == "weight_svd":
        for i, layer in enumerate(new_layers):
            _set_latent(layer.self_attn, *source_rows(i), kv_lora_rank)
        new.fit_notes = [{} for _ in new_layers]
        return new
    if windows is None:
        raise ValueError("factorisation='activation_aware' needs calibration windows")
    targets = source_attention_outputs(model, windows)
    qk_norm = has_qk_norm(model)

    def fit_layer(i, attn, hidden, attn_kwargs):
        moment = augmented_moment(hidden)
        src = layers[i].self_attn
        gain = attn._key_gain(torch.arange(d)) if qk_norm else None
        kb, vb = _balance_blocks(src, hidden, src.o_proj.weight.detach(), attn.nope_dims, attn.rope_of_kv,
                                 attn.num_key_value_heads, gain)
        k_energy = sum(b.pow(2).sum() for b in kb)
        v_energy = sum(b.pow(2).sum() for b in vb)
        base = math.sqrt(v_energy / max(k_energy, 1e-30)) if k_energy > 0 else 1.0
        best = None
        for mult in BALANCE_GRID if attn.nope_width else (1.0,):
            _set_latent(attn, *source_rows(i), kv_lora_rank, moment, _block_diag_weight(kb, vb, base * mult))
            # Not attn(...): that would re-enter this very pre-hook.
            a, _ = attn.attention_output(hidden, attn_kwargs["position_embeddings"], attn_kwargs.get("attention_mask"))
            out = attn.o_proj(a)
            err = ((out - targets[i]).pow(2).sum() / targets[i].pow(2).sum()).item()
            if best is None or err < best[0]:
                best = (err, mult)
        _set_latent(attn, *source_rows(i), kv_lora_rank, moment, _block_diag_weight(kb, vb, base * best[1]))
        notes = {"balance": best[1], "rel_err": best[0]}
        if refit_output:
            notes.update(refit_output_projection(attn, hidden, attn_kwargs, targets[i], ridge=ridge))
        return notes

    new.fit_notes = calibrate_layerwise(new, windows, fit_layer)
    new.rope_pairs = rope_pairs
    return new


def _layer_inv_freq(model, layer_idx: int, head_dim: int) -> torch.Tensor:
    """Angular frequency of each RoPE pair [D/2] used by layer ``layer_idx``: read from the
    model's rotary embedding (Gemma3 has separate local/global ones)."""
    rotary = model.model.rotary_emb
    layer_types = getattr(model.config, "layer_types", None)
    layer_type = layer_types[layer_idx] if layer_types else None
    inv = None
    if layer_type is not None:
        inv = getattr(rotary, f"{layer_type}_inv_freq", None)
    if inv is None:
        inv = rotary.inv_freq
    if inv.shape[-1] != head_dim // 2:
        raise ValueError(f"rotary inv_freq has {inv.shape[-1]} entries; expected head_dim/2 = {head_dim // 2}")
    return inv.float()


__all__ = ["FACTORISATIONS", "ROPE_CRITERIA", "apply_mla", "choose_rope_pairs", "factorise_kv", "full_stack_width",
           "mla_specs", "pre_rope_qk", "rope_pair_scores", "rope_dim_indices"]
