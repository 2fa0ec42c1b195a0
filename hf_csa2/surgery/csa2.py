"""CSA2 layout: turn a model into shared-KV sparse layers (seed 000).

``full`` layers come from the MLA form of the same layer (its latent entries become the
shared entries); ``reindex`` / ``reuse`` / ``swa`` layers keep their own dense keys/values for
their window and get an entry reader (and, for reindex, an index query); ``lowrank`` layers read
every position from rank-r codes of their own keys and values (``surgery/lowrank.py``: for a
layer that must read far facts back, which another layer's entries cannot serve).
:func:`apply_csa2` fits readers, indexers, codes and entry logit biases on calibration text.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from ..model import Csa2ForCausalLM
from ..model.attention_base import rotate_half
from ..model.configuration_hf_csa2 import (
    CSA2_READ_PATHS,
    attention_head_dim,
)
from ..model.csa2_attention import Csa2ReaderAttention, read_path
from ..model.sparse_attention import sparse_sink_attention
from .calibration import decoder_layers, run_with_attention_hooks
from .indexer_warmup import dense_attention_targets, top_k_mass_recall, warm_up_indexer
from .layerwise import (
    calibrate_layerwise,
    refit_output_projection,
    source_attention_outputs,
)
from .linalg import augmented_moment, ridge_solve
from .lowrank import fit_lowrank_layer
from .mla import MlaFitReport, apply_mla
from .mla.rope_slots import pre_rope_qk
from .plan import CSA2_PLAN_MODES, Csa2Plan, MlaPlan, default_sources
from .rebuild import is_csa2, native_specs, to_csa2


def csa2_layer_specs(
    mla_specs: list[dict],
    dense_specs: list[dict],
    modes: list[str],
    sources: list[int | None],
    *,
    window: int,
    top_k: int,
    index_heads: int,
    index_head_dim: int,
    index_rope_pairs: list[int] | None = None,
    sinks: bool | None = None,
    sink_tokens: int = 0,
    exact_window: bool = False,
    lowrank_ranks: tuple[int | None, int | None] = (None, None),
    head_dim: int | None = None,
    select_block: int | None = None,
) -> list[dict]:
    """Per-layer ``kind: csa2`` specs.

    mla_specs: the MLA spec of each layer (used by ``full`` layers); dense_specs: the dense spec
    of each layer (``num_key_value_heads``/``sinks`` of the window); modes/sources: the layer plan
    (source = None for full/swa). ``sinks=None`` keeps each layer's own setting. Non-full layers
    keep the first ``sink_tokens`` tokens exactly besides their window; with ``exact_window``
    full layers read their window from their own exact keys/values too. ``lowrank`` layers get
    ``kind: lowrank`` specs with ``lowrank_ranks`` = (key rank, value rank); None: half the layer's
    key width and its full value width (``num_key_value_heads * head_dim``; needs ``head_dim``).
    ``select_block``: full and reindex layers select whole blocks of that many positions.
    """
    n = len(modes)
    if not (len(mla_specs) == len(dense_specs) == len(sources) == n):
        raise ValueError(f"one mode and one source per layer: got {len(modes)} modes, {len(sources)} sources for {len(mla_specs)} layers")
    specs = []
    for i, (mode, src) in enumerate(zip(modes, sources)):
        if mode not in CSA2_PLAN_MODES:
            raise ValueError(f"layer {i}: mode={mode!r}; allowed: {', '.join(CSA2_PLAN_MODES)}")
        base = mla_specs[i] if mode == "full" else dense_specs[i]
        if mode == "lowrank":
            if None in lowrank_ranks and head_dim is None:
                raise ValueError("lowrank layers with a default rank need head_dim")
            width = None if head_dim is None else base["num_key_value_heads"] * head_dim
            key_rank, value_rank = lowrank_ranks
            specs.append({"kind": "lowrank", "num_key_value_heads": base["num_key_value_heads"],
                          "sinks": base.get("sinks", False) if sinks is None else sinks,
                          "key_rank": key_rank or width // 2, "value_rank": value_rank or width})
            continue
        spec = {"kind": "csa2", "mode": mode, "window": window,
                "num_key_value_heads": base["num_key_value_heads"],
                "sinks": base.get("sinks", False) if sinks is None else sinks}
        if mode == "full":
            spec.update(kv_lora_rank=base["kv_lora_rank"], rope_pairs=base["rope_pairs"],
                        latent_norm=base.get("latent_norm", False), index_head_dim=index_head_dim,
                        index_rope_pairs=list(index_rope_pairs or []), exact_window=exact_window)
        else:
            spec["sink_tokens"] = sink_tokens
        if mode in ("full", "reindex"):
            spec.update(top_k=top_k, index_heads=index_heads)
            if select_block:
                spec["select_block"] = select_block
        if mode in ("reindex", "reuse"):
            spec["source"] = src
        specs.append(spec)
    return specs


def layer_mode(spec: dict) -> str:
    """A CSA2 model layer's plan mode: its csa2 mode, or ``lowrank``."""
    return spec.get("mode", spec["kind"])


