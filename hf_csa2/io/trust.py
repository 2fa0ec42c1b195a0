"""Which code a model folder may make us run.

transformers runs Python files shipped in a folder when its ``config.json`` or
``tokenizer_config.json`` names them in ``auto_map`` and the caller passes
``trust_remote_code=True``. hf-csa2 never passes it on its own: converted checkpoints load
through the classes ``import hf_csa2`` registered (the copy of the model code saved next to
their weights is for machines without hf-csa2 and is not run here), and tokenizers load
without it. A folder that asks for any other code is refused before anything is loaded,
unless the user explicitly trusts it (``--trust-remote-code``).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ..model import Csa2Config, Csa2ForCausalLM

#: What a checkpoint written by hf-csa2 names in its config's auto_map.
OUR_AUTO_MAP = {
    "AutoConfig": f"{Csa2Config.__module__.rsplit('.', 1)[-1]}.{Csa2Config.__name__}",
    "AutoModelForCausalLM": f"{Csa2ForCausalLM.__module__.rsplit('.', 1)[-1]}.{Csa2ForCausalLM.__name__}",
}
MODEL_CODE_DIR = Path(__file__).resolve().parents[1] / "model"

# Files of a folder whose ``auto_map`` transformers reads when loading a model or tokenizer.
_AUTO_MAP_FILES = ("config.json", "tokenizer_config.json", "processor_config.json", "preprocessor_config.json")


def _json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}  # unreadable files are reported by the loader that needs them


def _refs(value) -> list[str]:
    """Class references in an auto_map value: a string, or a [slow, fast] pair (tokenizers)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, (list, tuple)):
        return [ref for item in value for ref in _refs(item)]
    if isinstance(value, dict):
        return [ref for item in value.values() for ref in _refs(item)]
    return []


def foreign_code(folder: str | Path) -> list[str]:
    """Code the folder asks transformers to run that is not hf-csa2's own model classes:
    one ``"file: AutoClass -> module.Class"`` line each (empty list: nothing foreign).

    Our classes are accepted only in the config.json of an hf_csa2 checkpoint; any other
    auto_map entry (in any shape), and a ``custom_generate/`` folder, is foreign."""
    folder = Path(folder)
    found = []
    for name in _AUTO_MAP_FILES:
        data = _json(folder / name)
        if not isinstance(data, dict) or "auto_map" not in data:
            continue
        ours = name == "config.json" and data.get("model_type") == Csa2Config.model_type
        auto_map = data["auto_map"]
        items = auto_map.items() if isinstance(auto_map, dict) else [("auto_map", auto_map)]
        for auto_class, value in items:
            for ref in _refs(value):
                if ours and OUR_AUTO_MAP.get(auto_class) == ref:
                    continue
                found.append(f"{name}: {auto_class} -> {ref}")
    if (folder / "custom_generate").is_dir():
        found.append("custom_generate/ (a generate() replacement)")
    return list(dict.fromkeys(found))


def changed_model_code(folder: str | Path) -> list[str]:
    """Our model files whose copy in ``folder`` differs from the installed package's (a folder
    written by another hf-csa2 version, or edited). They are never run by hf-csa2."""
    folder = Path(folder)
    changed = []
    for ours in sorted(MODEL_CODE_DIR.glob("*.py")):
        copy = folder / ours.name
        if copy.is_file() and copy.read_bytes() != ours.read_bytes():
            changed.append(ours.name)
    return changed


#: Written beside copied model code at save time: {"files": {name: sha256}}; a folder is
#: published only while its code still hashes to it (:func:`model_code_problems`).
CODE_MANIFEST = "hf_csa2_code.json"


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_code_manifest(folder: str | Path) -> Path | None:
    """Record the sha256 of every ``*.py`` file in ``folder`` (the model code ``save_pretrained``
    copied); nothing is written when there is none (a native checkpoint)."""
    folder = Path(folder)
    files = {p.name: _sha256(p) for p in sorted(folder.glob("*.py"))}
    if not files:
        return None
    path = folder / CODE_MANIFEST
    path.write_text(json.dumps({"files": files}, indent=1))
    return path


def model_code_problems(folder: str | Path) -> list[str]:
    """Why the Python files of ``folder`` may not be published: files changed since they were
    saved (against :data:`CODE_MANIFEST`), files that are not hf-csa2's model code, files that
    differ from the installed package's, or a manifest naming files that are gone."""
    folder = Path(folder)
    code = {p.name: p for p in sorted(folder.glob("*.py"))}
    manifest = _json(folder / CODE_MANIFEST).get("files") if (folder / CODE_MANIFEST).is_file() else None
    problems = []
    if not isinstance(manifest, dict):  # saved before manifests existed: the package comparison below decides
        manifest = None
    if manifest is not None:
        edited = [n for n, p in code.items() if n in manifest and manifest[n] != _sha256(p)]
        missing = [n for n in manifest if n not in code]
        if edited:
            problems.append(f"model code edited after it was saved: {', '.join(edited)}")
        if missing:
            problems.append(f"model code listed in {CODE_MANIFEST} is missing: {', '.join(missing)}")
    package = {p.name for p in MODEL_CODE_DIR.glob("*.py")}
    foreign = [n for n in code if n not in package]
    if foreign:
        problems.append(f"Python files that are not hf-csa2 model code: {', '.join(foreign)}")
    changed = [n for n in changed_model_code(folder) if manifest is None or n not in manifest
               or manifest[n] == _sha256(code[n])]
    if changed:
        problems.append(f"model code differs from the installed hf-csa2's ({', '.join(changed)}): the folder was "
                        "written by another version; load and save it again with this one")
    return problems


__all__ = ["CODE_MANIFEST", "OUR_AUTO_MAP", "changed_model_code", "foreign_code", "model_code_problems",
           "write_code_manifest"]
