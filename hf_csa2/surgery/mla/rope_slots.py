"""Which key components keep RoPE in an MLA layer, and the key rows that split implies.

RoPE cannot pass through the latent factorisation, so a few (frequency, component) cells keep
RoPE in a small separate rope key and the rest of the key becomes position-free. A rope key is
a list of complex slots, each at one frequency.

* Per-head layout: each KV head keeps its own best pairs.
* Shared layout (default, DeepSeek-V3 style): RoPE commutes with complex scalars, so per
  frequency the KV heads' keys are first mixed into principal components (query-energy-weighted
  complex PCA, :func:`head_mixing`, as RoRoPE does), and the best (frequency, component) cells
  become the slots; queries read them through complex coefficients and every head keeps the
  uncaptured remainder position-free (:func:`split_key_rows`).

Scores (:func:`rope_component_scores`): ``perturbation`` (ours, default): making a component
position-free changes each logit by ``Re(q conj(k) (e^{i theta (m-n)} - 1))``; its expected
square under the source layer's own attention weights is exactly the damage. ``norm``:
MHA2MLA's 2-norm score ``E|q| E|k|``. On SmolLM2 (held-out ppl ratio with exact factorisation,
so only RoPE is lost): 4 pairs per head cost 10.1x with ``perturbation`` and 20.1x with
``norm``; a 96-wide rope key costs 1.028x per head and 1.013x shared (``python
scripts/sweep_mla.py --full-rank --pairs 4 --windows 3 --factorisations weight_svd``;
``--pairs 16`` without / ``--pairs 48 --shared``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...model.latent_attention import rope_dim_indices
from ..linalg import eigh

ROPE_CRITERIA = ("perturbation", "norm")


def pre_rope_qk(attn, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries [N, HQ, T, D] and keys [N, H, T, D] of a dense attention module after QK-norm,
    before RoPE (native source modules and :class:`DenseSinkAttention` alike)."""
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
    """

    pairs: list[list[int]]
    mixing: torch.Tensor | None = None
    weights: torch.Tensor | None = None
    slots: list[tuple[int, int]] | None = None


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
    _, vecs = eigh(cov)
    return vecs.flip(-1), w


#: complex elements of one block of the perturbation score's [J', rows, T, F] products (32 MB)
ROPE_SCORE_BLOCK = 1 << 22


@torch.no_grad()
def rope_component_scores(q: torch.Tensor, k: torch.Tensor, inv_freq: torch.Tensor, scaling: float,
                          criterion: str = "perturbation", mixing: torch.Tensor | None = None,
                          weights: torch.Tensor | None = None, query_positions: torch.Tensor | None = None) -> torch.Tensor:
    """Importance of keeping RoPE on each key component at each frequency: [H, F] (higher = keep).

    Components are the KV heads themselves (``mixing`` None) or the mixed components of
    :func:`head_mixing`. q [N, HQ, T, F], k [N, H, T, F] complex (pre-RoPE pairs).
    ``perturbation``: attention-weighted E[(logit change when the component loses RoPE)^2]
    under the source's own attention, over the queries at ``query_positions`` (default: all T)
    each against every key it sees; ``norm``: E|q| E|k| (MHA2MLA's 2-norm).
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
    if criterion == "norm":
        for r in range(hq):
            qr = (q[:, r, :, None, :] * coef[:, r // group, :].T[None, None]).abs().mean((0, 1))  # [J, F]
            scores += (qr * comps.abs().mean((0, 2))).double()
        return scores
    t = q.shape[2]
    pos = torch.arange(t, dtype=torch.float32)
    queries = torch.arange(t) if query_positions is None else query_positions.long()
    rows = max(1, ROPE_SCORE_BLOCK // ((1 if mixing is None else h) * t * q.shape[-1]))
    # Blocks of query positions bound the [J', rows, T, F] products and the rotations.
    blocks = []
    for b in queries.split(rows):
        delta = b.float()[:, None] - pos[None, :]  # [rows, T] query minus key position
        blocks.append((b, delta >= 0, torch.polar(torch.ones(()), delta[..., None] * inv_freq.float())))
    for r in range(hq):
        g = r // group
        js = [g] if mixing is None else list(range(h))  # components this query head reads
        for n in range(q.shape[0]):
            for b, causal, rot in blocks:
                qr = q[n, r, b]
                # The source attention weights decide which (query, key) position pairs matter.
                logits = ((qr[:, None, :] * k[n, g].conj()[None, :, :]) * rot).real.sum(-1) * scaling
                p = torch.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1)[..., None]
                qj = qr[None] * coef[:, g, js].T[:, None, :]  # [J', rows, F]
                prod = qj[:, :, None, :] * comps[n, js].conj()[:, None, :, :]  # [J', rows, T, F]
                change = (prod * (rot - 1)).real * scaling  # logit change if the component loses RoPE
                scores[js] += (p * change.pow(2)).sum((1, 2)).double()
    return scores


@dataclass
class RopeScores:
    """A layer's rope-slot scores [J, F] (J = KV heads, or mixed components) and, for a
    mixed shared key, the mixing it was scored under."""

    scores: torch.Tensor
    mixing: torch.Tensor | None = None
    weights: torch.Tensor | None = None


def score_rope_slots(q: torch.Tensor, k: torch.Tensor, inv_freq: torch.Tensor, scaling: float, shared: bool,
                     criterion: str = "perturbation", query_positions: torch.Tensor | None = None) -> RopeScores:
    """Scores of one layer from its calibration queries/keys (complex pairs [N, H(Q), T, F])."""
    mixing = weights = None
    if shared and k.shape[1] > 1:
        mixing, weights = head_mixing(q, k)
    return RopeScores(rope_component_scores(q, k, inv_freq, scaling, criterion, mixing, weights, query_positions),
                      mixing, weights)


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
    With ``counts`` given, per-head layouts use the frequencies it lists (uniform across layers)."""
    scores = scored.scores
    if scored.mixing is None:
        if shared:
            scores = scores.sum(0, keepdim=True)
        if counts is not None:
            return RopeSplit([sorted(counts)] * scores.shape[0])
        return RopeSplit([sorted(torch.topk(sc, num_pairs).indices.tolist()) if num_pairs else [] for sc in scores])
    counts = frequency_counts(scores, num_pairs) if counts is None else counts
    slots = sorted((f, j) for f, c in counts.items() for j in range(c))
    return RopeSplit([[f for f, _ in slots]], scored.mixing, scored.weights, slots)


def uniform_frequency_counts(all_scores: list[RopeScores], num_pairs: int) -> dict[int, int]:
    """One choice of rope frequencies for every layer (a single rope table, as DeepSeek-V3
    needs): the best cells of the scores normalised per layer and summed over layers."""
    total = sum(s.scores / s.scores.sum().clamp_min(1e-30) for s in all_scores)
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
                      criterion: str = "perturbation", max_queries: int = 256) -> RopeScores:
    """:func:`score_rope_slots` from a dense layer's input [N, T, hidden]. The perturbation score
    costs O(queries x T): it takes ``max_queries`` query positions spread evenly over the whole
    window, each against every key it sees, so distances up to the window's length count (the
    first positions alone would only show short distances, where low frequencies barely
    rotate and look free to drop; a fact read back from far away is where they matter)."""
    q, k = pre_rope_qk(attn, hidden)
    t = q.shape[2]
    queries = None if t <= max_queries else torch.linspace(0, t - 1, max_queries).round().long().unique()
    return score_rope_slots(_complex_pairs(q), _complex_pairs(k), inv_freq, attn.scaling, shared, criterion, queries)


def layer_inv_freq(model, layer_idx: int, head_dim: int) -> torch.Tensor:
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
        return rope, k_aug.clone(), None
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
    rope = torch.cat([slot_rows.real, slot_rows.imag])
    return rope, torch.cat([residual.real, residual.imag], dim=1), coef


__all__ = ["ROPE_CRITERIA", "RopeScores", "RopeSplit", "choose_rope_split", "frequency_counts", "head_mixing",
           "layer_inv_freq", "layer_rope_scores", "pre_rope_qk", "rope_component_scores", "score_rope_slots",
           "split_from_scores", "split_key_rows", "uniform_frequency_counts"]
