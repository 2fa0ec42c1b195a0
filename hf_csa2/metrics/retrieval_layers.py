"""Which layers read facts back from far in the prompt: the retrieval-layer scan.

A CSA2 plan keeps only a short exact window in its ``swa`` and ``reuse`` layers; what they read
beyond it comes from another layer's entries, or not at all. Calibration loss barely moves when
the one layer that copies a far fact loses its far reads (most next tokens do not need it), so a
plan search that scores plans by loss alone can demote exactly that layer. The scan asks the
source directly: for each layer alone, cut its attention to the last ``window`` tokens and
re-ask the far probes of the answer check (:mod:`hf_csa2.metrics.answer_check`). A layer whose
cut loses at least ``drop`` of the source's far answers is a retrieval layer: it needs its own
far entries (``full``), not a window and another layer's latent.

One forward pass per layer over the far probes; nothing is fitted or converted.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Callable, Iterable, Iterator

import torch

from ..model.sink_attention import allowed_mask
from .answer_check import AnswerCheck, Probe, answer_check


def _windowed(attention_mask: torch.Tensor | None, q_len: int, window: int, sink_tokens: int, dtype,
              device) -> torch.Tensor:
    """The layer's own mask (any transformers format) with keys older than ``window`` tokens
    before each query masked too, except the first ``sink_tokens``; boolean when the own mask is,
    else additive in ``dtype``."""
    allowed = allowed_mask(attention_mask, q_len, q_len, device)
    q = torch.arange(q_len, device=device)[:, None]
    k = torch.arange(allowed.shape[-1], device=device)[None, :]
    allowed = allowed & ((k > q - window) | (k < sink_tokens))
    if attention_mask is not None and attention_mask.dtype == torch.bool:
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)


@contextmanager
def windowed_attention(model, layers: Iterable[int], window: int, sink_tokens: int = 0) -> Iterator[None]:
    """Within the block, the attention of decoder ``layers`` reads only the last ``window``
    tokens before each query (itself included) and the first ``sink_tokens`` of the sequence (as
    a CSA2 ``swa`` layer does), on top of its own mask. No cache: for full forward passes (the
    prompt is the whole input)."""
    if window < 1:
        raise ValueError(f"window={window}; allowed: >= 1 token")

    def cut(module, args, kwargs):
        # transformers' decoder layers pass the mask by keyword (positionally, the second
        # argument is position_embeddings in most attention modules)
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        if hidden is None or "attention_mask" not in kwargs:
            raise TypeError(f"{type(module).__name__} is not called with hidden_states and attention_mask= ; "
                            "the retrieval scan supports transformers-style decoder layers")
        mask = _windowed(kwargs["attention_mask"], hidden.shape[1], window, sink_tokens, hidden.dtype, hidden.device)
        return args, {**kwargs, "attention_mask": mask}

    attns = [model.model.layers[i].self_attn for i in layers]
    handles = [attn.register_forward_pre_hook(cut, with_kwargs=True) for attn in attns]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@dataclass
class RetrievalScan:
    """Far answers of the source and of each layer cut to its window alone."""

    window: int
    drop: float
    source: AnswerCheck  # far probes only
    far: dict[int, int]  # layer -> far answers with that layer cut
    sink_tokens: int = 0  # first tokens a cut layer still reads

    @property
    def retrieval_layers(self) -> list[int]:
        """Layers whose cut loses at least ``drop`` of the source's far answers (none when the
        source answers none: there is nothing to lose)."""
        lost = {i: self.source.far - n for i, n in self.far.items()}
        return sorted(i for i, n in lost.items() if self.source.far and n >= self.drop * self.source.far)

    def table(self) -> str:
        """Markdown: one row per scanned layer."""
        n = self.source.per_depth
        lines = [f"| layer cut to its last {self.window} tokens (+{self.sink_tokens} first) | far answers | retrieval layer |",
                 "|---:|---:|---|",
                 f"| none (source) | {self.source.far}/{n} | |"]
        keep = set(self.retrieval_layers)
        lines += [f"| {i} | {f}/{n} | {'yes' if i in keep else ''} |" for i, f in sorted(self.far.items())]
        return "\n".join(lines)

    def as_dict(self) -> dict:
        return {**asdict(self), "retrieval_layers": self.retrieval_layers}


@torch.no_grad()
def scan_retrieval_layers(model, probes: list[Probe], window: int, layers: Iterable[int] | None = None,
                          drop: float = 0.5, sink_tokens: int = 0) -> RetrievalScan:
    """Cut each of ``layers`` (default: all) alone to its last ``window`` tokens (and its first
    ``sink_tokens``) and count the far probes of ``probes``
    (:func:`~hf_csa2.metrics.answer_check.make_probes`; near ones are skipped) still answered.
    ``drop`` in (0, 1]: the share of the source's far answers a cut must lose to make its layer a
    retrieval layer."""
    if not 0 < drop <= 1:
        raise ValueError(f"drop={drop}; allowed: a share in (0, 1]")
    far = [p for p in probes if p.depth == "far"]
    if not far:
        raise ValueError("no far probes to scan with; make_probes(..., per_depth >= 1)")
    t = far[0].ids.shape[0]
    if window >= 0.85 * t:  # far facts sit 5 % into the probe: a window this wide still sees them
        raise ValueError(f"window={window} reaches the far facts of {t}-token probes; allowed: < {int(0.85 * t)} "
                         "(use longer probes)")
    layers = range(len(model.model.layers)) if layers is None else list(layers)
    source = answer_check(model, far)
    counts = {}
    for i in layers:
        with windowed_attention(model, [i], window, sink_tokens):
            counts[i] = answer_check(model, far).far
    return RetrievalScan(window=window, drop=drop, source=source, far=counts, sink_tokens=sink_tokens)


@dataclass
class SufficientSet:
    """Layers that must read beyond their window for the far answers to survive, found greedily:
    every layer cut to its window, then the layer whose far reads bring the answers back best is
    given them back, one at a time. ``steps``: ``(layers read far, far answers, answer NLL)``."""

    window: int
    sink_tokens: int
    source: AnswerCheck
    target: int  # far answers to reach (0 when the source answers none: nothing to keep)
    steps: list[tuple[list[int], int, float]]

    @property
    def layers(self) -> list[int] | None:
        """The first set that reaches ``target`` (None: the search stopped before)."""
        return next((list(ls) for ls, far, _ in self.steps if far >= self.target), None)

    def table(self) -> str:
        n = self.source.per_depth
        lines = [f"| layers reading beyond their last {self.window} tokens (+{self.sink_tokens} first) | far answers | "
                 "answer NLL |", "|---|---:|---:|", f"| all (source) | {self.source.far}/{n} | {self.source.answer_nll:.3f} |"]
        lines += [f"| {','.join(map(str, ls)) or 'none'} | {far}/{n} | {nll:.3f} |" for ls, far, nll in self.steps]
        return "\n".join(lines)


@torch.no_grad()
def sufficient_far_layers(model, probes: list[Probe], window: int, *, layers: Iterable[int] | None = None,
                          sink_tokens: int = 0, keep: float = 0.8, max_layers: int | None = None,
                          log: Callable[[str], None] | None = None) -> SufficientSet:
    """Greedy forward selection of the layers that must read far (see :class:`SufficientSet`):
    ``layers`` (default: all) are cut to their window and the others left whole; at each step the
    cut layer whose far reads bring the most far answers back (ties: the lowest answer NLL) is
    made whole again, until ``keep`` of the source's far answers are back or ``max_layers`` are
    chosen. One forward over the far probes per candidate per step."""
    if not 0 < keep <= 1:
        raise ValueError(f"keep={keep}; allowed: a share in (0, 1]")
    far = [p for p in probes if p.depth == "far"]
    if not far:
        raise ValueError("no far probes to scan with; make_probes(..., per_depth >= 1)")
    candidates = list(range(len(model.model.layers)) if layers is None else layers)
    source = answer_check(model, far)
    target = math.ceil(keep * source.far)
    chosen: list[int] = []

    def check(reading: list[int]) -> AnswerCheck:
        with windowed_attention(model, [i for i in candidates if i not in reading], window, sink_tokens):
            return answer_check(model, far)

    start = check([])
    steps = [([], start.far, start.answer_nll)]
    while steps[-1][1] < target and len(chosen) < min(max_layers or len(candidates), len(candidates)):
        trials = {i: check(sorted(chosen + [i])) for i in candidates if i not in chosen}
        best = min(trials, key=lambda i: (-trials[i].far, trials[i].answer_nll))
        chosen = sorted(chosen + [best])
        steps.append((chosen, trials[best].far, trials[best].answer_nll))
        if log is not None:
            log(f"  far reads in {chosen}: far {trials[best].far}/{source.far} of the source's "
                f"(answer NLL {trials[best].answer_nll:.3f})")
    return SufficientSet(window=window, sink_tokens=sink_tokens, source=source, target=target, steps=steps)


__all__ = ["RetrievalScan", "SufficientSet", "scan_retrieval_layers", "sufficient_far_layers", "windowed_attention"]
