"""What a folder must be before it is published, checked before any network call.

* weights are safetensors only: no pickled files (``.bin``, ``.pt``, ``.pkl``, ...), whatever
  ``--include`` says;
* the model code copied next to the weights is what was saved (its hashes) and what the
  installed hf-csa2 ships; no code of anyone else is named in an ``auto_map``;
* config and tokenizer load;
* nothing stray (training checkpoints, logs, caches): only the files a checkpoint or adapter
  consists of, plus what ``--include`` names;
* the file set that would be uploaded loads and runs a short forward with
  ``trust_remote_code=True`` in a subprocess where ``import hf_csa2`` fails.

Every problem found is listed in one :class:`PublishError`.
"""

from __future__ import annotations

import fnmatch
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UserError, one_line
from ..io.output import OUTPUT_MARKER
from ..io.trust import CODE_MANIFEST, foreign_code, model_code_problems
from .card import ADAPTER_CONFIG, CARD_FILE, folder_kind

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle", ".joblib", ".h5", ".msgpack", ".npy", ".npz")
#: Top-level files a published checkpoint folder may hold (the card, README.md, is generated).
CHECKPOINT_FILES = ("config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
                    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                    "vocab.json", "merges.txt", "tokenizer.model", "*.tiktoken", "chat_template.jinja",
                    "chat_template.json", "*.py", CODE_MANIFEST, OUTPUT_MARKER, "hf_csa2_plan.yaml")
#: Top-level files a published PEFT adapter folder may hold.
ADAPTER_FILES = (ADAPTER_CONFIG, "adapter_model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "chat_template.jinja")


class PublishError(UserError, ValueError):
    """The folder cannot be published as it is; the message lists every problem found."""


@dataclass
class PublishSet:
    """The files of ``folder`` to upload (relative POSIX paths) and their sizes in bytes."""

    folder: Path
    kind: str
    files: list[str] = field(default_factory=list)
    sizes: dict[str, int] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return sum(self.sizes.values())


def _matches(name: str, patterns) -> bool:
    return any(fnmatch.fnmatch(name, p) for p in patterns)


def select_files(folder: Path, kind: str, include: tuple[str, ...] = ()) -> tuple[PublishSet, list[str]]:
    """The files to publish and the problems of the file set (pickles, stray files, missing parts)."""
    allowed = CHECKPOINT_FILES if kind == "checkpoint" else ADAPTER_FILES
    chosen, pickles, stray = PublishSet(folder, kind), [], []
    for path in sorted(folder.rglob("*")):
        if not path.is_file():
            continue
        rel = path.relative_to(folder).as_posix()
        if path.suffix.lower() in PICKLE_SUFFIXES:
            pickles.append(rel)
        elif rel == CARD_FILE:
            continue  # replaced by the generated card
        elif ("/" not in rel and _matches(rel, allowed)) or _matches(rel, include):
            chosen.files.append(rel)
            chosen.sizes[rel] = path.stat().st_size
        else:
            top = rel.split("/")[0]
            stray.append(top + "/" if "/" in rel else rel)
    problems = []
    if pickles:
        problems.append(f"pickled files are never published, safetensors only: {', '.join(pickles)}")
    if stray:
        problems.append(f"stray files: {', '.join(dict.fromkeys(stray))} (allowed: the files of a "
                        f"{kind}; --include PATTERN publishes others)")
    if kind == "checkpoint":
        if "config.json" not in chosen.files:
            problems.append("no config.json")
        if not any(f.endswith(".safetensors") for f in chosen.files):
            problems.append("no *.safetensors weights")
    elif "adapter_model.safetensors" not in chosen.files:
        problems.append("no adapter_model.safetensors")
    return chosen, problems


def static_problems(folder: Path, kind: str) -> list[str]:
    """Problems found without running the folder's code: model code, foreign code, config and tokenizer."""
    problems = [*model_code_problems(folder)]
    foreign = foreign_code(folder)
    if foreign:
        problems.append(f"the folder asks transformers to run code that is not hf-csa2's: {'; '.join(foreign)}")
        return problems  # loading the config or tokenizer could run it
    if kind == "adapter":
        try:
            from peft import PeftConfig

            PeftConfig.from_pretrained(str(folder))
        except Exception as err:  # any reason: the user sees it in the list
            problems.append(f"{ADAPTER_CONFIG} does not load: {one_line(err, 300)}")
        return problems
    from transformers import AutoConfig, AutoTokenizer  # hf_csa2's config class is registered: no folder code runs

    try:
        AutoConfig.from_pretrained(folder)
    except Exception as err:
        problems.append(f"config.json does not load: {one_line(err, 300)}")
    try:
        AutoTokenizer.from_pretrained(folder)
    except Exception as err:
        problems.append(f"no tokenizer loads from the folder: {one_line(err, 300)}")
    return problems


# Runs in a fresh interpreter where ``import hf_csa2`` fails: loads the staged file set the way a
# user of the Hub would (remote code) and runs a short forward (and the adapter, for adapters).
_LOAD_CHECK = textwrap.dedent(
    """
    import sys, torch
    sys.modules["hf_csa2"] = None
    from transformers import AutoModelForCausalLM
    folder, kind, base = sys.argv[1], sys.argv[2], sys.argv[3]
    if kind == "adapter":
        from peft import PeftModel
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, trust_remote_code=True), folder)
    else:
        model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
    vocab = model.config.vocab_size
    x = torch.arange(3, 3 + 8).remainder(vocab)[None]
    with torch.no_grad():
        logits = model(x).logits
    assert logits.shape == (1, 8, vocab), logits.shape
    assert torch.isfinite(logits).all(), "non-finite logits"
    """
)


def load_problems(staged: Path, kind: str, base: str | None = None, timeout: float = 1800) -> list[str]:
    """Load ``staged`` with remote code only (``import hf_csa2`` fails) and run a forward; the
    problem, if any, as a one-line message."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["HF_MODULES_CACHE"] = str(staged.parent / "modules")
    env["HF_HUB_OFFLINE"] = "1"
    proc = subprocess.run([sys.executable, "-c", _LOAD_CHECK, str(staged), kind, base or ""], cwd=staged.parent,
                          env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode == 0:
        return []
    tail = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    return [f"the folder does not load and run without hf-csa2 (trust_remote_code=True): "
            f"{tail[-1] if tail else 'exit ' + str(proc.returncode)}"]


def check_folder(folder: str | os.PathLike, include: tuple[str, ...] = ()) -> tuple[PublishSet, list[str]]:
    """The publish set of ``folder`` and every problem found without running its code."""
    folder = Path(folder)
    if not folder.is_dir():
        raise PublishError(f"{str(folder)!r} is not a folder; give a checkpoint folder written by hf-csa2 convert, "
                           "export or train (merged/ or adapter/)")
    kind = folder_kind(folder)
    chosen, problems = select_files(folder, kind, include)
    return chosen, problems + static_problems(folder, kind)


__all__ = ["ADAPTER_FILES", "CHECKPOINT_FILES", "PICKLE_SUFFIXES", "PublishError", "PublishSet", "check_folder",
           "load_problems", "select_files", "static_problems"]
