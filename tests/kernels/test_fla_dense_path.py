"""Dense attention with sinks through fla-core's Triton ``parallel_attn``
(``dense_attention_path``): the op against the readable reference (forward and every gradient,
GQA / MQA / MHA, keys and values of different widths, sinks on and off, T in {1, 63, 257}), and
whole models (dense with sinks, MLA prefill) whose logits, gradients and cached decoding equal
the torch path's. Runs in Triton's CPU interpreter (tests/kernels/conftest.py)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton defines the kernels (see conftest.py)

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")
pytest.importorskip("fla.ops.attn.parallel")

from tiny_models import VOCAB, tiny_model  # noqa: E402

from hf_csa2 import kernels  # noqa: E402
from hf_csa2.model import Csa2Config  # noqa: E402
from hf_csa2.model import attention_base, sink_attention  # noqa: E402
from hf_csa2.model.sink_attention import eager_sink_attention, fla_sink_attention  # noqa: E402
from hf_csa2.surgery.sinks import add_sinks  # noqa: E402

pytestmark = pytest.mark.skipif(not kernels.available(), reason="no CUDA device and TRITON_INTERPRET is off")
DEVICE = "cpu" if kernels.interpreting() else "cuda"


def case(seed, t, hq, h, dk, dv, with_sinks):
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(1, hq, t, dk, generator=gen), torch.randn(1, h, t, dk, generator=gen),
          torch.randn(1, h, t, dv, generator=gen)]
    sinks = torch.randn(hq, generator=gen) if with_sinks else None
    return [x.to(DEVICE) for x in xs], None if sinks is None else sinks.to(DEVICE)


@pytest.mark.parametrize("t", [1, 63, 257])
@pytest.mark.parametrize("hq, h, dk, dv", [(4, 4, 16, 16), (4, 2, 16, 16), (4, 1, 24, 16)])
@pytest.mark.parametrize("with_sinks", [True, False])
def test_fla_op_matches_the_reference_forward_and_gradients(t, hq, h, dk, dv, with_sinks):
    (q, k, v), sinks = case(t + h, t, hq, h, dk, dv, with_sinks)
    leaves = [q, k, v] + ([sinks] if with_sinks else [])
    for x in leaves:
        x.requires_grad_(True)
    got, _ = fla_sink_attention(q, k, v, scaling=dk ** -0.5, sinks=sinks)
    want, _ = eager_sink_attention(q, k, v, None, scaling=dk ** -0.5, sinks=sinks)
    assert got.shape == want.shape == (1, t, hq, dv)
    assert (got - want).abs().max() <= 1e-4
    upstream = torch.randn(want.shape, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    got_grads = torch.autograd.grad((got * upstream).sum(), leaves)
    want_grads = torch.autograd.grad((want * upstream).sum(), leaves)
    for name, a, b in zip(("query", "key", "value", "sinks"), got_grads, want_grads):
        assert (a - b).abs().max() <= 1e-4, name


def sink_model(arch="llama", seed=3):
    model = add_sinks(tiny_model(arch)).to(DEVICE)
    model.config._attn_implementation = "sdpa"
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.copy_(torch.randn(layer.self_attn.sinks.shape, generator=gen))
    return model


def counting_fla(monkeypatch):
    calls = []
    kernel = attention_base.fla_sink_attention

    def counted(*args, **kwargs):
        calls.append(args[0].shape[2])  # query positions of the call
        return kernel(*args, **kwargs)

    monkeypatch.setattr(attention_base, "fla_sink_attention", counted)
    return calls


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_dense_sink_model_gives_the_torch_paths_logits_and_gradients(arch, monkeypatch):
    model = sink_model(arch)
    x = torch.randint(3, VOCAB, (2, 19), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    assert_fla_matches_torch(model, x, monkeypatch)


def assert_fla_matches_torch(model, x, monkeypatch):
    """The model's logits and every parameter gradient through fla-core equal the torch path's
    (<= 1e-4), and fla-core computed every layer's attention (one call per layer, all T queries)."""
    params = list(model.parameters())
    model.config.dense_attention_path = "torch"
    want = model(x).logits
    want_grads = torch.autograd.grad(want.logsumexp(-1).sum(), params, allow_unused=True)
    calls = counting_fla(monkeypatch)
    model.config.dense_attention_path = "fla"
    got = model(x).logits
    got_grads = torch.autograd.grad(got.logsumexp(-1).sum(), params, allow_unused=True)
    assert calls == [x.shape[1]] * len(model.model.layers)
    assert (got - want).abs().max() <= 1e-4
    for a, b in zip(got_grads, want_grads):
        assert (a is None) == (b is None)
        if a is not None:
            assert (a - b).abs().max() <= 1e-4