def assemble_csa2(dense_model, mla_model, specs: list[dict]) -> Csa2ForCausalLM:
    """Build the CSA2 model: full layers take ``mla_model``'s attention weights (with
    ``exact_window`` the dense layer's k/v/o projections), every other layer ``dense_model``'s
    (its own exact K/V for the window); embeddings, MLPs and norms come from ``dense_model``.
    New parameters (indexers, readers) keep their init."""
    state = dict(dense_model.state_dict())
    mla_state = mla_model.state_dict()
    for i, spec in enumerate(specs):
        prefix = f"model.layers.{i}.self_attn."
        if spec.get("mode") == "full":
            # An exact window reads the dense layer's own key/value projections; its o_proj starts
            # from the dense layer's too (the MLA stage's refit was fitted to a latent window).
            kept = ("k_proj.", "v_proj.", "o_proj.") if spec.get("exact_window") else ()
            state = {k: v for k, v in state.items() if not k.startswith(prefix) or k[len(prefix):].startswith(kept)}
            state.update({k: v for k, v in mla_state.items() if k.startswith(prefix) and not k[len(prefix):].startswith(kept)})
    return to_csa2(dense_model, specs, state)


def dense_layer_specs(model) -> list[dict]:
    """Per-layer dense specs of a native or hf_csa2 model."""
    return [dict(s) for s in model.config.attention_layers] if is_csa2(model) else native_specs(model.config)





# -- calibrated initialisation ---------------------------------------------------------------


def unrotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Undo half-split RoPE: x, cos, sin [..., 2m] (x rotated by +theta) -> x rotated by -theta."""
    return x * cos - rotate_half(x) * sin


@torch.no_grad()
def fit_entry_reader(attn: Csa2ReaderAttention, hidden: torch.Tensor, ridge: float) -> dict[str, float]:
    """Least-squares init of a reindex/reuse layer's :class:`EntryReader` on calibration data.

    Targets are the layer's OWN keys (after QK-norm, before RoPE) and values for the same
    tokens. First, per own KV head and per frequency carried by the source's rope slots, the
    complex coefficients that best explain the key pair from the slots (RoPE commutes with a
    complex scalar, so the fit holds at every position); then the position-free map from the
    source latent ``[c, 1]`` to the rest of the key and to the value (ridge least squares).
    Reads the full layer's latent and rope slots of the same tokens from its ``scratch``
    (filled by the calibration forward). Returns relative squared errors of keys and values.
    """
    reader = attn.reader
    full = attn.peers[attn.spec["entries"]].scratch
    latent, rope_part = full["latent"], full["rope"]  # [N, 1, T, r], [N, 1, T, X]
    x = torch.cat([latent[:, 0], latent.new_ones(*latent.shape[:1], latent.shape[2], 1)], dim=-1).reshape(-1, reader.kv_lora_rank + 1)
    _, k, v = attn.project_plain(hidden)  # [N, H, T, D]
    h, d = attn.num_key_value_heads, attn.head_dim
    half = d // 2
    k = k.transpose(1, 2).reshape(-1, h, d).double()  # [M, H, D]
    v = v.transpose(1, 2).reshape(-1, h * d).double()
    pairs = torch.tensor(reader.slot_pairs)
    m = len(reader.slot_pairs)
    target_k = k.clone()
    coef = torch.zeros(h, m, 2, dtype=torch.float64)
    if m:
        cos, sin = full["position_embeddings"]
        dims = torch.cat([pairs, pairs + half])
        slots = unrotate(reader.rope_slots(rope_part), cos[..., dims], sin[..., dims]).reshape(-1, 2 * m).double()
        y = torch.complex(slots[:, :m], slots[:, m:])  # [M, m]
        for f in sorted(set(reader.slot_pairs)):
            cols = (pairs == f).nonzero().flatten()
            yf = y[:, cols]  # [M, c]
            gram = yf.conj().T @ yf
            gram = gram + 1e-9 * gram.diagonal().real.mean().clamp_min(1e-12) * torch.eye(len(cols), dtype=gram.dtype)
            for g in range(h):
                z = torch.complex(k[:, g, f], k[:, g, f + half])  # [M]
                alpha = torch.linalg.solve(gram, yf.conj().T @ z)  # [c]
                rest = z - yf @ alpha
                target_k[:, g, f], target_k[:, g, f + half] = rest.real, rest.imag
                # The reader multiplies the QUERY: Re(q conj(alpha y)) = Re((conj(alpha) q) conj(y)).
                coef[g, cols, 0], coef[g, cols, 1] = alpha.real, -alpha.imag
    target = torch.cat([target_k.reshape(-1, h, d), v.view(-1, h, d)], dim=-1).reshape(-1, h * 2 * d)
    w = ridge_solve(x, target, ridge)  # [r+1, H*2D]
    reader.kv_b_proj.weight.copy_(w[:-1].T.to(reader.kv_b_proj.weight.dtype))
    reader.kv_b_proj.bias.copy_(w[-1].to(reader.kv_b_proj.bias.dtype))
    reader.q_rope_coef.copy_(coef.to(reader.q_rope_coef.dtype))
    fit = (x.double() @ w).view(-1, h, 2 * d)
    k_err = (fit[..., :d] - target_k).pow(2).sum() / k.pow(2).sum().clamp_min(1e-30)
    v_err = (fit[..., d:] - v.view(-1, h, d)).pow(2).sum() / v.pow(2).sum().clamp_min(1e-30)
    return {"reader_key_rel_err": float(k_err), "reader_value_rel_err": float(v_err)}


@torch.no_grad()
def calibrate_entry_mass(attn: Csa2ReaderAttention, source_attn, hidden: torch.Tensor, position_embeddings) -> dict[str, float]:
    """Set the reader's per-head ``logit_bias`` so that, on average over the calibration
    tokens, the entries get the share of attention the dense source layer gives to the same
    Top-K positions.

    With the other logits fixed, the entries' share is ``sigmoid(logit(share_0) + b)`` per
    query, so each head's ``b`` is found by bisection on the mean. Returns mean shares
    (all heads) before, after and the target.
    """
    reader = attn.reader
    reader.logit_bias.zero_()
    share0 = attn.entry_share(hidden, position_embeddings).double()  # [N, T, HQ]
    t = hidden.shape[1]
    top = attn.scratch["top_k"]  # [N, T, K], from the read above
    q, k = source_attn.scoring_qk(hidden, position_embeddings)
    hq = q.shape[1]
    k = k.repeat_interleave(hq // k.shape[1], dim=1)
    pos = torch.arange(t, device=hidden.device)
    logits = ((q @ k.transpose(-1, -2)).float() * source_attn.scaling).masked_fill(pos[None, :] > pos[:, None], float("-inf"))
    p = torch.softmax(logits, dim=-1)  # [N, HQ, T, T]
    idx = top.clamp_min(0)[:, None].expand(-1, hq, -1, -1)
    target = (p.gather(-1, idx) * (top >= 0)[:, None]).sum(-1).transpose(1, 2).double()  # [N, T, HQ]
    rows = (top >= 0).any(-1)  # queries that read any entry
    if not rows.any():
        raise ValueError("no calibration query reads a shared entry: calibration windows must be longer than the layer's window")
    z = torch.logit(share0.clamp(1e-12, 1 - 1e-12))
    bias = torch.zeros(hq, dtype=torch.float64)
    for h in range(hq):
        zh, goal = z[..., h][rows], target[..., h][rows].mean()
        lo, hi = -30.0, 30.0
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if torch.sigmoid(zh + mid).mean() < goal else (lo, mid)
        bias[h] = (lo + hi) / 2
    reader.logit_bias.copy_(bias.to(reader.logit_bias.dtype))
    after = torch.sigmoid(z + bias)[rows].mean()
    return {"entry_share_before": float(share0[rows].mean()), "entry_share_after": float(after),
            "entry_share_target": float(target[rows].mean())}


@torch.no_grad()
def entry_offset_readout(attn: Csa2ReaderAttention, hidden: torch.Tensor, position_embeddings):
    """``readout(d)`` -> the layer's read-out [N, T, HQ, D] (before ``o_proj``, fp64) if every
    entry logit bias moved by ``d``, from ONE read at the current bias: an offset rescales the
    entries' softmax terms by e^d, so read-out = (o_own + e^d o_ent) / (w_own + e^d w_ent + w_sink)."""
    segments, v_up = attn.read_segments(hidden, position_embeddings, None)
    outs, weights = sparse_sink_attention(segments, scaling=attn.scaling, sinks=attn.sinks, return_weights=True,
                                          path=read_path(attn.config))
    own_width = segments[0].index.shape[-1]
    w_own = weights[..., :own_width].sum(-1).double()[..., None]  # [N, T, HQ, 1]
    w_ent = weights[..., own_width:].sum(-1).double()[..., None]
    w_sink = (1 - w_own - w_ent).clamp_min(0)
    o_own = outs[0].double()
    o_ent = torch.einsum("bthr,hdr->bthd", outs[1], v_up).double()

    def readout(offset: float) -> torch.Tensor:
        f = float(torch.tensor(offset, dtype=torch.float64).exp())
        return (o_own + f * o_ent) / (w_own + f * w_ent + w_sink)

    return readout


