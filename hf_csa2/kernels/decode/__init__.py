"""One decode step of softmax attention with sinks as Triton kernels (issue "Kernels", items
2c and 2d: the cached decode of dense GQA/MQA layers with sinks and of MLA's absorbed read,
which no installed library has: fla-core's ``parallel_attn`` takes queries and keys of one
length, flash-attn has no sinks).

Reference (the specification, tested against):
:func:`hf_csa2.model.sink_attention.grouped_decode_attention`. Split-KV with one online softmax
per split, merged with the sink in the denominator; keys and values read once per KV head.

Shapes: query [B, HQ, 1, Dk], key [B, H, S, Dk], value [B, H or 1, S, Dv], mask None or
[B|1, 1, 1, S], sinks [HQ] or None -> out [B, 1, HQ, Dv].
"""

from __future__ import annotations

from .. import KernelUnavailableError, available
from .op import decode_sink_attention

__all__ = ["KernelUnavailableError", "available", "decode_sink_attention"]
