import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Triton's CPU interpreter for the kernel tests. Triton decides interpreted vs compiled when a
# function is decorated, its own tl.* helpers included, at its first import -- which other test
# modules' imports (lm-eval, transformers) may trigger during collection: set it before any.
if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct (dequantised from its GGUF), loaded once."""
    from hf_csa2.io.sources import SourceError, load_source, resolve_alias

    try:
        resolve_alias("smollm2-135m")
    except SourceError as err:  # only a failed fetch skips; a failed load is a bug
        pytest.skip(f"SmolLM2 checkpoint cannot be fetched (offline?): {err}")
    return load_source("smollm2-135m")
