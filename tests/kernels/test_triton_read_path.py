"""A CSA2 model with ``csa2_read_path: triton`` reads through the fused kernel and gives the
reference's logits, prefill and token-by-token decode, every mode; where the kernel cannot run
the path is refused with the fix."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton defines the kernels (see conftest.py)

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from hf_csa2 import kernels  # noqa: E402
from hf_csa2.model.sparse_attention import sparse_sink_attention  # noqa: E402

from ..model.test_csa2_attention import MIXED_PLAN, csa2_model, ids, incremental_logits  # noqa: E402

pytestmark = pytest.mark.skipif(not kernels.available(), reason="no CUDA device and TRITON_INTERPRET is off")


@pytest.mark.parametrize("exact_window", [False, True])
def test_triton_path_gives_the_reference_logits(exact_window):
    model, _, _ = csa2_model("llama", *MIXED_PLAN, sink_tokens=2, exact_window=exact_window)
    x = ids(batch=1, length=11)
    import hf_csa2.kernels.sparse_read as fused

    kernel, calls = fused.sparse_sink_attention, []

    def counting(*args, **kwargs):
        calls.append(1)
        return kernel(*args, **kwargs)

    with torch.no_grad():
        gathered = model(x).logits
        decoded_ref, _ = incremental_logits(model, x, [6, 1, 4])
        model.config.csa2_read_path = "triton"
        fused.sparse_sink_attention = counting
        try:
            fused_logits = model(x).logits
            decoded, _ = incremental_logits(model, x, [6, 1, 4])
        finally:
            fused.sparse_sink_attention = kernel
    assert len(calls) == 5 * 4  # 5 CSA2 layers x (one prefill + three cached steps)
    assert (fused_logits - gathered).abs().max() <= 1e-4
    assert (decoded - decoded_ref).abs().max() <= 1e-4


def test_triton_path_is_refused_where_the_kernel_cannot_run(monkeypatch):
    model, _, _ = csa2_model("llama", ["full", "reuse"], [None, 0])
    model.config.csa2_read_path = "triton"
    monkeypatch.setattr(kernels, "available", lambda: False)
    with pytest.raises(kernels.KernelUnavailableError, match="csa2_read_path='gather'"):
        with torch.no_grad():
            model(ids(batch=1, length=5))


def test_weights_on_the_triton_path_come_from_the_reference():
    from .test_sparse_read import segment

    gen = torch.Generator().manual_seed(0)
    segs = [segment(gen, 5, s=9, n=6, g=1, g_v=1, d_k=8, d_v=8)]
    out, weights = sparse_sink_attention(segs, scaling=0.3, return_weights=True, path="triton")
    ref, ref_weights = sparse_sink_attention(segs, scaling=0.3, return_weights=True)
    assert torch.equal(weights, ref_weights) and torch.equal(out[0], ref[0])


def test_triton_path_scores_the_indexers_with_the_kernel(monkeypatch):
    import hf_csa2.kernels.indexer as fused_indexer

    model, _, _ = csa2_model("llama", *MIXED_PLAN, sink_tokens=2)
    x = ids(batch=1, length=11)
    kernel, calls = fused_indexer.fused_select_top_k, []

    def counting(*args, **kwargs):
        calls.append(1)
        return kernel(*args, **kwargs)

    with torch.no_grad():
        reference = model(x).logits
        assert not calls
        model.config.csa2_read_path = "triton"
        monkeypatch.setattr(fused_indexer, "fused_select_top_k", counting)
        fused = model(x).logits
    indexed = sum(mode in ("full", "reindex") for mode in MIXED_PLAN[0])
    assert len(calls) == indexed  # one fused scoring + Top-K call per full / reindex layer
    assert (fused - reference).abs().max() <= 1e-4