ENTRY_BIAS_OFFSETS = (-30.0, -8.0, -6.0, -4.0, -3.0, -2.0, -1.0, -0.5, 0.0, 0.5, 1.0)


@torch.no_grad()
def refine_entry_bias(attn: Csa2ReaderAttention, source_attn, hidden: torch.Tensor, position_embeddings,
                      offsets: tuple[float, ...] = ENTRY_BIAS_OFFSETS) -> dict[str, float]:
    """Move each head's entry ``logit_bias`` (from :func:`calibrate_entry_mass`) by the offset
    that minimises that head's read-out error against the dense layer (before ``o_proj``).

    The share criterion trusts the readers; when a reader's values are poor, the head is
    better off reading its entries less (down to not at all: -30). Each head has its own
    softmax, so the per-head choice is exact on the calibration data. Returns the mean chosen
    offset, the fraction of heads switched off and the read-out error before/after.
    """
    reader = attn.reader
    start = reader.logit_bias.clone()
    dense, _ = source_attn.attention_output(hidden, position_embeddings)
    hq = start.shape[0]
    dense = dense.reshape(*dense.shape[:-1], hq, -1).double()  # [N, T, HQ, D]
    readout = entry_offset_readout(attn, hidden, position_embeddings)
    errors = [(readout(off) - dense).pow(2).sum(dim=(0, 1, 3)) for off in offsets]
    errors = torch.stack(errors)  # [offsets, HQ]
    best = errors.argmin(0)
    chosen = torch.tensor(offsets, dtype=start.dtype)[best]
    reader.logit_bias.copy_(start + chosen)
    norm = dense.pow(2).sum().clamp_min(1e-30)
    at_zero = errors[offsets.index(0.0)].sum() if 0.0 in offsets else float("nan")
    return {"entry_bias_offset": float(chosen.mean()), "entry_heads_off": float((chosen <= -30).float().mean()),
            "readout_rel_err_share": float(at_zero / norm), "readout_rel_err": float(errors.min(0).values.sum() / norm)}


