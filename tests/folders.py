"""Folder fingerprints for tests that check an input or output folder was not touched."""

import hashlib
from pathlib import Path


def tree_digest(folder: Path) -> str:
    """sha256 over every file's relative path and bytes, in sorted order."""
    h = hashlib.sha256()
    for p in sorted(Path(folder).rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(folder)).encode())
            h.update(p.read_bytes())
    return h.hexdigest()
