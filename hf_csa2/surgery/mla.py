"""MLA surgery: rewrite dense (MHA/GQA/MQA) attention into multi-head latent attention.

Seed 004 §8-§12: the layer caches ``c = W_DKV x`` and the keys/values are up-projections
``K_h = c W_UK,h``, ``V_h = c W_UV,h``; RoPE cannot pass through that factorisation, so a few
frequency pairs keep RoPE in a small separate rope key and the rest become position-free.
Two decisions per layer:

1. **What keeps RoPE** (:func:`rope_component_scores`). A rope key is a list of complex slots,
   each at one frequency. Per-head layout: each KV head keeps its own best pairs. Shared
   layout (default, DeepSeek-V3 style): RoPE commutes with complex scalars, so per frequency
   the KV heads' keys are first mixed into principal components (query-energy-weighted
   complex PCA, :func:`head_mixing`), and the best (frequency, component) cells become the
   slots; queries read them through complex coefficients and every head keeps the uncaptured
   remainder position-free. Scores: ``perturbation`` (ours, default): making a component
   position-free changes each logit by ``Re(q conj(k) (e^{i theta (m-n)} - 1))``; its expected
   square under the source layer's own attention weights is exactly the damage.
   ``norm``: MHA2MLA's 2-norm score ``E|q| E|k|``. On SmolLM2 (held-out ppl ratio with
   exact factorisation, so only RoPE is lost): 4 pairs per head cost 10.1x with
   ``perturbation`` and 20.1x with ``norm``; a 96-wide rope key costs 1.028x per head and
   1.013x shared (``python scripts/sweep_mla.py --full-rank --pairs 4 --windows 3
   --factorisations weight_svd``; ``--pairs 16`` without / ``--pairs 48 --shared``).
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
:mod:`.layerwise`), then ``o_proj`` is refitted to the source layer's output. For the
DeepSeek-V3 export the latent can be RMS-normalised (the up-projection is then refitted by
least squares after the norm) and the rope frequencies made the same in every layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..model.attention_base import apply_rotary
from ..model.configuration_hf_csa2 import attention_head_dim
from ..model.latent_attention import Csa2LatentAttention, rope_dim_indices
from ..model.sink_attention import masked_logits
from .calibration import augmented_moment, decoder_layers, run_with_attention_hooks
from .gqa import _augment, _split, has_qk_norm
from .layerwise import (
    calibrate_layerwise,
    refine_layer_output,
    refit_output_projection,
    source_attention_outputs,
)
from .rebuild import is_csa2, native_specs, to_csa2

ROPE_CRITERIA = ("perturbation", "norm")
FACTORISATIONS = ("activation_aware", "weight_svd")
BALANCE_GRID = (0.25, 0.5, 1.0, 2.0, 4.0)


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


@dataclass
class RopeSplit:
    """One layer's RoPE decision.

    ``pairs`` is the spec's ``rope_pairs``. For a mixed shared key (several KV heads, one
    rope key) ``mixing`` [F, H, H] complex holds, per frequency, the components (columns,
    best first) of the query-weighted keys ``y_h = w_h k_h`` with weights ``w`` [H, F], and
    ``slots`` lists the (frequency, component) of each rope-key slot in key order.
    ``dropped`` lists (frequency, component-or-head) cells that neither keep RoPE nor stay
    position-free: their logit term is removed (cheaper than a position-free copy of a term
    that rotates fast, see :func:`rope_component_scores`).
    """

    pairs: list[list[int]]
    mixing: torch.Tensor | None = None
    weights: torch.Tensor | None = None
    slots: list[tuple[int, int]] | None = None
    dropped: list[tuple[int, int]] = field(default_factory=list)


def head_mixing(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-frequency complex PCA of the KV heads' keys weighted by their readers' query energy.

    q [N, HQ, T, F], k [N, H, T, F] complex -> (mixing [F, H, H] complex128, columns sorted by
    decreasing energy; weights [H, F] float64).
    """
    hq, h = q.shape[1], k.shape[1]
    group = hq // h
    energy = q.abs().pow(2).mean((0, 2)).double().view(h, group, -1).sum(1)  # [H, F]
    w = energy.clamp_min(1e-12).sqrt()
    y = k.to(torch.complex128) * w[None, :, None, :]  # [N, H, T, F]
    cov = torch.einsum("nhtf,ngtf->fhg", y, y.conj()) / (y.shape[0] * y.shape[2])  # [F, H, H]
    vals, vecs = torch.linalg.eigh(cov)
    return vecs.flip(-1), w


