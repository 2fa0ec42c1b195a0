"""Triton kernels for hf-csa2 (issue "Kernels"), one folder per op.

Each op has a readable torch reference elsewhere in the package (the reference is the
specification; the kernel is tested against it) and is usable only where Triton can run:
a CUDA device, or the CPU interpreter (``TRITON_INTERPRET=1`` set before Triton is first
imported; slow, meant for tests). Nothing here imports Triton at import time, so
``available()`` answers on machines without it.

Ops:
    sparse_read -- :func:`hf_csa2.kernels.sparse_read.sparse_sink_attention`, the kernel of
        :func:`hf_csa2.model.sparse_attention.sparse_sink_attention`.
    indexer -- :func:`hf_csa2.kernels.indexer.masked_index_scores` and
        :func:`hf_csa2.kernels.indexer.fused_select_top_k`, the kernels of
        :func:`hf_csa2.model.indexer.masked_scores` and :func:`hf_csa2.model.indexer.select_top_k`.
    decode -- :func:`hf_csa2.kernels.decode.decode_sink_attention`, the kernel of
        :func:`hf_csa2.model.sink_attention.grouped_decode_attention` (dense and absorbed-MLA decode steps).
"""

from __future__ import annotations

import importlib.util
import os

import torch

_TRUE = ("1", "true", "on", "yes")


class KernelUnavailableError(RuntimeError):
    """A Triton kernel was called where Triton cannot run."""


def interpreting() -> bool:
    """Whether ``TRITON_INTERPRET`` asks for Triton's CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in _TRUE


def available() -> bool:
    """True when Triton is importable and has somewhere to run: a CUDA device, or the
    interpreter (``TRITON_INTERPRET=1``)."""
    if importlib.util.find_spec("triton") is None:
        return False
    return interpreting() or torch.cuda.is_available()


def require_available(op: str, reference: str) -> None:
    """Raise :class:`KernelUnavailableError` naming ``op`` and its torch ``reference`` unless
    :func:`available`."""
    if available():
        return
    why = ("the `triton` package is not installed (pip install 'hf-csa2[triton]')"
           if importlib.util.find_spec("triton") is None
           else "there is no CUDA device and TRITON_INTERPRET=1 is not set")
    raise KernelUnavailableError(
        f"the Triton kernel {op} cannot run here: {why}. Use the torch reference {reference} instead, "
        "or set TRITON_INTERPRET=1 before importing triton to run the kernel (slowly) on CPU.")


__all__ = ["KernelUnavailableError", "available", "interpreting", "require_available"]
