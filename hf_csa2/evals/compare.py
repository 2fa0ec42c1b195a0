"""Where a converted model departs from its source: teacher-forced, position by position, layer by layer.

Perplexity averages over every position and hides a lost skill (copying from the prompt can
go while the ratio looks fine). ``compare_models`` runs the source and the converted model on
the same token windows and reports

* per position bucket (e.g. 512 tokens): top-1 agreement of the next-token prediction,
  KL(source || converted) and both models' NLL of the actual next token;
* per decoder layer: the error of the converted layer's output when it is fed the SOURCE's
  input of that layer (each layer isolated, so an error points at the layer that makes it and
  not at the layers after it), relative to what the source layer adds to the residual stream,
  split into near positions (``t < window``: the layer's whole past is in its local window)
  and far positions (``t >= window``: reads outside the window).

A copy of the source gives agreement 1 and zero errors; a model with one layer perturbed
shows error at that layer only.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..metrics.perplexity import head_log_probs
from ..surgery.calibration import decoder_layers

# Positions per chunk when the output head is applied: [chunk, vocab] in float64 stays
# ~256 MiB for a 262k vocabulary (Gemma) instead of [T, vocab] at once.
_HEAD_CHUNK_ELEMS = 1 << 25


@dataclass
class BucketStats:
    """One position bucket ``[start, end)`` of the compared windows."""

    start: int
    end: int
    positions: int = 0
    top1_agreement: float = 0.0  # fraction of positions where both models predict the same next token
    kl: float = 0.0  # mean KL(source || converted) of the next-token distributions, nats
    nll_source: float = 0.0  # mean NLL of the actual next token (positions < T - 1), nats
    nll_converted: float = 0.0
    scored: int = 0  # positions with a next token (the NLL count)


@dataclass
class LayerStats:
    """Isolated error of one decoder layer: ``||out_conv - out_src|| / ||out_src - in_src||``
    (Frobenius over positions and hidden size), with the converted layer fed the source's input."""

    layer: int
    kind: str  # dense, mla, csa2/full, csa2/reuse, ...
    window: int | None  # the split between near and far positions
    near_rel_err: float = 0.0
    far_rel_err: float | None = None  # None when no compared position is >= window
    near_positions: int = 0
    far_positions: int = 0


@dataclass
class CompareReport:
    context: int
    windows: int
    bucket: int
    buckets: list[BucketStats] = field(default_factory=list)
    layers: list[LayerStats] = field(default_factory=list)

    @property
    def worst_layer(self) -> int:
        """The layer with the largest isolated error (near or far)."""
        return max(self.layers, key=lambda s: max(s.near_rel_err, s.far_rel_err or 0.0)).layer

    @property
    def top1_agreement(self) -> float:
        total = sum(b.positions for b in self.buckets)
        return sum(b.top1_agreement * b.positions for b in self.buckets) / total

    def to_dict(self) -> dict:
        return {**asdict(self), "worst_layer": self.worst_layer, "top1_agreement": self.top1_agreement}


def _layer_label(config, i: int) -> tuple[str, int | None]:
    """(kind, local window) of decoder layer ``i`` of the converted model's config."""
    specs = getattr(config, "attention_layers", None)
    if specs:
        spec = specs[i]
        kind = spec["kind"] + (f"/{spec['mode']}" if "mode" in spec else "")
        window = spec.get("window")
        if window is None and getattr(config, "layer_types", None) and config.layer_types[i] == "sliding_attention":
            window = config.sliding_window
        return kind, window
    if getattr(config, "layer_types", None) and config.layer_types[i] == "sliding_attention":
        return "dense/sliding", config.sliding_window
    return "dense", None


def _hidden(output) -> torch.Tensor:
    return output[0] if isinstance(output, tuple) else output


