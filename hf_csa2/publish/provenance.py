"""Where a converted folder came from, as the Hub needs it for a model card: the source's Hub
repository (``base_model``) and its license.

A conversion report records the source as the user named it. Built-in aliases know their
repository and license; a Hub ID is its own repository (its license read from the local Hub
cache when the card is there); a folder's own README.md metadata gives its license, and a
folder inside the Hub cache (``models--org--name/snapshots/...``) its repository; a GGUF file
carries ``general.license``. Nothing here touches the network.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from ..io.output import OUTPUT_MARKER
from ..io.sources import ALIASES, looks_like_hub_id

_CACHE_REPO = re.compile(r"models--([^/]+)--([^/]+)")


@dataclass
class Provenance:
    """``base_model`` (a Hub ID or None when unknown), ``license`` (an identifier or None) and
    ``source`` (what the report recorded)."""

    base_model: str | None
    license: str | None
    source: str | None


def read_json(path: Path) -> dict:
    """A JSON object from ``path``; {} when the file is missing, unreadable or not an object."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _card_license(readme: Path) -> str | None:
    if not readme.is_file():
        return None
    from huggingface_hub import ModelCard

    try:
        return ModelCard.load(readme).data.license
    except Exception:  # a README without (valid) metadata: no license known
        return None


def _gguf_license(path: Path) -> str | None:
    try:
        from gguf import GGUFReader

        field = GGUFReader(str(path)).fields.get("general.license")
        return str(field.contents()) if field is not None else None
    except Exception:  # not readable as GGUF: the loader reports that, not the card
        return None


def _cached_card_license(repo_id: str) -> str | None:
    from huggingface_hub import try_to_load_from_cache

    path = try_to_load_from_cache(repo_id, "README.md")
    return _card_license(Path(path)) if isinstance(path, str) else None


def source_provenance(source: str | None) -> Provenance:
    """The Hub repository and license of a conversion's ``source`` (as its report recorded it)."""
    if not source:
        return Provenance(None, None, source)
    if source in ALIASES:
        alias = ALIASES[source]
        return Provenance(alias.hub_id, alias.license, source)
    path = Path(source).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return Provenance(None, _gguf_license(path), source)
    if path.is_dir():
        match = _CACHE_REPO.search(str(path.resolve()))
        hub_id = f"{match.group(1)}/{match.group(2)}" if match else None
        return Provenance(hub_id, _card_license(path / "README.md"), source)
    if looks_like_hub_id(source):
        return Provenance(source, _cached_card_license(source), source)
    return Provenance(None, None, source)


def folder_provenance(folder: Path) -> Provenance:
    """Provenance of a converted or uplifted folder: the source its report names; for a folder
    whose report names a converted folder as source (a conversion of a conversion), followed
    back to the original source."""
    report = read_json(folder / OUTPUT_MARKER)
    source = report.get("source")
    seen = {folder.resolve()}
    while isinstance(source, str) and Path(source).is_dir() and (Path(source) / OUTPUT_MARKER).is_file():
        step = Path(source).resolve()
        if step in seen:
            break
        seen.add(step)
        upstream = read_json(step / OUTPUT_MARKER).get("source")
        if not isinstance(upstream, str):
            break
        source = upstream
    return source_provenance(source if isinstance(source, str) else None)


__all__ = ["Provenance", "folder_provenance", "read_json", "source_provenance"]