@torch.no_grad()
def far_attention_mass(source_attn, hidden: torch.Tensor, position_embeddings, window: int) -> torch.Tensor:
    """Mean attention mass per KV group [H] that a dense layer puts on positions older than ``window``."""
    q, k = source_attn.scoring_qk(hidden, position_embeddings)  # [N, HQ, T, D], [N, H, T, D]
    hq, h, t = q.shape[1], k.shape[1], q.shape[2]
    k = k.repeat_interleave(hq // h, dim=1)
    logits = (q @ k.transpose(-1, -2)).float() * source_attn.scaling
    pos = torch.arange(t)
    logits = logits.masked_fill(pos[None, :] > pos[:, None], float("-inf"))
    p = torch.softmax(logits, dim=-1)
    far = (pos[None, :] <= pos[:, None] - window).float()  # [T, S]
    per_head = (p * far).sum(-1).mean(dim=(0, 2))  # [HQ]
    return per_head.view(h, hq // h).mean(-1)


@torch.no_grad()
def index_pair_energy(model, windows: torch.Tensor, layers: list[int]) -> torch.Tensor:
    """Per RoPE frequency pair f [D/2] (float64): ``sum over layers and query heads r of
    E|q_r,f|^2 * E|k_g(r),f|^2`` on ``windows`` [N, T] (keys and queries after QK-norm, before
    RoPE): how much of the attention logits' energy a pair can carry (the 2-norm criterion of
    MHA2MLA). Picks which pairs a narrow index key keeps."""
    d = attention_head_dim(model.config)
    total = torch.zeros(d // 2, dtype=torch.float64)

    def make_hook(i):
        def hook(attn, args, kwargs):
            if i not in wanted:
                return
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            q, k = pre_rope_qk(attn, hidden)  # [N, HQ, T, D], [N, H, T, D]
            half = d // 2

            def pair_energy(x):  # [N, heads, T, D] -> [heads, D/2]
                x = x.double().pow(2)
                return (x[..., :half] + x[..., half:]).mean((0, 2))

            eq, ek = pair_energy(q), pair_energy(k)
            total.add_((eq * ek.repeat_interleave(eq.shape[0] // ek.shape[0], dim=0)).sum(0))

        return hook

    wanted = set(layers)
    run_with_attention_hooks(model, windows, lambda i, a: a.register_forward_pre_hook(make_hook(i), with_kwargs=True))
    return total


def index_rope_pairs_for(model, windows: torch.Tensor, layers: list[int], index_head_dim: int) -> list[int]:
    """The ``index_head_dim / 2`` frequency pairs with the most query-key energy over ``layers``
    (all pairs when the index key is as wide as a head), ascending."""
    d = attention_head_dim(model.config)
    if index_head_dim >= d:
        return list(range(d // 2))
    energy = index_pair_energy(model, windows, layers)
    return sorted(int(f) for f in torch.argsort(energy, descending=True)[: index_head_dim // 2])


@torch.no_grad()
def init_indexer_from_attention(indexer, source_attn, group: int) -> None:
    """Training-free indexer: index heads = the query heads of KV group ``group`` with their
    own query rows, index key = that group's key rows, RoPE on every index dim, constant head
    weights equal to the attention scale. The index score is then the sum over those heads
    of ReLU(attention logit) (QK-norm and biases left out); a narrow index key keeps the
    frequency pairs ``indexer.rope_pairs`` of those rows, so it sums their part of the logits."""
    hq, h, d = source_attn.num_heads, source_attn.num_key_value_heads, source_attn.head_dim
    per = hq // h
    pairs = indexer.rope_pairs
    if indexer.num_heads != per or indexer.head_dim != 2 * len(pairs) or not pairs or pairs[-1] >= d // 2:
        raise ValueError(f"training-free indexer init needs index_heads={per} and RoPE on every index dim "
                         f"(index_head_dim = 2 x its pairs, pairs < {d // 2})")
    dims = torch.tensor(pairs + [p + d // 2 for p in pairs])
    qw = source_attn.q_proj.weight.view(hq, d, -1)[group * per : (group + 1) * per]
    indexer.wq.weight.copy_(qw[:, dims].reshape(per * len(dims), -1))
    if indexer.wk is not None:
        indexer.wk.weight.copy_(source_attn.k_proj.weight.view(h, d, -1)[group][dims])
    indexer.weights_proj.weight.zero_()
    indexer.weights_proj.bias.fill_(source_attn.scaling)


@dataclass
class Csa2FitOptions:
    """How :func:`fit_csa2_layer` initialises one CSA2 layer: the plan's fit settings, plus
    ``calibrate_mass`` (the entry-mass bias; off only to study the reader alone)."""

    window: int
    top_k: int
    ridge: float = 1e-3
    refit_output: bool = True
    indexer_warmup_steps: int = 0
    calibrate_mass: bool = True
    refine_bias: bool = False
    select_block: int = 0

    @classmethod
    def from_plan(cls, plan: Csa2Plan, calibrate_mass: bool = True) -> "Csa2FitOptions":
        return cls(window=plan.window, top_k=plan.top_k, ridge=plan.reader_ridge, refit_output=plan.refit_output,
                   indexer_warmup_steps=plan.indexer_warmup_steps, calibrate_mass=calibrate_mass,
                   refine_bias=plan.refine_entry_bias, select_block=plan.select_block or 0)


@dataclass
class Csa2LayerFit:
    """One layer's calibrated init (:func:`fit_csa2_layer`); a field is None where the layer's
    mode or the plan does not fit that part. Errors are relative squared errors."""

    mode: str
    index_group: int | None = None  # full: the KV group whose scores start the indexer
    far_mass: list[float] | None = None  # full: each KV group's attention mass beyond the window
    top_k_recall_init: float | None = None  # full/reindex: dense attention mass the Top-K covers, at init
    top_k_recall: float | None = None  # ... and after the indexer warm-up
    index_kl_before: float | None = None  # indexer warm-up: KL to the dense attention, before/after
    index_kl_after: float | None = None
    reader_key_rel_err: float | None = None  # reindex/reuse: reader least squares of keys / values
    reader_value_rel_err: float | None = None
    lowrank_key_rel_err: float | None = None  # lowrank: codes of the plain keys / values, relative squared error
    lowrank_value_rel_err: float | None = None
    entry_share_before: float | None = None  # entry-mass bias: share of attention on the entries
    entry_share_after: float | None = None
    entry_share_target: float | None = None  # ... the dense layer's share at the same positions
    entry_bias_offset: float | None = None  # refine_entry_bias: mean bias offset chosen
    entry_heads_off: float | None = None  # ... fraction of heads whose entries were switched off
    readout_rel_err_share: float | None = None  # ... the entries' read-out error with the bias as calibrated
    readout_rel_err: float | None = None  # ... and with the chosen offsets
    rel_err_before: float | None = None  # o_proj refit: the layer's attention output, before/after
    rel_err_after: float | None = None


#: Csa2LayerFit fields the stage report averages over the layers that have them
_AVERAGED = ("reader_key_rel_err", "reader_value_rel_err", "lowrank_key_rel_err", "lowrank_value_rel_err",
             "top_k_recall_init", "top_k_recall", "index_kl_before", "index_kl_after", "entry_share_before",
             "entry_share_after", "entry_share_target", "entry_bias_offset", "entry_heads_off", "readout_rel_err_share",
             "readout_rel_err")


@dataclass
class Csa2FitReport:
    """What :func:`apply_csa2` did: the plan, each layer's mode and fit, and the MLA fit of
    the full layers."""

    plan: Csa2Plan
    modes: list[str]
    layers: list[Csa2LayerFit]
    mla: MlaFitReport | None  # None: no full layer (nothing took the MLA form)

    def stage_notes(self) -> dict:
        notes: dict = {"modes": "".join({"full": "F", "reindex": "R", "reuse": "U", "swa": "S", "lowrank": "L"}[m]
                                        for m in self.modes),
                       "window": self.plan.window, "top_k": self.plan.top_k}
        for key in _AVERAGED[:4]:
            _mean_into(notes, key, self.layers)
        refits = [f.rel_err_after for f in self.layers if f.rel_err_after is not None]
        if refits:
            notes["attn_out_rel_err_after_refit"] = sum(refits) / len(refits)
        notes["index_groups"] = [f.index_group for f in self.layers if f.index_group is not None]
        for key in _AVERAGED[4:]:
            _mean_into(notes, key, self.layers)
        return notes


def _mean_into(notes: dict, key: str, fits: list[Csa2LayerFit]) -> None:
    values = [getattr(f, key) for f in fits if getattr(f, key) is not None]
    if values:
        notes[key] = sum(values) / len(values)


@torch.no_grad()
def fit_csa2_layer(attn, src, hidden: torch.Tensor, attn_kwargs: dict, target: torch.Tensor | None,
                   opts: Csa2FitOptions) -> dict:
    """Calibrated init of one CSA2 layer ``attn`` from its dense source layer ``src``.

    hidden [N, T, hidden]: the layer's inputs; target [N, T, hidden]: the dense layer's
    attention output (for the ``o_proj`` refit). A reindex/reuse layer reads the scratch its
    ``peers`` hold for the same tokens (the full layer ran first). Full: training-free indexer
    from the KV group with the most attention mass beyond the window (+ KL warm-up); with
    ``exact_window`` also the ``o_proj`` refit.
    Reindex: its source's index query (+ warm-up). Reindex/reuse: reader least squares and
    entry-mass bias. Every non-full layer: ``o_proj`` refit. Returns the fit notes.
    """
    notes: dict = {}
    pe = attn_kwargs["position_embeddings"]
    mode = layer_mode(attn.spec)
    if mode == "lowrank":
        notes.update(fit_lowrank_layer(attn, src, augmented_moment(hidden)))
        if opts.refit_output:
            notes.update(refit_output_projection(attn, hidden, attn_kwargs, target))
        return notes
    if mode == "full":
        mass = far_attention_mass(src, hidden, pe, opts.window)
        group = int(mass.argmax())
        init_indexer_from_attention(attn.indexer, src, group)
        notes.update(index_group=group, far_mass=[round(float(m), 4) for m in mass])
        notes.update(_train_indexer(attn.indexer, src, hidden, pe, None, opts))
        if attn.exact_window and opts.refit_output:  # its o_proj is the source's (assemble_csa2)
            notes.update(refit_output_projection(attn, hidden, attn_kwargs, target))
        return notes
    if mode == "reindex":
        source = attn.peers[attn.spec["source"]]
        attn.indexer.wq.load_state_dict(source.indexer.wq.state_dict())
        attn.indexer.weights_proj.load_state_dict(source.indexer.weights_proj.state_dict())
        full = attn.peers[attn.spec["entries"]].scratch
        notes.update(_train_indexer(attn.indexer, src, hidden, full["position_embeddings"], full["index_keys"], opts))
    if attn.reader is not None:
        notes.update(fit_entry_reader(attn, hidden, opts.ridge))
        if opts.calibrate_mass:
            notes.update(calibrate_entry_mass(attn, src, hidden, pe))
        if opts.refine_bias:
            notes.update(refine_entry_bias(attn, src, hidden, pe))
    if opts.refit_output:
        notes.update(refit_output_projection(attn, hidden, attn_kwargs, target))
    return notes


def _train_indexer(indexer, src, hidden, pe, keys, opts: Csa2FitOptions) -> dict:
    """Top-K recall of the dense attention mass, and KL warm-up when asked."""
    q, k = src.scoring_qk(hidden, pe)
    target, valid = dense_attention_targets(q, k, src.scaling, opts.window)
    own_keys = indexer.keys(hidden, pe) if keys is None else keys
    recall = partial(top_k_mass_recall, top_k=opts.top_k, window=opts.window, block=opts.select_block)
    notes = {"top_k_recall_init": recall(indexer, hidden, pe, own_keys, target, valid)}
    if opts.indexer_warmup_steps:
        notes.update(warm_up_indexer(indexer, hidden, pe, target, valid, window=opts.window, keys=keys,
                                     steps=opts.indexer_warmup_steps))
        own_keys = indexer.keys(hidden, pe) if keys is None else keys
        notes["top_k_recall"] = recall(indexer, hidden, pe, own_keys, target, valid)
    return notes


def build_csa2_skeleton(dense, plan: Csa2Plan, mla_plan: MlaPlan | None, *, windows: torch.Tensor,
                        sources: list[int | None] | None = None) -> tuple[Csa2ForCausalLM, MlaFitReport]:
    """The CSA2 model of ``plan`` before its readers/indexers are fitted: full layers in MLA
    form (:func:`apply_mla` with ``mla_plan`` on those layers only, fitted on ``windows``
    [N, T]), every other layer with the dense layer's own projections. ``dense``: an hf_csa2
    model with dense layers; ``sources``: who reads whom (default: :func:`default_sources`)."""
    layers = dense.config.attention_layers
    if any(s["kind"] != "dense" for s in layers):
        raise ValueError("CSA2 surgery needs dense attention layers as input")
    modes = plan.layer_modes(len(layers))
    if len(modes) != len(layers):
        raise ValueError(f"{len(modes)} layer modes for a model with {len(layers)} layers")
    sources = default_sources(modes) if sources is None else sources
    full_layers = [i for i, m in enumerate(modes) if m == "full"]
    if full_layers:
        mla, mla_report = apply_mla(dense, mla_plan, windows=windows, only_layers=full_layers)
    else:  # no shared entries: nothing takes the MLA form (the plan needs no mla section)
        mla, mla_report = dense, None
    d = attention_head_dim(dense.config)
    hq = dense.config.num_attention_heads
    groups = {mla.config.attention_layers[i]["num_key_value_heads"] for i in full_layers}
    if len(groups) > 1:
        raise ValueError(f"full layers with different KV-head counts {sorted(groups)}: one index geometry is shared")
    index_heads = hq // (groups.pop() if groups else 1)
    index_dim = plan.index_head_dim or d
    pairs = index_rope_pairs_for(dense, windows[:4], full_layers, index_dim) if full_layers else list(range(index_dim // 2))
    specs = csa2_layer_specs(mla.config.attention_layers, layers, modes, sources,
                             window=plan.window, top_k=plan.top_k, index_heads=index_heads, index_head_dim=index_dim,
                             index_rope_pairs=pairs, sinks=plan.sinks, sink_tokens=plan.sink_tokens,
                             exact_window=plan.exact_window,
                             lowrank_ranks=(plan.lowrank_key_rank, plan.lowrank_value_rank), head_dim=d,
                             select_block=plan.select_block)
    return assemble_csa2(dense, mla, specs), mla_report


def as_dense_csa2(model):
    """``model`` as an hf_csa2 model (native models get dense layer specs)."""
    return model if is_csa2(model) else to_csa2(model, native_specs(model.config))


@torch.no_grad()
def apply_csa2(model, plan: Csa2Plan, mla_plan: MlaPlan | None, *, windows: torch.Tensor,
               sources: list[int | None] | None = None, calibrate_mass: bool = True,
               fit_read_path: str = "scores") -> tuple[Csa2ForCausalLM, Csa2FitReport]:
    """Rewrite ``model`` (native or hf_csa2 with dense layers) into the CSA2 layers of ``plan``
    (the plan's ``csa2`` section; ``mla_plan``, its ``mla`` section, says how full layers build
    their latent entries); returns the new model (the source is not changed) and a
    :class:`Csa2FitReport`.

    Full layers: MLA form of the same layer (:func:`apply_mla` on those layers only),
    training-free indexer copied from the KV group with the most attention mass beyond the
    window. Reindex layers start with their source's index query (they select like it until
    trained). Reindex/reuse readers: least squares to the layer's own keys/values
    (:func:`fit_entry_reader`); then ``o_proj`` refit to the source layer's output. Non-full
    layers keep the first ``sink_tokens`` tokens exactly (StreamingLLM's attention sinks). All
    fits (:func:`fit_csa2_layer`) run layer by layer on the converted model's own activations
    over the calibration ``windows`` [N, T]. With ``indexer_warmup_steps`` the indexers of full
    and reindex layers are trained to the dense attention
    (:func:`~hf_csa2.surgery.indexer_warmup.warm_up_indexer`). With ``calibrate_mass`` each
    reader's per-head logit bias is set so the entries get the share of attention the dense
    layer gives to the same positions (:func:`calibrate_entry_mass`); with
    ``refine_entry_bias`` each head's bias then moves to minimise its read-out error
    (:func:`refine_entry_bias`). The fits read entries through ``fit_read_path`` (the
    calibration windows are short, where ``"scores"`` is the fast exact path); the returned
    model reads through the reference ``"gather"`` path.
    """
    if fit_read_path not in CSA2_READ_PATHS:
        raise ValueError(f"fit_read_path={fit_read_path!r}; allowed: {', '.join(CSA2_READ_PATHS)}")
    dense = as_dense_csa2(model)
    new, mla_report = build_csa2_skeleton(dense, plan, mla_plan, windows=windows, sources=sources)
    new.config.csa2_read_path = fit_read_path
    opts = Csa2FitOptions.from_plan(plan, calibrate_mass)
    dense_layers = decoder_layers(dense)
    targets = source_attention_outputs(dense, windows)
    modes = [layer_mode(s) for s in new.config.attention_layers]

    def fit_layer(i, attn, hidden, attn_kwargs):
        notes = fit_csa2_layer(attn, dense_layers[i].self_attn, hidden, attn_kwargs, targets[i], opts)
        return Csa2LayerFit(mode=modes[i], **notes)

    fits = calibrate_layerwise(new, windows, fit_layer)
    new.config.csa2_read_path = "auto"
    return new.eval(), Csa2FitReport(plan=plan, modes=modes, layers=fits, mla=mla_report)


__all__ = ["Csa2FitOptions", "Csa2FitReport", "Csa2LayerFit", "apply_csa2", "as_dense_csa2", "assemble_csa2", "build_csa2_skeleton", "calibrate_entry_mass",
           "csa2_layer_specs", "default_sources", "dense_layer_specs", "entry_offset_readout", "far_attention_mass", "fit_csa2_layer",
           "fit_entry_reader", "refine_entry_bias", "index_pair_energy", "index_rope_pairs_for",
           "init_indexer_from_attention"]