@torch.no_grad()
def _run_layers(model, ids: torch.Tensor, forced_inputs: list[torch.Tensor] | None = None):
    """Run the decoder stack on ``ids`` [1, T]; return each layer's input and output [1, T, d] and
    the final hidden state. With ``forced_inputs``, layer ``i`` is fed ``forced_inputs[i]``
    instead of what the layer before it produced (each layer isolated)."""
    inputs: dict[int, torch.Tensor] = {}
    outputs: dict[int, torch.Tensor] = {}

    def attach(i, layer):
        def pre(module, args, kwargs):
            inputs[i] = (kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]).detach()
            if forced_inputs is None:
                return None
            if "hidden_states" in kwargs:
                return args, {**kwargs, "hidden_states": forced_inputs[i]}
            return (forced_inputs[i], *args[1:]), kwargs

        def post(module, args, kwargs, output):
            outputs[i] = _hidden(output).detach()

        return [layer.register_forward_pre_hook(pre, with_kwargs=True),
                layer.register_forward_hook(post, with_kwargs=True)]

    handles = [h for i, layer in enumerate(decoder_layers(model)) for h in attach(i, layer)]
    try:
        final = model.model(input_ids=ids, use_cache=False).last_hidden_state
    finally:
        for h in handles:
            h.remove()
    n = len(outputs)
    return [inputs[i] for i in range(n)], [outputs[i] for i in range(n)], final


def _check_same_vocab(source, converted) -> None:
    n_src = source.lm_head.out_features
    n_conv = converted.lm_head.out_features
    if n_src != n_conv:
        raise ValueError(f"the models' vocabularies differ ({n_src} vs {n_conv} outputs): not a source and its conversion")


@torch.no_grad()
def compare_models(source, converted, windows: torch.Tensor, *, bucket: int = 512, near: int | None = None) -> CompareReport:
    """Compare ``converted`` with ``source`` on ``windows`` (teacher-forced: both read the same tokens).

    Args:
        source, converted: causal LMs with the same decoder depth and vocabulary (``.model.layers``,
            ``.lm_head``).
        windows: LongTensor ``[N, T]`` (``hf_csa2.data.windows.token_windows``); each row is one forward.
        bucket: positions per bucket of the per-position statistics.
        near: the near/far split for layers without a local window of their own (default: ``bucket``).

    Returns:
        ``CompareReport`` with ``ceil(T / bucket)`` buckets and one ``LayerStats`` per layer.
    """
    if windows.ndim != 2 or windows.shape[1] < 2:
        raise ValueError(f"windows must be [N, T>=2], got shape {tuple(windows.shape)}")
    if bucket < 1:
        raise ValueError(f"bucket must be >= 1, got {bucket}")
    n_layers = len(decoder_layers(source))
    if len(decoder_layers(converted)) != n_layers:
        raise ValueError(f"the models have {n_layers} and {len(decoder_layers(converted))} decoder layers: "
                         "not a source and its conversion")
    _check_same_vocab(source, converted)
    n, t = windows.shape
    report = CompareReport(context=t, windows=n, bucket=bucket,
                           buckets=[BucketStats(s, min(s + bucket, t)) for s in range(0, t, bucket)])
    labels = [_layer_label(converted.config, i) for i in range(n_layers)]
    report.layers = [LayerStats(i, kind, window if window is not None else (near or bucket))
                     for i, (kind, window) in enumerate(labels)]
    # squared error / squared update, near and far, summed over windows
    sums = torch.zeros(n_layers, 2, 2, dtype=torch.float64)
    modes = [(m, m.training) for m in (source, converted)]
    for m, _ in modes:
        m.eval()
    try:
        for row in windows:
            ids = row[None]
            src_in, src_out, src_final = _run_layers(source, ids)
            conv_final = converted.model(input_ids=ids, use_cache=False).last_hidden_state
            _accumulate_buckets(report.buckets, source, converted, ids[0], src_final[0], conv_final[0])
            del src_final, conv_final
            _, forced, _ = _run_layers(converted, ids, forced_inputs=src_in)
            for i, stats in enumerate(report.layers):
                err = (forced[i][0] - src_out[i][0]).double().pow(2).sum(-1)  # [T]
                upd = (src_out[i][0] - src_in[i][0]).double().pow(2).sum(-1)
                w = min(stats.window, t)
                sums[i, 0, 0] += err[:w].sum()
                sums[i, 0, 1] += upd[:w].sum()
                sums[i, 1, 0] += err[w:].sum()
                sums[i, 1, 1] += upd[w:].sum()
            del src_in, src_out, forced
    finally:
        for m, was_training in modes:
            m.train(was_training)
    for i, stats in enumerate(report.layers):
        w = min(stats.window, t)
        stats.near_positions, stats.far_positions = w * n, (t - w) * n
        stats.near_rel_err = _ratio(sums[i, 0])
        stats.far_rel_err = _ratio(sums[i, 1]) if t > w else None
    for b in report.buckets:
        b.top1_agreement /= b.positions
        b.kl /= b.positions
        if b.scored:
            b.nll_source /= b.scored
            b.nll_converted /= b.scored
    return report


