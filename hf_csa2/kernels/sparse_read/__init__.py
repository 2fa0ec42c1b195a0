"""Sparse read with sink logits as Triton kernels (issue "Kernels", item 2a).

Reference (the specification, tested against): :mod:`hf_csa2.model.sparse_attention`. A query
reads the entries its index lists name, from one or more *segments* (own query, key/value
store, index list), in ONE softmax whose denominator also holds ``exp(s_h)`` for a sink.

Design:

* **Segment-wise kernels.** The forward kernel reads ONE segment: each (batch row, query, head
  block) program gathers its N indexed keys/values (``-1`` skipped) in blocks of ``BLOCK_N``
  with an online softmax, and writes the segment-normalised read ``o`` [B, T, H, Dv] and its
  log-sum-exp ``lse`` [B, T, H] (-inf for a row with no entry, whose ``o`` is zero). Nothing of
  size T x S or T x N is stored. fp32 throughout.
* **Exact merge.** Segments (e.g. a latent segment G = 1 and a window segment G = H with another
  Dk) are combined in torch: ``lse_total = logsumexp(lse_1, ..., lse_K, s_h)`` and segment i
  contributes ``exp(lse_i - lse_total) * o_i`` -- the same numbers as one softmax over the
  union, with the sink in the denominator only (:mod:`.merge`). Autograd differentiates the
  merge, so the kernels only see per-segment gradients ``dO_i`` and ``dlse_i``.
* **Backward.** With ``p_j`` the segment-normalised weights,
  ``dz_j = p_j * (dO . v_j - dO . o + dlse)``; dq is summed in the query's own program, while
  dk and dv are scattered into the store rows with atomic adds into fp32 buffers (an entry is
  read by many queries, and may repeat in one list), cast back at the end.

Shapes (one segment): query [B, T, H, Dk], keys [B, S, G, Dk], values [B, S, G', Dv],
index [B, T, N] long (G and G' divide H; head h reads group h // (H / G)).
"""

from __future__ import annotations

from .. import KernelUnavailableError, available
from .merge import merge_segments
from .op import READ_PATHS, SparseReadFunction, sparse_read, sparse_sink_attention

__all__ = ["READ_PATHS", "KernelUnavailableError", "SparseReadFunction", "available", "merge_segments", "sparse_read",
           "sparse_sink_attention"]
