"""Padded batches through CSA2 models: each row of a left-padded batch (prefill, cached decode,
generate) and of a right-padded one reads what it reads alone, in every mode and architecture."""

import pytest
import torch
from tiny_models import ARCHS

from hf_csa2.model.modeling_hf_csa2 import padding_starts

from .test_csa2_attention import MIXED_PLAN, csa2_model, ids

LENGTHS = (13, 8, 10)  # rows of one batch; the shorter ones padded


def left_padded(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids_ = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids_[i, width - len(r):], mask[i, width - len(r):] = r, 1
    return ids_, mask


def rows_of(seed=0):
    return [ids(batch=1, length=n, seed=seed + i)[0] for i, n in enumerate(LENGTHS)]


def assert_left_padding_reads_as_alone(model, arch):
    rows = rows_of()
    x, mask = left_padded(rows)
    steps = torch.randint(3, 50, (len(rows), 3), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        out = model(x, attention_mask=mask, use_cache=True)
        cache, batch_logits, m = out.cache, [out.logits], mask
        for j in range(steps.shape[1]):  # cached decode steps, the mask growing with them
            m = torch.cat([m, torch.ones(len(rows), 1, dtype=torch.long)], dim=1)
            step = model(steps[:, j : j + 1], attention_mask=m, cache=cache, use_cache=True)
            cache = step.cache
            batch_logits.append(step.logits)
        batch_logits = torch.cat(batch_logits, dim=1)
        for i, r in enumerate(rows):
            alone = model(torch.cat([r, steps[i]])[None]).logits[0]
            got = batch_logits[i, x.shape[1] - len(r):]
            assert (got - alone).abs().max() <= 1e-4, (arch, i)


@pytest.mark.parametrize("exact_window", [False, True])
@pytest.mark.parametrize("arch", ARCHS)
def test_left_padded_prefill_and_decode_equal_each_row_alone(arch, exact_window):
    assert_left_padding_reads_as_alone(csa2_model(arch, *MIXED_PLAN, exact_window=exact_window)[0], arch)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_left_padded_rows_with_block_selection_equal_each_row_alone(arch):
    # blocks align to each row's first real position, so padding does not move them
    assert_left_padding_reads_as_alone(csa2_model(arch, *MIXED_PLAN, select_block=2)[0], arch)


@pytest.mark.parametrize("path", ["explicit", "absorbed"])
@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_mla_left_padded_batches_equal_each_row_alone(arch, path):
    _, mla, _ = csa2_model(arch, ["full"] * 2, [None] * 2)
    mla.config.mla_attention_path = path
    assert_left_padding_reads_as_alone(mla, arch)


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_right_padded_rows_score_as_alone(arch):
    """lm-eval scores right-padded batches: real tokens never read the pads after them."""
    model, _, _ = csa2_model(arch, *MIXED_PLAN)
    rows = rows_of(seed=3)
    width = max(len(r) for r in rows)
    x = torch.stack([torch.cat([r, torch.zeros(width - len(r), dtype=torch.long)]) for r in rows])
    mask = torch.stack([torch.arange(width) < len(r) for r in rows]).long()
    with torch.no_grad():
        logits = model(x, attention_mask=mask).logits
        for i, r in enumerate(rows):
            assert (logits[i, : len(r)] - model(r[None]).logits[0]).abs().max() <= 1e-4


def test_generate_with_left_padding_matches_each_prompt_alone():
    model, _, _ = csa2_model("qwen3", *MIXED_PLAN)
    rows = rows_of(seed=5)
    x, mask = left_padded(rows)
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        batch = model.generate(input_ids=x, attention_mask=mask, **kwargs)[:, x.shape[1]:]
        for i, r in enumerate(rows):
            assert batch[i].tolist() == model.generate(input_ids=r[None], **kwargs)[0, len(r):].tolist()


def test_padding_between_tokens_and_sink_tokens_with_padding_are_refused():
    model, _, _ = csa2_model("llama", *MIXED_PLAN)
    x = ids(batch=2, length=6)
    holes = torch.tensor([[1, 1, 0, 1, 1, 1], [1] * 6])
    with pytest.raises(ValueError, match="padding between tokens"):
        model(x, attention_mask=holes)
    sinks, _, _ = csa2_model("llama", *MIXED_PLAN, sink_tokens=2)
    with pytest.raises(ValueError, match="sink_tokens=2 keeps the first tokens"):
        sinks(x, attention_mask=torch.tensor([[0, 0, 1, 1, 1, 1], [1] * 6]))


def test_padding_starts():
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0]])
    assert padding_starts(mask).tolist() == [2, 0, 0, 0]