@torch.no_grad()
def rope_component_scores(q: torch.Tensor, k: torch.Tensor, inv_freq: torch.Tensor, scaling: float,
                          criterion: str = "perturbation", mixing: torch.Tensor | None = None,
                          weights: torch.Tensor | None = None, drop_scores: bool = False):
    """Importance of keeping RoPE on each key component at each frequency: [H, F] (higher = keep).

    Components are the KV heads themselves (``mixing`` None) or the mixed components of
    :func:`head_mixing`. q [N, HQ, T, F], k [N, H, T, F] complex (pre-RoPE pairs).
    ``perturbation``: attention-weighted E[(logit change when the component loses RoPE)^2]
    under the source's own attention; ``norm``: E|q| E|k| (MHA2MLA's 2-norm).
    With ``drop_scores`` (perturbation only) also returns the damage of removing the term
    altogether, E[(its logit contribution)^2]: for a fast-rotating term that is about half the
    damage of a position-free copy (whose error ``e^{i theta (m-n)} - 1`` is then ~ twice the term).
    """
    if criterion not in ROPE_CRITERIA:
        raise ValueError(f"criterion={criterion!r}; allowed: {', '.join(ROPE_CRITERIA)}")
    hq, h = q.shape[1], k.shape[1]
    group = hq // h
    if mixing is None:  # component j = KV head j, read by its own group with coefficient 1
        coef = torch.eye(h, dtype=torch.complex128)[None].expand(q.shape[-1], h, h)  # [F, g, j]
        comps = k
    else:
        coef = mixing.conj() / weights.T[:, :, None]  # [F, g, j] = conj(v_gj) / w_g
        comps = torch.einsum("fhj,nhtf->njtf", mixing.conj(), k.to(torch.complex128) * weights[None, :, None, :])
    coef, comps = coef.to(torch.complex64), comps.to(torch.complex64)
    scores = torch.zeros(h, q.shape[-1], dtype=torch.float64)
    drops = torch.zeros_like(scores)
    if criterion == "norm":
        if drop_scores:
            raise ValueError("drop scores need criterion='perturbation'")
        for r in range(hq):
            qr = (q[:, r, :, None, :] * coef[:, r // group, :].T[None, None]).abs().mean((0, 1))  # [J, F]
            scores += (qr * comps.abs().mean((0, 2))).double()
        return scores
    t = q.shape[2]
    pos = torch.arange(t, dtype=torch.float32)
    delta = pos[:, None] - pos[None, :]  # [T, T] query minus key position
    causal = delta >= 0
    angle = delta[..., None] * inv_freq.float()  # [T, T, F]
    rotation = torch.polar(torch.ones(()), angle)
    for r in range(hq):
        g = r // group
        for n in range(q.shape[0]):
            # The source attention weights decide which (query, key) position pairs matter.
            logits = ((q[n, r][:, None, :] * k[n, g].conj()[None, :, :]) * rotation).real.sum(-1) * scaling
            p = torch.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1)[..., None]  # [T, T, 1]
            js = [g] if mixing is None else list(range(h))  # components this query head reads
            qj = q[n, r][None] * coef[:, g, js].T[:, None, :]  # [J', T, F]
            prod = qj[:, :, None, :] * comps[n, js].conj()[:, None, :, :]  # [J', T, T, F]
            change = (prod * (rotation - 1)).real * scaling  # logit change if the component loses RoPE
            scores[js] += (p * change.pow(2)).sum((1, 2)).double()
            if drop_scores:
                term = (prod * rotation).real * scaling  # logit change if the term is removed
                drops[js] += (p * term.pow(2)).sum((1, 2)).double()
    return (scores, drops) if drop_scores else scores


@dataclass
class RopeScores:
    """A layer's rope-slot scores [J, F] (J = KV heads, or mixed components) and, for a
    mixed shared key, the mixing it was scored under."""

    scores: torch.Tensor
    mixing: torch.Tensor | None = None
    weights: torch.Tensor | None = None
    drop: torch.Tensor | None = None  # [J, F] damage of removing each term (None: never drop)

    def keep_scores(self) -> torch.Tensor:
        """Damage of NOT keeping each cell in RoPE: the cheaper of position-free and removed."""
        return self.scores if self.drop is None else torch.minimum(self.scores, self.drop)


def score_rope_slots(q: torch.Tensor, k: torch.Tensor, inv_freq: torch.Tensor, scaling: float, shared: bool,
                     criterion: str = "perturbation", drop: bool = False) -> RopeScores:
    """Scores of one layer from its calibration queries/keys (complex pairs [N, H(Q), T, F]);
    ``drop`` also scores removing each term (see :func:`rope_component_scores`)."""
    mixing = weights = None
    if shared and k.shape[1] > 1:
        mixing, weights = head_mixing(q, k)
    out = rope_component_scores(q, k, inv_freq, scaling, criterion, mixing, weights, drop_scores=drop)
    scores, drops = out if drop else (out, None)
    return RopeScores(scores, mixing, weights, drops)


def frequency_counts(scores: torch.Tensor, num_slots: int) -> dict[int, int]:
    """How many slots each frequency gets when the ``num_slots`` best (component, frequency)
    cells of ``scores`` [J, F] are kept (a frequency's slots take its best components)."""
    j = scores.shape[0]
    flat = torch.topk(scores.T.reshape(-1), num_slots).indices.tolist() if num_slots else []
    counts: dict[int, int] = {}
    for idx in flat:
        counts[idx // j] = counts.get(idx // j, 0) + 1
    return counts


def split_from_scores(scored: RopeScores, num_pairs: int, shared: bool, counts: dict[int, int] | None = None) -> RopeSplit:
    """Per-head layout: each KV head's ``num_pairs`` best pairs (one list for all heads when
    ``shared`` with a single head). Mixed shared key: ``counts`` slots per frequency (default:
    the layer's own best ``num_pairs`` cells), taking each frequency's components in PCA order.
    With ``counts`` given, per-head layouts use the frequencies it lists (uniform across layers).
    Cells not kept whose removal costs less than a position-free copy are listed as dropped."""
    scores = scored.keep_scores()
    if scored.mixing is None:
        if shared:
            scores = scores.sum(0, keepdim=True)
        if counts is not None:
            split = RopeSplit([sorted(counts)] * scores.shape[0])
        else:
            split = RopeSplit([sorted(torch.topk(sc, num_pairs).indices.tolist()) if num_pairs else [] for sc in scores])
        kept = {(f, j) for j, fs in enumerate(split.pairs) for f in fs}
        if shared:  # one list for every head
            kept = {(f, j) for f, _ in kept for j in range(scored.scores.shape[0])}
    else:
        counts = frequency_counts(scores, num_pairs) if counts is None else counts
        slots = sorted((f, j) for f, c in counts.items() for j in range(c))
        split = RopeSplit([[f for f, _ in slots]], scored.mixing, scored.weights, slots)
        kept = set(slots)
    if scored.drop is not None:
        cheaper = (scored.drop < scored.scores).nonzero().tolist()  # [(j, f)]
        split.dropped = sorted((f, j) for j, f in cheaper if (f, j) not in kept)
    return split


def uniform_frequency_counts(all_scores: list[RopeScores], num_pairs: int) -> dict[int, int]:
    """One choice of rope frequencies for every layer (a single rope table, as DeepSeek-V3
    needs): the best cells of the scores normalised per layer and summed over layers."""
    total = sum(s.keep_scores() / s.keep_scores().sum().clamp_min(1e-30) for s in all_scores)
    if all_scores[0].mixing is None:
        best = torch.topk(total.sum(0), num_pairs).indices.tolist() if num_pairs else []
        return {f: 1 for f in best}
    return frequency_counts(total, num_pairs)


def choose_rope_split(q: torch.Tensor, k: torch.Tensor, inv_freq: torch.Tensor, scaling: float, num_pairs: int,
                      shared: bool, criterion: str = "perturbation") -> RopeSplit:
    """Pick the rope slots of one layer from its calibration queries/keys (complex pairs):
    per-head layout, the ``num_pairs`` best pairs of each KV head; shared key, the
    ``num_pairs`` best (frequency, mixed component) slots overall."""
    return split_from_scores(score_rope_slots(q, k, inv_freq, scaling, shared, criterion), num_pairs, shared)


def layer_rope_scores(attn, hidden: torch.Tensor, inv_freq: torch.Tensor, shared: bool,
                      criterion: str = "perturbation", max_tokens: int = 256, drop: bool = False) -> RopeScores:
    """:func:`score_rope_slots` from a dense layer's input [N, T, hidden] (first ``max_tokens``
    positions of each window: the perturbation score costs O(T^2))."""
    q, k = pre_rope_qk(attn, hidden[:, :max_tokens])
    return score_rope_slots(_complex_pairs(q), _complex_pairs(k), inv_freq, attn.scaling, shared, criterion, drop)


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


def refine_for_averaged_values(rows: torch.Tensor, a: torch.Tensor, num_key_rows: torch.Tensor, moment: torch.Tensor,
                               value_moment: torch.Tensor, weight: torch.Tensor, iters: int = 4,
                               ridge: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """Alternating refinement of ``A`` [r, d+1] and ``B`` [m, r] when key and value rows are judged
    under different input moments.

    Keys matter at each token's own input (``E[x~ x~^T]``), values only through the attention
    average ``x- = sum_j p_j x~_j`` that reads them (``E[x- x-^T]``: directions that average
    out cost nothing). Minimises ``sum_i E||S_i (M_i - B_i A) x_i||^2`` over the key block
    (``num_key_rows`` mask [m] True) and the value block: B by least squares per block; A from
    ``P_k A Sigma + P_v A Sigma- = R``, solved exactly by diagonalising ``Sigma-`` in the
    metric of ``Sigma`` (one r x r solve per column).
    """
    eye = torch.eye(moment.shape[0], dtype=torch.float64)
    sig_k = moment + ridge * moment.diagonal().mean() * eye
    sig_v = value_moment + ridge * value_moment.diagonal().mean() * eye
    w = weight.T @ weight
    key, val = num_key_rows, ~num_key_rows
    chol = torch.linalg.cholesky(sig_k)
    g = torch.linalg.solve_triangular(chol, torch.linalg.solve_triangular(chol, sig_v, upper=False).T, upper=False)
    lam, vecs = torch.linalg.eigh((g + g.T) / 2)

    def fit_b(a_now):
        b = torch.zeros(rows.shape[0], a_now.shape[0], dtype=torch.float64)
        for mask, sig in ((key, sig_k), (val, sig_v)):
            if mask.any():
                gram = a_now @ sig @ a_now.T
                gram = gram + ridge * gram.diagonal().mean().clamp_min(1e-30) * torch.eye(gram.shape[0], dtype=torch.float64)
                b[mask] = torch.linalg.solve(gram, a_now @ sig @ rows[mask].T).T
        return b

    b = fit_b(a)
    for _ in range(iters):
        wk, wv = w[key][:, key], w[val][:, val]
        bk, bv = b[key], b[val]
        p_k, p_v = bk.T @ wk @ bk, bv.T @ wv @ bv
        rhs = bk.T @ wk @ rows[key] @ sig_k + bv.T @ wv @ rows[val] @ sig_v  # [r, d+1]
        # A Sigma_k = A C C^T; with A~ = A C: P_k A~ + P_v A~ G = rhs C^-T, G = C^-1 Sigma_v C^-T = V diag(lam) V^T.
        r_hat = torch.linalg.solve_triangular(chol, rhs.T, upper=False).T @ vecs
        a_hat = torch.stack([torch.linalg.solve(p_k + lam[j] * p_v, r_hat[:, j]) for j in range(r_hat.shape[1])], dim=1)
        a = torch.linalg.solve_triangular(chol.T, (a_hat @ vecs.T).T, upper=True).T
        b = fit_b(a)
    return a, b


def attention_averaged_moment(attn, hidden: torch.Tensor, position_embeddings, attention_mask=None,
                              max_windows: int = 4) -> torch.Tensor:
    """``E[x- x-^T]`` [d+1, d+1] of the attention-averaged augmented inputs ``x- = sum_j p_j x~_j``
    over every query position and query head of a dense source layer; hidden [N, T, d] (the
    first ``max_windows`` windows: the averages cost O(T^2 d) per head)."""
    hidden = hidden[:max_windows]
    if attention_mask is not None:
        attention_mask = attention_mask[:max_windows]
    cos, sin = position_embeddings
    position_embeddings = (cos[:max_windows], sin[:max_windows])
    n, t, _ = hidden.shape
    q, k = pre_rope_qk(attn, hidden)
    cos, sin = position_embeddings
    q, k = apply_rotary(q, k, cos, sin)
    logits, _ = masked_logits(q.float(), k.float(), attention_mask, scaling=attn.scaling)
    p = torch.softmax(logits, dim=-1)  # [N, HQ, T, T]
    x = torch.cat([hidden, hidden.new_ones(n, t, 1)], dim=-1).double()
    total = torch.zeros(x.shape[-1], x.shape[-1], dtype=torch.float64)
    for head in range(p.shape[1]):
        avg = (p[:, head].double() @ x).reshape(-1, x.shape[-1])  # [N*T, d+1]
        total += avg.T @ avg
    return total / (p.shape[1] * n * t)


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
            gram += o[:, r].T @ o[:, r]
            if len(dims):
                x = q[:, r][..., dims].reshape(-1, len(dims)).double()
                qq += x.T @ x / x.shape[0]
        if key_gain is not None:
            g = key_gain[dims].double()
            qq = qq * g[:, None] * g[None, :]
        # No position-free key rows (every pair keeps RoPE): an empty key block.
        key_blocks.append(_psd_sqrt(qq * attn.scaling**2)[0] if len(dims) else qq)
        value_blocks.append(_psd_sqrt(gram)[0])
    return key_blocks, value_blocks


def _block_diag_weight(key_blocks, value_blocks, alpha: float) -> torch.Tensor:
    blocks = []
    for kb, vb in zip(key_blocks, value_blocks):
        blocks += [alpha * kb, vb]
    return torch.block_diag(*blocks)


def mla_specs(specs: list[dict], ranks: list[int], splits: list[RopeSplit], latent_norm: bool = False) -> list[dict]:
    """Turn dense specs into MLA specs (same KV-head count and sinks), one rank per layer."""
    return [{"kind": "mla", "num_key_value_heads": s["num_key_value_heads"], "kv_lora_rank": rank,
             "rope_pairs": split.pairs, "sinks": s.get("sinks", False), "latent_norm": latent_norm}
            for s, split, rank in zip(specs, splits, ranks)]


@torch.no_grad()
def allocate_ranks(model, splits: list[RopeSplit], windows: torch.Tensor, average_rank: int, step: int = 4,
                   min_rank: int | None = None) -> list[int]:
    """Uneven latent ranks with ``sum = layers * average_rank``, chosen from calibration error.

    For each layer (source activations on ``windows``) the weighted factorisation error at
    rank ``r`` is the tail of the spectrum of ``S M E[x~ x~^T] M^T S`` (balance factor 1),
    relative to the energy of the layer's attention output; from a floor of ``min_rank``
    (default a quarter of the average), ranks are handed out ``step`` at a time to the layer
    whose relative error drops most (greedy water-filling, optimal for convex tails).
    """
    layers = decoder_layers(model)
    tails: list[torch.Tensor] = [None] * len(layers)
    widths: list[int] = [0] * len(layers)

    def make_hook(i):
        def hook(attn, args, kwargs, output):
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            moment = augmented_moment(hidden)
            d = attn.head_dim
            h = attn.k_proj.weight.shape[0] // d
            k_aug = _augment(attn.k_proj.weight, attn.k_proj.bias).view(h, d, -1)
            v_aug = _augment(attn.v_proj.weight, attn.v_proj.bias).view(h, d, -1)
            _, k_free, _ = split_key_rows(k_aug, splits[i])
            mixed = splits[i].mixing is not None
            nope_dims = rope_dim_indices(splits[i].pairs, d, mixed)[1]
            rope_of_kv = torch.arange(h) if len(splits[i].pairs) > 1 else torch.zeros(h, dtype=torch.long)
            rows = stacked_kv_rows(k_free, v_aug, nope_dims, rope_of_kv)
            kb, vb = _balance_blocks(attn, hidden, attn.o_proj.weight.detach(), nope_dims, rope_of_kv, h, None)
            k_energy = sum(b.pow(2).sum() for b in kb)
            v_energy = sum(b.pow(2).sum() for b in vb)
            alpha = math.sqrt(v_energy / k_energy) if k_energy > 0 else 1.0
            y = _block_diag_weight(kb, vb, alpha) @ rows
            vals = torch.linalg.eigvalsh(y @ moment @ y.T).flip(0).clamp_min(0)
            out_energy = output[0].double().pow(2).sum(-1).mean().clamp_min(1e-30)
            tails[i] = (vals.sum() - torch.cat([vals.new_zeros(1), vals.cumsum(0)])) / out_energy  # tail[r]
            widths[i] = rows.shape[0]

        return hook

    run_with_attention_hooks(model, windows, lambda i, a: a.register_forward_hook(make_hook(i), with_kwargs=True))
    floor = max(1, average_rank // 4) if min_rank is None else min(min_rank, average_rank)
    ranks = [min(floor, w) for w in widths]
    budget = average_rank * len(layers) - sum(ranks)
    while budget > 0:
        gains = [(tails[i][r] - tails[i][min(r + min(step, budget), widths[i])]).item() if r < widths[i] else -1.0
                 for i, r in enumerate(ranks)]
        best = max(range(len(ranks)), key=lambda i: gains[i])
        if gains[best] < 0:
            break
        add = min(step, budget, widths[best] - ranks[best])
        ranks[best] += add
        budget -= add
    return ranks


def scale_anchor(down: torch.Tensor, hidden: torch.Tensor | None, ratio: float = 100.0) -> torch.Tensor:
    """A latent row [1, d+1] that is a large constant (bias only).

    An RMS norm on the latent throws away each token's latent magnitude, which keys and values
    need. With one coordinate held at ``beta`` >> ``|c|`` the RMS is ~``beta / sqrt(r)`` for
    every token, so the norm becomes a constant rescale (relative wobble ``|c|^2 / 2 beta^2``,
    5e-5 at ``ratio`` 100) and the up-projection, refitted after it, sees the magnitudes again.
    """
    if hidden is None:
        raise ValueError("a normalised latent needs calibration activations")
    x = hidden.reshape(-1, hidden.shape[-1]).double()
    x = torch.cat([x, x.new_ones(x.shape[0], 1)], dim=1)
    beta = ratio * (x @ down.T).pow(2).sum(-1).max().sqrt().clamp_min(1.0)
    row = torch.zeros(1, down.shape[1], dtype=torch.float64)
    row[0, -1] = beta
    return row


def refit_up_projection(attn: Csa2LatentAttention, rows: torch.Tensor, down: torch.Tensor, hidden: torch.Tensor,
                        ridge: float = 1e-6) -> torch.Tensor:
    """Up-projection ``B`` [m, r] for a normalised latent: least squares of the target rows'
    outputs ``rows x~`` on ``norm(down x~)`` over the calibration tokens ``hidden`` [N, T, d]
    (the same ``B`` for any invertible row weighting). The norm's gain is reset to 1."""
    x = hidden.reshape(-1, hidden.shape[-1]).double()
    x = torch.cat([x, x.new_ones(x.shape[0], 1)], dim=1)
    c = x @ down.T
    c = c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + attn.kv_a_layernorm.variance_epsilon)
    y = x @ rows.T
    gram = c.T @ c
    lam = ridge * gram.diagonal().mean().clamp_min(1e-12) * torch.eye(gram.shape[0], dtype=torch.float64)
    attn.kv_a_layernorm.weight.fill_(1.0)
    return torch.linalg.solve(gram + lam, c.T @ y).T


def split_key_rows(k_aug: torch.Tensor, split: RopeSplit) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Source key rows [H, D, d+1] -> (rope-key rows [R*2n, d+1] in cache order, position-free
    key rows per head [H, D, d+1] with the rope part removed, query coefficients [H, n, 2] or None).

    Per-head layout: the rope rows are the listed pairs' rows, and those rows count as
    removed from the position-free part (callers drop them via ``nope_dims``). Mixed shared
    key: slot ``(f, j)`` is component ``j`` of frequency ``f``, ``sum_h conj(v_hj) w_h k_h^f``;
    every head keeps, position-free, the residual of its key that the slots do not carry.
    """
    h, d, _ = k_aug.shape
    half = d // 2
    if split.mixing is None:
        rope_dims, _ = rope_dim_indices(split.pairs, d)
        rope = torch.cat([k_aug[j, rope_dims[j]] for j in range(len(split.pairs))]) if split.pairs[0] else k_aug[0, :0]
        free = k_aug.clone()
        for f, head in split.dropped:
            free[head, [f, f + half]] = 0
        return rope, free, None
    kc = torch.complex(k_aug[:, :half], k_aug[:, half:])  # [H, F, d+1]
    mixing, w = split.mixing, split.weights  # [F, H, J], [H, F]
    comps = torch.einsum("fhj,hfc->jfc", mixing.conj(), kc * w[..., None])  # [J, F, d+1]
    slots = split.slots
    slot_rows = torch.stack([comps[j, f] for f, j in slots]) if slots else kc[0, :0]
    residual = kc.clone()
    coef = torch.zeros(h, len(slots), 2, dtype=torch.float64)
    for s, (f, j) in enumerate(slots):
        residual[:, f] -= (mixing[f, :, j] / w[:, f])[:, None] * comps[j, f][None]
        c = mixing[f, :, j].conj() / w[:, f]
        coef[:, s, 0], coef[:, s, 1] = c.real, c.imag
    for f, j in split.dropped:
        residual[:, f] -= (mixing[f, :, j] / w[:, f])[:, None] * comps[j, f][None]
    rope = torch.cat([slot_rows.real, slot_rows.imag])
    return rope, torch.cat([residual.real, residual.imag], dim=1), coef


def _set_latent(attn: Csa2LatentAttention, split: RopeSplit, k_w, k_b, v_w, v_b, rank: int, moment=None, weight=None,
                hidden: torch.Tensor | None = None, value_moment: torch.Tensor | None = None) -> None:
    """Factorise the source rows into ``attn.kv_a_proj`` / ``attn.kv_b_proj`` (+ the rope rows);
    ``value_moment`` refines it for attention-averaged values (:func:`refine_for_averaged_values`);
    a normalised latent refits the up-projection on ``hidden`` [N, T, d]."""
    h, d = attn.num_key_value_heads, attn.head_dim
    k_aug = _augment(k_w, k_b).view(h, d, -1)
    v_aug = _augment(v_w, v_b).view(h, d, -1)
    rope_rows, k_free, coef = split_key_rows(k_aug, split)
    rows = stacked_kv_rows(k_free, v_aug, attn.nope_dims, attn.rope_of_kv)
    keep_scale = attn.kv_a_layernorm is not None and rank > 1
    a, b = factorise_kv(rows, rank - 1 if keep_scale else rank, moment, weight)
    if keep_scale:
        a = torch.cat([a, scale_anchor(a, hidden)])
    if value_moment is not None:
        key_rows = torch.cat([torch.arange(attn.nope_width + d) < attn.nope_width for _ in range(h)])
        a, b = refine_for_averaged_values(rows, a, key_rows, moment, value_moment, weight)
    if attn.kv_a_layernorm is not None:
        if hidden is None:
            raise ValueError("a normalised latent needs calibration activations to fit its up-projection")
        b = refit_up_projection(attn, rows, a, hidden)
    down = torch.cat([a, rope_rows])  # [r + R*2n, d+1]
    w, bias = _split(down, attn.kv_a_proj.weight, attn.kv_a_proj.bias)
    attn.kv_a_proj.weight.copy_(w)
    if bias is not None:
        attn.kv_a_proj.bias.copy_(bias)
    attn.kv_b_proj.weight.copy_(b.to(attn.kv_b_proj.weight.dtype))
    if attn.kv_b_proj.bias is not None:
        attn.kv_b_proj.bias.zero_()
    if coef is not None:
        attn.q_rope_coef.copy_(coef.to(attn.q_rope_coef.dtype))


def full_stack_width(config, num_key_value_heads: int, num_pairs: int, shared: bool = False) -> int:
    """The rank at which the factorisation is exact: H * (D_nope + D) (D_nope = D for a mixed
    shared rope key, D - 2n per head otherwise)."""
    d = attention_head_dim(config)
    nope = d if shared and num_key_value_heads > 1 else d - 2 * num_pairs
    return num_key_value_heads * (nope + d)


@torch.no_grad()
def apply_mla(model, kv_lora_rank: int, num_rope_pairs: int, *, windows: torch.Tensor | None = None,
              rope_criterion: str = "perturbation", factorisation: str = "activation_aware",
              shared_rope_key: bool = False, refit_output: bool = True, ridge: float = 0.3,
              splits: list[RopeSplit] | None = None, latent_norm: bool = False, uniform_rope: bool = False,
              averaged_values: bool = False, drop_fast_terms: bool = False, uneven_ranks: bool = False,
              only_layers: list[int] | None = None, refine_steps: int = 0, refine_lr: float = 1e-4):
    """Return a copy of ``model`` (native or hf_csa2 with dense layers) with MLA layers.

    Args:
        kv_lora_rank: latent width ``r`` (at most :func:`full_stack_width`).
        num_rope_pairs: complex rope slots ``n`` per rope key (per KV head, or in total for a
            shared key): the rope key holds ``2n`` numbers.
        windows: calibration token ids [N, T]; needed unless ``factorisation == 'weight_svd'``
            and every pair keeps RoPE (or ``splits`` are given).
        shared_rope_key: one rope key for all KV heads (DeepSeek-V3 layout), whose slots mix
            the heads per frequency (RoRoPE-style PCA).
        splits: explicit per-layer RoPE decisions (override the criterion).
        latent_norm: RMS-normalise the latent before caching (DeepSeek-V3's kv_a_layernorm);
            the up-projection is then refitted by least squares on the calibration data.
        uniform_rope: the same rope frequencies in every layer (one rope table, as
            DeepSeek-V3 has); each layer still mixes its own heads.
        averaged_values: judge value rows under the attention-averaged input moment
            (:func:`refine_for_averaged_values`) instead of the per-token one.
        drop_fast_terms: remove (instead of keeping position-free) the non-RoPE terms whose
            removal costs less (needs ``rope_criterion='perturbation'``).
        uneven_ranks: ``kv_lora_rank`` is the AVERAGE rank; each layer's comes from
            :func:`allocate_ranks` (same total cache).
        only_layers: convert only these layers (e.g. the full layers of a CSA2 plan); the
            others stay dense and unchanged.
        refine_steps: after the closed-form fit, Adam steps on each layer's output error
            (:func:`refine_layer_output`, all the layer's parameters, learning rate
            ``refine_lr``; the state kept is the best on held-out calibration windows).
    The returned model carries ``fit_notes`` (per-layer dicts) and ``rope_splits``.
    """
    if rope_criterion not in ROPE_CRITERIA:
        raise ValueError(f"rope_criterion={rope_criterion!r}; allowed: {', '.join(ROPE_CRITERIA)}")
    if factorisation not in FACTORISATIONS:
        raise ValueError(f"factorisation={factorisation!r}; allowed: {', '.join(FACTORISATIONS)}")
    cfg = model.config
    specs = [dict(s) for s in (cfg.attention_layers if is_csa2(model) else native_specs(cfg))]
    if any(s["kind"] != "dense" for s in specs):
        raise ValueError("MLA surgery needs dense attention layers as input")
    d = attention_head_dim(cfg)
    qk_norm = has_qk_norm(model)
    if shared_rope_key and qk_norm and any(s["num_key_value_heads"] > 1 for s in specs):
        raise ValueError("shared_rope_key with several KV heads needs a source without QK-norm "
                         "(each key head is normalised separately); use per-head rope keys")
    for s in specs:
        mixed = shared_rope_key and s["num_key_value_heads"] > 1
        max_pairs = s["num_key_value_heads"] * d // 2 if mixed else d // 2
        if not 0 <= num_rope_pairs <= max_pairs:
            raise ValueError(f"num_rope_pairs={num_rope_pairs}; allowed: 0..{max_pairs}")
        width = full_stack_width(cfg, s["num_key_value_heads"], num_rope_pairs, shared_rope_key)
        if not 1 <= kv_lora_rank <= width:
            raise ValueError(f"kv_lora_rank={kv_lora_rank}; allowed: 1..{width} (the exact rank)")
    layers = decoder_layers(model)

    if splits is None:
        if num_rope_pairs == d // 2 and not shared_rope_key:
            splits = [RopeSplit([list(range(d // 2))] * s["num_key_value_heads"]) for s in specs]
        else:
            if windows is None:
                raise ValueError("choosing the rope slots needs calibration windows")
            scored: list[RopeScores | None] = [None] * len(layers)

            def make_hook(i):
                def hook(attn, args, kwargs):
                    hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
                    scored[i] = layer_rope_scores(attn, hidden, _layer_inv_freq(model, i, d), shared_rope_key, rope_criterion,
                                                  drop=drop_fast_terms)

                return hook

            run_with_attention_hooks(model, windows[:4], lambda i, a: a.register_forward_pre_hook(make_hook(i), with_kwargs=True))
            counts = uniform_frequency_counts(scored, num_rope_pairs) if uniform_rope else None
            splits = [split_from_scores(sc, num_rope_pairs, shared_rope_key, counts) for sc in scored]
    if latent_norm and (windows is None or factorisation != "activation_aware"):
        raise ValueError("latent_norm needs calibration windows and factorisation='activation_aware'")
    ranks = [kv_lora_rank] * len(layers)
    if uneven_ranks:
        if windows is None:
            raise ValueError("uneven_ranks needs calibration windows")
        ranks = allocate_ranks(model, splits, windows[:4], kv_lora_rank)
    converted = set(range(len(layers)) if only_layers is None else only_layers)
    if not converted <= set(range(len(layers))):
        raise ValueError(f"only_layers={sorted(converted)}; allowed: layer indices 0..{len(layers) - 1}")
    if uneven_ranks and only_layers is not None:
        raise ValueError("uneven_ranks spreads one budget over every layer; it cannot be combined with only_layers")
    new_specs = [m if i in converted else s for i, (s, m) in enumerate(zip(specs, mla_specs(specs, ranks, splits, latent_norm)))]
    new = to_csa2(model, new_specs)
    new_layers = decoder_layers(new)
    new.rope_splits = splits

    def source_rows(i):
        src = layers[i].self_attn
        return (src.k_proj.weight.detach(), None if src.k_proj.bias is None else src.k_proj.bias.detach(),
                src.v_proj.weight.detach(), None if src.v_proj.bias is None else src.v_proj.bias.detach())

    if factorisation == "weight_svd":
        for i, layer in enumerate(new_layers):
            if i in converted:
                _set_latent(layer.self_attn, splits[i], *source_rows(i), ranks[i])
        new.fit_notes = [{} for _ in new_layers]
        return new
    if windows is None:
        raise ValueError("factorisation='activation_aware' needs calibration windows")
    targets = source_attention_outputs(model, windows)

    def fit_layer(i, attn, hidden, attn_kwargs):
        if i not in converted:
            return {}
        moment = augmented_moment(hidden)
        src = layers[i].self_attn
        gain = attn._key_gain(torch.arange(d)) if qk_norm else None
        kb, vb = _balance_blocks(src, hidden, src.o_proj.weight.detach(), attn.nope_dims, attn.rope_of_kv,
                                 attn.num_key_value_heads, gain)
        k_energy = sum(b.pow(2).sum() for b in kb)
        v_energy = sum(b.pow(2).sum() for b in vb)
        base = math.sqrt(v_energy / k_energy) if k_energy > 0 else 1.0
        value_moment = (attention_averaged_moment(src, hidden, attn_kwargs["position_embeddings"],
                                                  attn_kwargs.get("attention_mask")) if averaged_values else None)
        best = None
        for mult in BALANCE_GRID if attn.nope_width else (1.0,):
            _set_latent(attn, splits[i], *source_rows(i), ranks[i], moment, _block_diag_weight(kb, vb, base * mult), hidden,
                        value_moment)
            # Not attn(...): that would re-enter this very pre-hook.
            a, _ = attn.attention_output(hidden, attn_kwargs["position_embeddings"], attn_kwargs.get("attention_mask"))
            err = ((attn.o_proj(a) - targets[i]).pow(2).sum() / targets[i].pow(2).sum()).item()
            if best is None or err < best[0]:
                best = (err, mult)
        _set_latent(attn, splits[i], *source_rows(i), ranks[i], moment, _block_diag_weight(kb, vb, base * best[1]), hidden,
                    value_moment)
        notes = {"balance": best[1], "rel_err": best[0]}
        if refit_output:
            notes.update(refit_output_projection(attn, hidden, attn_kwargs, targets[i], ridge=ridge))
        if refine_steps:
            notes.update(refine_layer_output(attn, hidden, attn_kwargs, targets[i], list(attn.parameters()),
                                             steps=refine_steps, lr=refine_lr))
        return notes

    new.fit_notes = calibrate_layerwise(new, windows, fit_layer)
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


__all__ = ["FACTORISATIONS", "ROPE_CRITERIA", "RopeSplit", "allocate_ranks", "apply_mla", "choose_rope_split", "factorise_kv",
           "full_stack_width", "head_mixing", "layer_rope_scores", "split_from_scores", "uniform_frequency_counts", "mla_specs", "pre_rope_qk", "rope_component_scores",
           "split_key_rows"]
