"""The CSA2 indexer loss of a training run (DeepSeek-V3.2 DSA): the KL of each indexer's
distribution over the selectable positions to the teacher's dense attention of the same layer,
summed over heads and renormalised (:func:`~hf_csa2.surgery.indexer_warmup.dense_attention_targets`).

The Top-K selection has no gradient, so the distillation loss never reaches an indexer; this
loss is how indexers learn while the rest of the student changes. A recipe runs it alone for
``loss.indexer_steps`` steps (DSA stage 1: nothing else trains) and may keep it, weighted by
``loss.indexer_weight``, beside the distillation loss afterwards (DSA stage 2).

The indexer of layer ``i`` sees the hidden states the student feeds that layer, detached: its
gradient stays inside the indexer. A reindex layer scores as the model does: against the index
keys of the full layer it reads (detached: only the full layer's own term trains ``wk``), with that
layer's rotary table, over positions past its first ``sink_tokens`` (those it holds exactly). The
loss is computed inside the student's forward (hooks) and returned as ``index_loss`` in its output,
so that DistributedDataParallel sees which parameters it reaches.

Over every selectable position, not only the picked Top-K (DSA's stage 2 restricts it to those):
the targets are ``[B, T, T]`` per indexed layer, so memory grows with the square of the block.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from transformers.modeling_outputs import CausalLMOutputWithPast

from ..engine.trainer import INDEX_LOSS
from ..surgery.calibration import decoder_layers
from ..surgery.csa2 import as_dense_csa2
from ..surgery.indexer_warmup import dense_attention_targets, index_log_probs

@dataclass
class CausalLMOutputWithIndexLoss(CausalLMOutputWithPast):
    """A causal LM output that also carries the indexer loss (a declared field, so that
    DistributedDataParallel, which rebuilds outputs from their fields, keeps it)."""

    index_loss: torch.FloatTensor | None = None


def _base(model: nn.Module) -> nn.Module:
    """The transformers model under a PeftModel (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def indexed_layers(model: nn.Module) -> list[int]:
    """Indices of the decoder layers whose attention has an indexer (CSA2 full and reindex)."""
    return [i for i, layer in enumerate(decoder_layers(_base(model))) if getattr(layer.self_attn, "indexer", None) is not None]


def first_selectable(attn: nn.Module) -> int:
    """The first position a layer's indexer may usefully pick: reindex layers hold their first
    ``sink_tokens`` exactly and drop picks there; full layers read every position from their entries."""
    return 0 if attn.spec["mode"] == "full" else int(getattr(attn, "sink_tokens", 0) or 0)


def shortest_block(model: nn.Module) -> int:
    """The shortest training block in which every indexed layer has a selectable position:
    ``window + first selectable position + 1``."""
    layers = decoder_layers(_base(model))
    return max(layers[i].self_attn.window + first_selectable(layers[i].self_attn) + 1 for i in indexed_layers(model))


def dense_teacher(teacher: nn.Module) -> nn.Module:
    """``teacher`` as an hf_csa2 model with dense layers (the same logits; its attention modules
    expose ``scoring_qk``). Refused when a layer is not dense: the target is a dense attention."""
    dense = as_dense_csa2(teacher)
    kinds = sorted({s["kind"] for s in dense.config.attention_layers} - {"dense"})
    if kinds:
        raise ValueError(f"the indexer loss needs a teacher with dense attention layers; this one has {', '.join(kinds)}")
    return dense


def indexer_kl(target: torch.Tensor, valid: torch.Tensor, log_probs: torch.Tensor) -> torch.Tensor:
    """Mean over the valid queries of KL(target || exp(log_probs)); rows [N, T, S], valid [N, T]."""
    terms = torch.where(target > 0, target * (torch.log(target.clamp_min(1e-30)) - log_probs), torch.zeros_like(target))
    if valid.any():
        return terms.sum(-1)[valid].mean()
    return (log_probs.masked_fill(~torch.isfinite(log_probs), 0.0) * 0.0).sum()  # zero, still in the graph


def _layer_input(args, kwargs) -> tuple[torch.Tensor, tuple]:
    hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
    return hidden.detach(), tuple(x.detach() for x in kwargs["position_embeddings"])


class IndexerLoss:
    """Attached to a student (a CSA2 model or a PeftModel around one, with at least one indexer)
    and a teacher from :func:`dense_teacher`.

    Use: run the teacher inside :meth:`teacher_targets` (records each indexed layer's dense
    attention target), then the student inside :meth:`active`: its output carries
    ``index_loss`` -- the mean over indexed layers of :func:`indexer_kl`.
    """

    def __init__(self, student: nn.Module, teacher: nn.Module):
        self.layers = indexed_layers(student)
        if not self.layers:
            raise ValueError("the indexer loss needs a CSA2 student with full or reindex layers; this student has no indexer")
        self.student_attn = [layer.self_attn for layer in decoder_layers(_base(student))]
        self.teacher_attn = [layer.self_attn for layer in decoder_layers(teacher)]
        self.targets: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.terms: list[torch.Tensor] = []
        self.keys: dict[int, torch.Tensor] = {}
        self.on = False
        self.handles = [self.student_attn[i].register_forward_pre_hook(self._student_hook(i), with_kwargs=True)
                        for i in self.layers]
        self.handles.append(_base(student).register_forward_hook(self._attach_output))

    def remove(self) -> None:
        """Detach the hooks from the student."""
        for h in self.handles:
            h.remove()
        self.handles = []

    def parameters(self) -> list[nn.Parameter]:
        return [p for i in self.layers for p in self.student_attn[i].indexer.parameters()]

    @contextmanager
    def teacher_targets(self):
        """Record the dense attention targets of the teacher forwards run inside."""
        self.targets.clear()

        def make(i):
            def hook(module, args, kwargs):
                hidden, pe = _layer_input(args, kwargs)
                attn = self.student_attn[i]
                with torch.no_grad():
                    q, k = module.scoring_qk(hidden, pe)
                    self.targets[i] = dense_attention_targets(q, k, module.scaling, attn.window, first_selectable(attn))
            return hook

        handles = [self.teacher_attn[i].register_forward_pre_hook(make(i), with_kwargs=True) for i in self.layers]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    @contextmanager
    def active(self):
        """Student forwards run inside carry ``index_loss`` in their output."""
        missing = [i for i in self.layers if i not in self.targets]
        if missing:
            raise RuntimeError(f"no teacher targets for layers {missing}: run the teacher inside teacher_targets() first")
        self.on, self.terms, self.keys = True, [], {}
        try:
            yield
        finally:
            self.on = False

    def _student_hook(self, i: int):
        def hook(attn, args, kwargs):
            if not self.on:
                return
            hidden, pe = _layer_input(args, kwargs)
            if attn.spec["mode"] == "full":
                keys = attn.indexer.keys(hidden, pe)
                self.keys[i] = (keys.detach(), pe)
            else:  # reindex: the index keys and rotary table of the full layer it reads (as the model does)
                keys, pe = self.keys[attn.layer_spec.entries]
            target, valid = self.targets[i]
            log_probs = index_log_probs(attn.indexer, hidden, pe, keys, attn.window, first_selectable(attn))
            self.terms.append(indexer_kl(target, valid, log_probs))
        return hook

    def _attach_output(self, module, args, output):
        if self.on:
            return CausalLMOutputWithIndexLoss(**output, **{INDEX_LOSS: torch.stack(self.terms).mean()})
        return output


__all__ = ["CausalLMOutputWithIndexLoss", "IndexerLoss", "dense_teacher", "first_selectable", "indexed_layers", "indexer_kl",
           "shortest_block"]
