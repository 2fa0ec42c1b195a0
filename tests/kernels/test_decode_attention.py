"""hf_csa2's Triton decode step with sinks (hf_csa2.kernels.decode) against its torch reference
(hf_csa2.model.sink_attention.grouped_decode_attention) and the eager oracle: G in {1, H}, one
KV head, MLA-style stride-0 keys with values of another width (neither a power of two), S in
{1, 63, 257}, one split or many, sinks on and off, left padding, rows with no allowed key; and
whole models (dense with sinks, absorbed MLA) whose greedy decoding through it equals torch's.
Runs in Triton's CPU interpreter (tests/kernels/conftest.py)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton defines the kernels (see conftest.py)

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from tiny_models import VOCAB  # noqa: E402

from hf_csa2 import kernels  # noqa: E402
from hf_csa2.kernels.decode import decode_sink_attention  # noqa: E402
from hf_csa2.model import attention_base, sink_attention  # noqa: E402
from hf_csa2.model.sink_attention import eager_sink_attention, grouped_decode_attention  # noqa: E402

pytestmark = pytest.mark.skipif(not kernels.available(), reason="no CUDA device and TRITON_INTERPRET is off")
DEVICE = "cpu" if kernels.interpreting() else "cuda"


def step(seed, b, hq, h, s, dk, dv, with_sinks, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, 1, dk, generator=gen)
    k = torch.randn(b, h, s, dk, generator=gen)
    v = torch.randn(b, h, s, dv, generator=gen)
    sinks = torch.randn(hq, generator=gen) if with_sinks else None
    q, k, v = (x.to(device=DEVICE, dtype=dtype) for x in (q, k, v))
    return q, k, v, None if sinks is None else sinks.to(DEVICE)


def left_padding(b, s, pad):
    """bool [B, 1, 1, S]: row i's first ``pad[i]`` keys are padding."""
    mask = torch.ones(b, 1, 1, s, dtype=torch.bool)
    for i, p in enumerate(pad):
        mask[i, ..., :p] = False
    return mask.to(DEVICE)


