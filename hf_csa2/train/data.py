"""Training data through the ``datasets`` library: load, render chat records, tokenise, pack into
fixed-length blocks; every step is cached on disk by ``datasets`` (fingerprinted ``map`` calls), so
a second run of the same recipe starts at once.
"""

from __future__ import annotations

import json
from pathlib import Path

import datasets

from ..cache import cache_dir
from ..data.corpus import list_text_files, resolve_text
from .recipe import DataSpec, RecipeError

TEXT_COLUMNS = ("text", "messages", "input_ids")


def _dataset_cache() -> str:
    return str(cache_dir() / "datasets")


def _is_saved_dataset(path: Path) -> bool:
    return path.is_dir() and ((path / "dataset_info.json").is_file() or (path / "state.json").is_file()
                              or (path / "dataset_dict.json").is_file())


def load_records(text: str) -> datasets.Dataset:
    """The raw records of ``data.text``: a ``text`` column (plain text, one record per file), a
    ``messages`` column (chat records) or ``input_ids`` (already tokenised)."""
    path = Path(text).expanduser()
    if _is_saved_dataset(path):
        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            if "train" not in ds:
                raise RecipeError(f"data.text={text!r} is a DatasetDict without a 'train' split (it has {list(ds)})")
            ds = ds["train"]
    elif path.suffix == ".jsonl" and path.is_file():
        ds = datasets.load_dataset("json", data_files=str(path), split="train", cache_dir=_dataset_cache())
    else:
        files = [str(f) for f in list_text_files(resolve_text(text))]
        if not files:
            raise RecipeError(f"data.text={text!r} holds no text files (.txt, .rst, .md)")
        ds = datasets.load_dataset("text", data_files=files, sample_by="document", split="train",
                                   cache_dir=_dataset_cache())
    if not any(c in ds.column_names for c in TEXT_COLUMNS):
        raise RecipeError(f"data.text={text!r} has the columns {ds.column_names}; allowed: one of "
                          f"{', '.join(TEXT_COLUMNS)} (text, chat records {{\"messages\": [...]}}, or token ids)")
    return ds


def _renderer(tokenizer, chat_template: bool):
    def render(batch: dict) -> dict:
        if "input_ids" in batch:
            return {"input_ids": batch["input_ids"]}
        if "messages" in batch:
            if not chat_template or not getattr(tokenizer, "chat_template", None):
                texts = ["\n\n".join(f"{m['role']}: {m['content']}" for m in msgs) for msgs in batch["messages"]]
            else:
                texts = [tokenizer.apply_chat_template(msgs, tokenize=False) for msgs in batch["messages"]]
        else:
            texts = batch["text"]
        ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
        eos = tokenizer.eos_token_id
        return {"input_ids": [x + [eos] if eos is not None else x for x in ids]}

    return render


def _packer(seq_len: int):
    def pack(batch: dict) -> dict:
        stream = [t for ids in batch["input_ids"] for t in ids]
        n = len(stream) // seq_len
        return {"input_ids": [stream[i * seq_len:(i + 1) * seq_len] for i in range(n)]}

    return pack


def training_blocks(spec: DataSpec, tokenizer) -> datasets.Dataset:
    """``[N]`` records with ``input_ids`` of exactly ``spec.seq_len`` tokens: documents in order,
    each followed by EOS, concatenated and cut (the last partial block of each 1,000 documents is
    dropped). At most ``spec.num_tokens`` tokens (whole blocks)."""
    ds = load_records(spec.text)
    ds = ds.map(_renderer(tokenizer, spec.chat_template), batched=True, remove_columns=ds.column_names,
                desc="tokenising")
    ds = ds.map(_packer(spec.seq_len), batched=True, batch_size=1000, desc=f"packing into {spec.seq_len}-token blocks")
    if len(ds) == 0:
        raise RecipeError(f"data.text={spec.text!r} has fewer than data.seq_len={spec.seq_len} tokens")
    if spec.num_tokens is not None:
        ds = ds.select(range(min(len(ds), max(1, spec.num_tokens // spec.seq_len))))
    return ds.with_format("torch")


def write_chat_jsonl(records: list[list[dict]], path: str | Path) -> Path:
    """Chat records (lists of ``{"role", "content"}``) as JSONL, the format ``data.text`` reads."""
    path = Path(path)
    with path.open("w") as f:
        for msgs in records:
            f.write(json.dumps({"messages": msgs}, ensure_ascii=False) + "\n")
    return path


__all__ = ["load_records", "training_blocks", "write_chat_jsonl"]