def _ratio(pair: torch.Tensor) -> float:
    err, upd = float(pair[0]), float(pair[1])
    if upd == 0.0:
        return 0.0 if err == 0.0 else math.inf
    return math.sqrt(err / upd)


def _accumulate_buckets(buckets: list[BucketStats], source, converted, ids: torch.Tensor,
                        src_hidden: torch.Tensor, conv_hidden: torch.Tensor) -> None:
    """Add one window's per-position sums (agreement, KL, NLL) into the buckets (divided at the end)."""
    t = ids.shape[0]
    step = max(1, _HEAD_CHUNK_ELEMS // source.lm_head.out_features)
    for start in range(0, t, step):
        end = min(start + step, t)
        lp_src = head_log_probs(source, src_hidden[start:end])
        lp_conv = head_log_probs(converted, conv_hidden[start:end])
        agree = (lp_src.argmax(-1) == lp_conv.argmax(-1)).double()
        kl = (lp_src.exp() * (lp_src - lp_conv)).sum(-1)
        targets = ids[start + 1 : end + 1]  # the last position has no next token
        nll_src = -lp_src[: len(targets)].gather(-1, targets[:, None])[:, 0]
        nll_conv = -lp_conv[: len(targets)].gather(-1, targets[:, None])[:, 0]
        for b in buckets:
            lo, hi = max(b.start, start), min(b.end, end)
            if lo >= hi:
                continue
            b.positions += hi - lo
            b.top1_agreement += float(agree[lo - start : hi - start].sum())
            b.kl += float(kl[lo - start : hi - start].sum())
            shi = min(hi, t - 1)
            if lo < shi:
                b.scored += shi - lo
                b.nll_source += float(nll_src[lo - start : shi - start].sum())
                b.nll_converted += float(nll_conv[lo - start : shi - start].sum())


def _cell(x: float | None, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def format_compare_tables(report: CompareReport) -> str:
    """Two markdown tables: per position bucket, then per layer (worst layer marked)."""
    lines = [f"{report.windows} window(s) of {report.context} tokens; top-1 agreement overall "
             f"{report.top1_agreement:.3f}", "",
             "| positions | top-1 agreement | KL(source‖converted) | NLL source | NLL converted |",
             "|---|---:|---:|---:|---:|"]
    for b in report.buckets:
        lines.append(f"| {b.start}-{b.end} | {b.top1_agreement:.3f} | {b.kl:.4f} | "
                     f"{_cell(b.nll_source if b.scored else None)} | {_cell(b.nll_converted if b.scored else None)} |")
    worst = report.worst_layer
    lines += ["", "| layer | kind | window | rel. error near | rel. error far |", "|---:|---|---:|---:|---:|"]
    for s in report.layers:
        mark = " ←" if s.layer == worst and max(s.near_rel_err, s.far_rel_err or 0.0) > 0 else ""
        lines.append(f"| {s.layer}{mark} | {s.kind} | {s.window} | {_cell(s.near_rel_err, 4)} | {_cell(s.far_rel_err, 4)} |")
    return "\n".join(lines)


def write_compare_json(report: CompareReport, path: str | os.PathLike, **settings) -> None:
    """Write ``report.to_dict()`` plus ``settings`` (the command's inputs) as strict JSON."""

    def finite(x):
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if isinstance(x, dict):
            return {k: finite(v) for k, v in x.items()}
        if isinstance(x, list):
            return [finite(v) for v in x]
        return x

    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(finite({**settings, **report.to_dict()}), indent=2, allow_nan=False) + "\n")
