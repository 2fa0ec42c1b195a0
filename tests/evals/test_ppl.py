import gc
import json
import math
import random
import tempfile
import weakref
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from hf_csa2.data.corpus import CorpusError, read_text, resolve_text
from hf_csa2.data import windows as windows_module
from hf_csa2.metrics import perplexity as perplexity_module
from hf_csa2.evals.ppl import (
    PplResults,
    compare_ppl,
    format_ppl_table,
    mean_nll,
    token_windows,
    write_ppl_json,
)

WORDS = (
    "the a of to and in is it that for on with as by this be are from at or an "
    "model token window text python module function class value return list file "
    "data error type object string number import call default example"
).split()


def make_tokenizer(words=WORDS, bos=True):
    vocab = {"[UNK]": 0, "[BOS]": 1}
    vocab.update({w: i + 2 for i, w in enumerate(words)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if bos:
        # A post-processor that WOULD add BOS, to prove we ask for no specials.
        tok.post_processor = processors.TemplateProcessing(
            single="[BOS] $A", special_tokens=[("[BOS]", 1)]
        )
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", bos_token="[BOS]")


VOCAB = len(WORDS) + 2


def make_model(seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        max_position_embeddings=128,
    )
    return LlamaForCausalLM(cfg).eval()


def stream_ids(tok, path):
    return tok(read_text(path), add_special_tokens=False)["input_ids"]


def write_corpus(root: Path, n_files=4, words_per_file=300, seed=0, extra_words=()):
    rng = random.Random(seed)
    pool = list(WORDS) + list(extra_words)
    for i in range(n_files):
        p = root / f"sub{i % 2}" / f"f{i}.txt"
        p.parent.mkdir(parents=True, exist_ok=True)
        lines = []
        for _ in range(words_per_file // 10):
            lines.append(" ".join(rng.choice(pool) for _ in range(10)) + ".")
        p.write_text("\n".join(lines))
    return root


@pytest.fixture
def text_dir(tmp_path):
    return write_corpus(tmp_path / "text", extra_words=("zzz", "unknownword"))


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def test_windows_exact_nonoverlapping_deterministic(tok, text_dir):
    full = stream_ids(tok, text_dir)
    w = token_windows(tok, text_dir, window=16, max_windows=5)
    assert w.dtype == torch.long and tuple(w.shape) == (5, 16)
    for i in range(5):
        assert w[i].tolist() == full[16 * i : 16 * (i + 1)]
    assert torch.equal(w, token_windows(tok, text_dir, window=16, max_windows=5))
    assert torch.equal(w, token_windows(make_tokenizer(), str(text_dir), window=16, max_windows=5))
    assert w[0, 0].item() == full[0] != 1, "no BOS may be added"

    everything = token_windows(tok, text_dir, window=16)
    assert everything.shape[0] == len(full) // 16  # ragged tail dropped
    assert everything.flatten().tolist() == full[: everything.numel()]
    assert torch.equal(everything[:5], w)


def test_windows_errors(tok, text_dir, tmp_path):
    with pytest.raises(ValueError):
        token_windows(tok, text_dir, window=1)
    with pytest.raises(ValueError):
        token_windows(tok, text_dir, window=8, max_windows=0)
    short = tmp_path / "short.txt"
    short.write_text("the model")
    with pytest.raises(ValueError, match="fewer than one window"):
        token_windows(tok, short, window=8)
    with pytest.raises(CorpusError):
        token_windows(tok, "python-docs:nope", window=8)


def manual_nll(model, windows):
    total, count = 0.0, 0
    with torch.no_grad():
        for row in windows:
            logits = model(input_ids=row[None]).logits[0].double()
            lp = torch.log_softmax(logits, dim=-1)
            total += -lp[torch.arange(len(row) - 1), row[1:]].sum().item()
            count += len(row) - 1
    return total / count, count


@pytest.mark.parametrize("batch_size", [1, 3])
def test_mean_nll_matches_manual(tok, text_dir, batch_size):
    model = make_model()
    windows = token_windows(tok, text_dir, window=24, max_windows=7)
    want, count = manual_nll(model, windows)
    model.train()  # mean_nll must switch to eval and then restore
    got = mean_nll(model, windows, batch_size=batch_size)
    assert model.training
    assert got["tokens"] == count == 7 * 23
    assert abs(got["nll"] - want) < 1e-6
    assert got["ppl"] == pytest.approx(math.exp(want), rel=1e-6)


def test_mean_nll_chunked_logprobs(tok, text_dir):
    # Force the per-position chunking path (used for huge vocabularies).
    model = make_model()
    windows = token_windows(tok, text_dir, window=24, max_windows=3)
    want, _ = manual_nll(model, windows)
    with mock.patch.object(perplexity_module, "_MAX_LOGPROB_ELEMS", VOCAB * 5):
        got = mean_nll(model, windows)
    assert abs(got["nll"] - want) < 1e-6


def test_mean_nll_rejects_foreign_ids(text_dir):
    model = make_model()
    with pytest.raises(ValueError, match="embedding"):
        mean_nll(model, torch.full((1, 8), VOCAB + 3, dtype=torch.long))
    with pytest.raises(ValueError):
        mean_nll(model, torch.zeros((2, 1), dtype=torch.long))


def test_same_weights_ratio_exactly_one(tok, text_dir):
    a = make_model(seed=0)
    b = make_model(seed=123)
    b.load_state_dict(a.state_dict())
    c = make_model(seed=7)
    res = compare_ppl(
        [("a", a, tok), ("b", b, make_tokenizer()), ("c", c, tok)],
        text_dir,
        window=16,
        max_windows=4,
    )
    assert [r["model"] for r in res] == ["a", "b", "c"]
    assert res[0]["ratio"] == 1.0
    assert res[1]["ratio"] == 1.0
    assert res[1]["ppl"] == res[0]["ppl"]
    assert res[2]["ratio"] != 1.0
    assert all(r["tokens"] == 4 * 15 for r in res)
    assert set(res[0]) == {"model", "ppl", "nll", "tokens", "ratio"}


def test_loaders_keep_one_model_resident(tok, text_dir):
    calls = []
    first_ref = []

    def load_first():
        calls.append("first")
        m = make_model(seed=0)
        first_ref.append(weakref.ref(m))
        return m, tok

    def load_second():
        calls.append("second")
        gc.collect()
        assert first_ref[0]() is None, "previous model still alive while loading the next"
        return SimpleNamespace(model=make_model(seed=0), tokenizer=tok)

    entries = iter([("first", load_first), ("second", load_second)])
    res = compare_ppl(entries, text_dir, window=16, max_windows=2)
    assert calls == ["first", "second"]
    assert res[1]["ratio"] == 1.0


def test_mismatched_tokenizer_raises(tok, text_dir):
    other = make_tokenizer(words=list(reversed(WORDS)))
    with pytest.raises(ValueError, match="different tokenizer"):
        compare_ppl(
            [("a", make_model(), tok), ("b", make_model(), other)], text_dir, window=16, max_windows=2
        )


def test_bad_entry_and_empty(text_dir):
    with pytest.raises(TypeError):
        compare_ppl([("only-a-name",)], text_dir, window=16)
    with pytest.raises(ValueError):
        compare_ppl([], text_dir, window=16)


def test_json_schema(tok, text_dir, tmp_path):
    a, b = make_model(0), make_model(1)
    res = compare_ppl([("a", a, tok), ("b", b, tok)], text_dir, window=16, max_windows=3)
    out = tmp_path / "sub" / "ppl.json"
    write_ppl_json(res, out)
    doc = json.loads(out.read_text())
    assert set(doc) == {"results", "window", "max_windows", "text"}
    assert doc["window"] == 16 and doc["max_windows"] == 3 and doc["text"] == str(text_dir)
    assert len(doc["results"]) == 2
    for r, orig in zip(doc["results"], res):
        assert set(r) == {"model", "ppl", "tokens", "nll", "ratio"}
        assert isinstance(r["model"], str) and isinstance(r["tokens"], int)
        assert r["ppl"] == orig["ppl"] and r["nll"] == orig["nll"] and r["ratio"] == orig["ratio"]
    assert doc["results"][0]["ratio"] == 1.0

    plain = [dict(r) for r in res]
    with pytest.raises(ValueError, match="window"):
        write_ppl_json(plain, tmp_path / "x.json")
    write_ppl_json(plain, tmp_path / "x.json", window=16, max_windows=None, text="python-docs:heldout")
    doc2 = json.loads((tmp_path / "x.json").read_text())
    assert doc2["max_windows"] is None and doc2["text"] == "python-docs:heldout"


def test_json_nonfinite_is_null(tmp_path):
    res = PplResults(
        [{"model": "broken", "ppl": math.inf, "nll": 1e4, "tokens": 10, "ratio": math.nan}],
        window=8,
        max_windows=1,
        text="t",
    )
    write_ppl_json(res, tmp_path / "o.json")
    r = json.loads((tmp_path / "o.json").read_text())["results"][0]  # strict JSON parses
    assert r["ppl"] is None and r["ratio"] is None and r["nll"] == 1e4


def test_format_table():
    res = [
        {"model": "base", "ppl": 12.3456789, "nll": 2.5, "tokens": 511000, "ratio": 1.0},
        {"model": "pruned-long-name", "ppl": 2.5e7, "nll": 17.0, "tokens": 511000, "ratio": 2.0e6},
    ]
    table = format_ppl_table(res)
    lines = table.splitlines()
    assert len(lines) == 4
    assert [c.strip() for c in lines[0].strip("|").split("|")] == ["model", "ppl", "ratio to first", "tokens"]
    assert len({len(line) for line in lines}) == 1, "columns must be aligned"
    assert "12.3457" in lines[2] and "1.0000" in lines[2] and "511000" in lines[2]
    assert "pruned-long-name" in lines[3]
    assert format_ppl_table([])  # header only, no crash


_word = st.one_of(
    st.sampled_from(WORDS),
    st.text(alphabet="abcdefghijklmnopqrstuvwxyz", min_size=1, max_size=40),
)


@settings(max_examples=40, deadline=None)
@given(
    files=st.lists(st.lists(_word, min_size=0, max_size=120), min_size=1, max_size=4),
    seps=st.sampled_from([" ", "\n", "  \n\t"]),
    window=st.integers(2, 20),
    max_windows=st.one_of(st.none(), st.integers(1, 12)),
    tight_budget=st.booleans(),
)
def test_windows_are_prefix_of_stream(files, seps, window, max_windows, tight_budget):
    tok = make_tokenizer()
    with tempfile.TemporaryDirectory() as d:
        for i, words in enumerate(files):
            (Path(d) / f"{i:02d}.txt").write_text(seps.join(words))
        full = stream_ids(tok, d)
        n = len(full) // window
        if max_windows is not None:
            n = min(n, max_windows)
        # A tight character budget forces the read-more-and-retry path.
        tight = 1 if tight_budget else None
        with mock.patch.multiple(
            windows_module,
            _CHARS_PER_TOKEN_BUDGET=tight or windows_module._CHARS_PER_TOKEN_BUDGET,
            _MIN_CHAR_BUDGET=tight or windows_module._MIN_CHAR_BUDGET,
        ):
            if n == 0:
                with pytest.raises(ValueError):
                    token_windows(tok, d, window=window, max_windows=max_windows)
                return
            w = token_windows(tok, d, window=window, max_windows=max_windows)
        assert tuple(w.shape) == (n, window)
        assert w.flatten().tolist() == full[: n * window]


@pytest.mark.real
def test_truncated_read_matches_full_stream_on_real_corpus(tok):
    try:
        path = resolve_text("python-docs:heldout")
    except CorpusError as e:
        pytest.skip(f"Python docs corpus unavailable (run scripts/fetch_fixtures.sh): {e}")
    w = token_windows(tok, path, window=64, max_windows=50)
    full = stream_ids(tok, path)
    assert w.flatten().tolist() == full[: 50 * 64]


@pytest.mark.real
def test_real_smollm2_heldout_ppl_is_sane(smollm2):
    try:
        resolve_text("python-docs:heldout")
    except CorpusError as e:
        pytest.skip(f"Python docs corpus unavailable (run scripts/fetch_fixtures.sh): {e}")
    w = token_windows(smollm2.tokenizer, "python-docs:heldout", window=128, max_windows=2)
    assert tuple(w.shape) == (2, 128)
    assert smollm2.tokenizer.bos_token_id is None or w[0, 0].item() != smollm2.tokenizer.bos_token_id
    r = mean_nll(smollm2.model, w, batch_size=2)
    assert r["tokens"] == 2 * 127
    assert 1.5 < r["ppl"] < 100, r  # a working 135M LM on English docs text
