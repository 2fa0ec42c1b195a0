"""Saving a checkpoint folder: model, tokenizer and our report files, written atomically."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable

from .output import OUTPUT_MARKER, check_output_dir, write_folder_atomically
from .trust import write_code_manifest


def save_checkpoint(model, tokenizer, out_dir: str | os.PathLike, *, overwrite: bool = False,
                    extra_files: dict[str, str] | None = None,
                    inputs: Iterable[tuple[str, str | os.PathLike]] = ()) -> Path:
    """Write an HF checkpoint (``save_pretrained`` of model and tokenizer, plus ``extra_files``
    {name: text}) into ``out_dir`` atomically; the output rules of :func:`check_output_dir`
    are checked again first (``inputs`` are the folders and files it must not touch).

    The folder always holds :data:`OUTPUT_MARKER` (the report; an empty one when
    ``extra_files`` has none), which marks it as written by hf-csa2, and, when ``save_pretrained``
    copied model code next to the weights, :data:`~.trust.CODE_MANIFEST` (the code files' hashes,
    checked again before the folder is published).
    """
    extra_files = {OUTPUT_MARKER: json.dumps({"stages": []}), **(extra_files or {})}
    check_output_dir(out_dir, overwrite=overwrite, inputs=inputs)

    def write(tmp: Path) -> None:
        model.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        for name, text in extra_files.items():
            (tmp / name).write_text(text)
        write_code_manifest(tmp)

    return write_folder_atomically(out_dir, write, overwrite=overwrite)


__all__ = ["save_checkpoint"]
