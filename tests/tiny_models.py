"""Tiny configs, built in code, for every supported source architecture."""

from __future__ import annotations

import torch
from transformers import (
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
)
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

ARCHS = ("llama", "qwen2", "qwen3", "mistral", "gemma3_text")
VOCAB = 128


def tiny_config(arch: str, num_kv_heads: int = 2, num_heads: int = 4, max_position_embeddings: int = 256, num_layers: int = 2):
    common = dict(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=64, num_hidden_layers=num_layers,
        num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, head_dim=12,
        max_position_embeddings=max_position_embeddings, initializer_range=0.2, pad_token_id=0, eos_token_id=1, bos_token_id=2,
    )
    if arch == "llama":
        return LlamaConfig(**common, tie_word_embeddings=True)
    if arch == "qwen2":  # q/k/v biases
        return Qwen2Config(**common, tie_word_embeddings=False)
    if arch == "qwen3":  # QK-norm
        return Qwen3Config(**common, tie_word_embeddings=True)
    if arch == "mistral":  # sliding window shorter than the test sequences
        return MistralConfig(**common, sliding_window=7)
    if arch == "gemma3_text":  # QK-norm, query_pre_attn_scalar, sliding/global layers
        return Gemma3TextConfig(
            **common, sliding_window=7, query_pre_attn_scalar=12,
            layer_types=["sliding_attention", "full_attention"] * (num_layers // 2) + ["sliding_attention"] * (num_layers % 2),
        )
    raise ValueError(arch)


def tiny_model(arch: str, seed: int = 0, **kwargs):
    torch.manual_seed(seed)
    config = tiny_config(arch, **kwargs)
    config._attn_implementation = "eager"
    model = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)](config).eval()
    with torch.no_grad():  # zero-initialised norms/biases would hide bugs: randomise them
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model


def tiny_tokenizer():
    """A character-level fast tokenizer (ids 4.. are printable ASCII and newline), no downloads."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {"<pad>": 0, "</s>": 1, "<s>": 2, "<unk>": 3, **{ch: i + 4 for i, ch in enumerate(chars)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", bos_token="<s>", unk_token="<unk>"
    )


def save_tiny_source(arch: str, path, **kwargs):
    """A tiny checkpoint folder (weights + tokenizer) usable as a conversion SOURCE."""
    model = tiny_model(arch, **kwargs)
    model.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return model