def test_cached_decode_steps_stay_on_torch_and_agree(monkeypatch):
    model = sink_model()
    x = torch.randint(3, VOCAB, (1, 12), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    with torch.no_grad():
        model.config.dense_attention_path = "torch"
        want = model.generate(x, max_new_tokens=6, do_sample=False)
        calls = counting_fla(monkeypatch)
        model.config.dense_attention_path = "fla"
        got = model.generate(x, max_new_tokens=6, do_sample=False)
    assert torch.equal(got, want)
    assert calls == [12] * len(model.model.layers)  # the prefill only; each decode step has a cached prefix


def test_auto_never_takes_fla_on_cpu(monkeypatch):
    if DEVICE != "cpu":
        pytest.skip("the CPU rule")
    model = sink_model()
    calls = counting_fla(monkeypatch)
    with torch.no_grad():
        model(torch.randint(3, VOCAB, (1, 9)))
    assert model.config.dense_attention_path == "auto" and calls == []


def test_fla_without_fla_core_is_refused_with_the_allowed_paths(monkeypatch):
    model = sink_model()
    model.config.dense_attention_path = "fla"
    monkeypatch.setattr(sink_attention, "fla_parallel_attn", lambda: None)
    with pytest.raises(ValueError, match=r"needs fla-core.*auto, torch"):
        with torch.no_grad():
            model(torch.randint(3, VOCAB, (1, 9)).to(DEVICE))


def test_unknown_dense_attention_path_is_refused():
    with pytest.raises(ValueError, match=r"dense_attention_path='flash'; allowed: auto, torch, fla, triton"):
        Csa2Config(dense_attention_path="flash", num_hidden_layers=1, num_attention_heads=2, hidden_size=8)


def test_mla_explicit_prefill_with_sinks_through_fla_equals_torch(monkeypatch):
    from ..model.test_latent_attention import low_rank_mla

    model = low_rank_mla("llama", sinks=True).to(DEVICE)
    model.config._attn_implementation = "sdpa"
    model.config.mla_attention_path = "explicit"
    x = torch.randint(3, VOCAB, (2, 17), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    with torch.no_grad():
        model.config.dense_attention_path = "torch"
        want = model(x).logits
        calls = counting_fla(monkeypatch)
        model.config.dense_attention_path = "fla"
        got = model(x).logits
    assert calls == [17] * len(model.model.layers)  # 96-wide keys vs 64-wide values in real MLA: widths differ here too
    assert (got - want).abs().max() <= 1e-4


@pytest.mark.parametrize("arch, shared", [("llama", False), ("llama", True), ("qwen3", False)])
def test_mla_absorbed_prefill_with_sinks_through_fla_gives_torch_logits_and_gradients(arch, shared, monkeypatch):
    """Absorbed MLA (issue 19 op c): every query head reads the one latent (values r+1 wide, keys
    r+1+rope wide, neither a power of two) through fla-core's kernel, sinks in its denominator."""
    from ..model.test_latent_attention import low_rank_mla

    model = low_rank_mla(arch, shared=shared, sinks=True).to(DEVICE)
    model.config._attn_implementation = "sdpa"
    model.config.mla_attention_path = "absorbed"
    x = torch.randint(3, VOCAB, (2, 21), generator=torch.Generator().manual_seed(4)).to(DEVICE)
    assert_fla_matches_torch(model, x, monkeypatch)