@pytest.mark.parametrize("s", [1, 63, 257])
@pytest.mark.parametrize("hq, h", [(4, 4), (6, 2), (4, 1)])
@pytest.mark.parametrize("with_sinks", [True, False])
@pytest.mark.parametrize("split_len", [None, 16])
def test_decode_step_matches_the_reference_and_the_oracle(s, hq, h, with_sinks, split_len):
    q, k, v, sinks = step(s + hq + h, 2, hq, h, s, 24, 20, with_sinks)
    mask = left_padding(2, s, [0, s // 3])
    got, _ = decode_sink_attention(q, k, v, mask, scaling=24 ** -0.5, sinks=sinks, split_len=split_len)
    want, _ = grouped_decode_attention(q, k, v, mask, scaling=24 ** -0.5, sinks=sinks)
    oracle, _ = eager_sink_attention(q, k, v, mask, scaling=24 ** -0.5, sinks=sinks)
    assert got.shape == want.shape == (2, 1, hq, 20) and got.dtype == q.dtype
    assert (got - want).abs().max() <= 1e-5
    assert (got - oracle).abs().max() <= 1e-5


def test_mla_absorbed_read_stride_zero_keys_and_narrower_values():
    # every query head reads one latent: keys [latent, 1, rope] expanded over the KV heads with
    # stride 0, values [latent, 1] of one head; widths 97 and 65
    q, k1, v1, sinks = step(11, 2, 9, 1, 200, 97, 65, True)
    k = k1.expand(-1, 3, -1, -1)
    for split_len in (None, 64):
        got, _ = decode_sink_attention(q, k, v1, None, scaling=0.1, sinks=sinks, split_len=split_len)
        want, _ = grouped_decode_attention(q, k, v1, None, scaling=0.1, sinks=sinks)
        assert (got - want).abs().max() <= 1e-5


def test_rows_with_no_allowed_key_are_zeros_never_nan():
    q, k, v, sinks = step(2, 2, 4, 2, 40, 16, 16, True)
    mask = left_padding(2, 40, [0, 40])  # row 1: every key is padding
    for with_sinks in (sinks, None):
        got, _ = decode_sink_attention(q, k, v, mask, scaling=0.25, sinks=with_sinks, split_len=16)
        assert not torch.isnan(got).any()
        assert torch.equal(got[1], torch.zeros_like(got[1]))
        assert got[0].abs().sum() > 0


def test_a_split_without_allowed_keys_drops_out_of_the_merge():
    # the first three splits of 16 hold only padding: the merge must not let them shift the result
    q, k, v, sinks = step(3, 1, 4, 4, 100, 16, 16, True)
    mask = left_padding(1, 100, [48])
    got, _ = decode_sink_attention(q, k, v, mask, scaling=0.25, sinks=sinks, split_len=16)
    want, _ = eager_sink_attention(q[..., :], k[:, :, 48:], v[:, :, 48:], None, scaling=0.25, sinks=sinks)
    assert (got - want).abs().max() <= 1e-5


def test_additive_float_masks_read_like_bool_masks():
    q, k, v, sinks = step(4, 2, 4, 2, 50, 16, 16, True)
    mask = left_padding(2, 50, [0, 20])
    additive = torch.zeros(mask.shape, device=DEVICE).masked_fill(~mask, torch.finfo(torch.float32).min)
    a, _ = decode_sink_attention(q, k, v, mask, scaling=0.25, sinks=sinks)
    b, _ = decode_sink_attention(q, k, v, additive, scaling=0.25, sinks=sinks)
    assert torch.equal(a, b)


def test_fp16_inputs_within_fp16_rounding_of_the_fp32_result():
    q, k, v, sinks = step(5, 1, 8, 2, 130, 32, 32, True, dtype=torch.float16)
    got, _ = decode_sink_attention(q, k, v, None, scaling=32 ** -0.5, sinks=sinks)
    want, _ = grouped_decode_attention(q.float(), k.float(), v.float(), None, scaling=32 ** -0.5, sinks=sinks)
    assert got.dtype == torch.float16
    assert (got.float() - want).abs().max() <= 2e-3  # the output's own fp16 rounding at |out| ~ 1


@pytest.mark.parametrize("bad, message", [
    (lambda q, k, v: (q.expand(-1, -1, 2, -1), k, v), r"expected \[B, HQ, 1, Dk\]"),
    (lambda q, k, v: (q, k[:, :3], v[:, :3]), r"H dividing 4"),
    (lambda q, k, v: (q, k, v[:, :, :5]), r"value .*expected"),
])
def test_bad_shapes_name_the_argument(bad, message):
    q, k, v, _ = step(6, 1, 4, 4, 9, 16, 16, False)
    with pytest.raises(ValueError, match=message):
        decode_sink_attention(*bad(q, k, v), None, scaling=0.25)


def counting_decode(monkeypatch):
    calls = []
    kernel = sink_attention.decode_kernel()

    def counted(query, *args, **kwargs):
        calls.append(query.shape[2])
        return kernel(query, *args, **kwargs)

    monkeypatch.setattr(attention_base, "decode_kernel", lambda: counted)
    return calls


def greedy_on_both_paths(model, x, monkeypatch, new_tokens=6):
    """(torch tokens, Triton tokens, Triton decode calls) of greedy generation; logits of every
    step compared too."""
    with torch.no_grad():
        model.config.dense_attention_path = "torch"
        want = model.generate(x, max_new_tokens=new_tokens, do_sample=False, output_logits=True,
                              return_dict_in_generate=True)
        calls = counting_decode(monkeypatch)
        model.config.dense_attention_path = "triton"
        got = model.generate(x, max_new_tokens=new_tokens, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
    for a, b in zip(got.logits, want.logits):
        assert (a - b).abs().max() <= 1e-4
    return want.sequences, got.sequences, calls


def test_a_dense_sink_model_decodes_through_the_kernel_with_the_torch_tokens(monkeypatch):
    from .test_fla_dense_path import sink_model

    pytest.importorskip("fla.ops.attn.parallel")  # "triton" takes fla-core for the prefill
    model = sink_model()
    x = torch.randint(3, VOCAB, (1, 12), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    want, got, calls = greedy_on_both_paths(model, x, monkeypatch)
    assert torch.equal(got, want)
    assert calls == [1] * (5 * len(model.model.layers))  # every decode step after the first token, every layer


def test_absorbed_mla_with_sinks_decodes_through_the_kernel_with_the_torch_tokens(monkeypatch):
    from ..model.test_latent_attention import low_rank_mla

    pytest.importorskip("fla.ops.attn.parallel")
    model = low_rank_mla("llama", sinks=True).to(DEVICE)
    model.config._attn_implementation = "sdpa"
    model.config.mla_attention_path = "auto"  # absorbed for one query position
    x = torch.randint(3, VOCAB, (1, 10), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    want, got, calls = greedy_on_both_paths(model, x, monkeypatch)
    assert torch.equal(got, want)
    assert calls == [1] * (5 * len(model.model.layers))


def test_triton_path_where_it_cannot_run_is_refused_with_the_allowed_paths(monkeypatch):
    from .test_fla_dense_path import sink_model

    model = sink_model()
    model.config.dense_attention_path = "triton"
    monkeypatch.setattr(attention_base, "decode_kernel", lambda: None)
    x = torch.randint(3, VOCAB, (1, 5)).to(DEVICE)
    with torch.no_grad():
        with pytest.raises(ValueError, match=r"dense_attention_path='triton' needs .*allowed without them: auto, torch, fla"):
            model.generate(x, max_new_tokens=2, do_sample=False)


def test_auto_never_takes_the_decode_kernel_on_cpu(monkeypatch):
    if DEVICE != "cpu":
        pytest.skip("the CPU rule")
    from .test_fla_dense_path import sink_model

    model = sink_model()
    calls = counting_decode(monkeypatch)
    with torch.no_grad():
        model.generate(torch.randint(3, VOCAB, (1, 6)), max_new_tokens=3, do_sample=False)
    assert model.config.dense_attention_path == "auto" and calls == []
