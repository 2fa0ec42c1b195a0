"""Which layers' conversion costs the answers most: the restored-layer scan.

A converted model loses in-context answers (the answer check of :mod:`.answer_check`, with
lookalike facts planted beside the asked one) that its perplexity hardly shows, and not every
layer's rewrite costs them equally. The scan gives one layer at a time its source attention
back (the rest stays converted) and re-asks the probes: a layer whose restoration brings
answers back, or lowers the answers' NLL most, is the one a mixed plan should leave unconverted
(``gqa.keep_layers``). One forward pass per layer over the probes; nothing is fitted.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Iterable, Iterator

import torch

from .answer_check import AnswerCheck, Probe, answer_check


@contextmanager
def restored_attention(converted, source, layers: Iterable[int]) -> Iterator[None]:
    """Within the block, decoder ``layers`` of ``converted`` run ``source``'s attention modules
    (copies: the source is not touched); the converted modules are put back afterwards."""
    targets, sources = converted.model.layers, source.model.layers
    if len(targets) != len(sources):
        raise ValueError(f"the converted model has {len(targets)} layers, the source {len(sources)}; "
                         "a layer can only be restored from a source of the same depth")
    saved = {}
    try:
        for i in layers:
            saved[i] = targets[i].self_attn
            targets[i].self_attn = copy.deepcopy(sources[i].self_attn)
        yield
    finally:
        for i, attn in saved.items():
            targets[i].self_attn = attn


@dataclass
class RestoreScan:
    """Answers of the source, of the converted model, and of the converted model with each layer
    alone given its source attention back."""

    source: AnswerCheck
    converted: AnswerCheck
    restored: dict[int, AnswerCheck]  # layer -> answers with that layer restored

    def gain(self, layer: int) -> float:
        """How much restoring ``layer`` lowers the answer NLL (nats per answer token)."""
        return self.converted.answer_nll - self.restored[layer].answer_nll

    def ranked(self) -> list[int]:
        """Scanned layers, the one whose restoration lowers the answer NLL most first."""
        return sorted(self.restored, key=lambda i: (-self.gain(i), i))

    def table(self) -> str:
        """Markdown: the source, the converted model, then one row per layer (best first)."""
        def row(name: str, a: AnswerCheck, gain: str = "") -> str:
            return f"| {name} | {a.far}/{a.per_depth} | {a.near}/{a.per_depth} | {a.answer_nll:.3f} | {gain} |"

        lines = ["| model | far answers | near answers | answer NLL | NLL gain |", "|---|---:|---:|---:|---:|",
                 row("source", self.source), row("converted", self.converted)]
        lines += [row(f"converted, layer {i} restored", self.restored[i], f"{self.gain(i):+.3f}") for i in self.ranked()]
        return "\n".join(lines)

    def as_dict(self) -> dict:
        return {"source": self.source.to_dict(), "converted": self.converted.to_dict(),
                "restored": {i: a.to_dict() for i, a in self.restored.items()}, "ranked": self.ranked(),
                "gain": {i: self.gain(i) for i in self.restored}}


@torch.no_grad()
def scan_restored_layers(source, converted, probes: list[Probe], layers: Iterable[int] | None = None) -> RestoreScan:
    """Restore each of ``layers`` (default: all) of ``converted`` alone to ``source``'s attention
    and score ``probes`` (:func:`~hf_csa2.metrics.answer_check.make_probes`) again. Both models
    must share the tokenizer the probes were made with."""
    if not probes:
        raise ValueError("no probes to scan with; make_probes(..., per_depth >= 1)")
    layers = range(len(converted.model.layers)) if layers is None else list(layers)
    restored = {}
    for i in layers:
        with restored_attention(converted, source, [i]):
            restored[i] = answer_check(converted, probes)
    return RestoreScan(source=answer_check(source, probes), converted=answer_check(converted, probes), restored=restored)


__all__ = ["RestoreScan", "restored_attention", "scan_restored_layers"]
