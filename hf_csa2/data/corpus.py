"""Real English text for calibration and held-out evaluation.

The only sizeable English text guaranteed to be reachable on our machines
(package registries only, no general network) is Debian's ``python3.11-doc``
package: the reStructuredText sources of the Python documentation (~11 MB of
``*.rst.txt`` files under ``usr/share/doc/python3.11/html/_sources/``).

Cache layout (``cache_dir()`` is ``$HF_CSA2_CACHE`` or ``~/.cache/hf_csa2``)::

    cache_dir()/corpus/python3.11-doc_<version>_all.deb   # downloaded package
    cache_dir()/corpus/python3.11-doc/
        SOURCE          # name of the .deb the tree was extracted from
        _sources/       # python_docs_root(): every .rst.txt of the docs
        calib/          # corpus_split("calib"): _sources minus library/ (hard links)

Splits (disjoint by construction, checked by the tests):

* ``"calib"``   -- everything under ``_sources`` except ``library/``
  (tutorial, reference, howto, c-api, whatsnew, faq, ...). It is materialised
  as its own directory of hard links at extraction time, so that every
  consumer can treat a split as a plain directory and ``list_text_files``
  needs no exclusion rules.
* ``"heldout"`` -- ``_sources/library`` (the standard library reference).

Anything that accepts text takes a *spec* (see ``resolve_text``): either a
path to a file/directory of your own text, or ``"python-docs:calib"`` /
``"python-docs:heldout"``.

Run ``python -m hf_csa2.data.corpus`` to fetch the corpus and print the paths.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from ..cache import cache_dir
from ..errors import UserError

PACKAGE = "python3.11-doc"
_SOURCES_IN_DEB = Path("usr/share/doc/python3.11/html/_sources")
HELDOUT_SUBDIR = "library"
TEXT_SUFFIXES = (".txt", ".rst", ".md")

NAMED_PREFIX = "python-docs"
SPLITS = ("calib", "heldout")
NAMED_CORPORA = tuple(f"{NAMED_PREFIX}:{s}" for s in SPLITS)

# Distinct exit status of ``python -m hf_csa2.data.corpus`` when the corpus is
# merely unavailable (as opposed to a crash), so scripts can tell them apart.
EXIT_UNAVAILABLE = 3

_HOW_TO_BYPASS = (
    "To use your own text instead, pass a file or directory of .txt/.rst/.md "
    "files (e.g. --text DIR)."
)


class CorpusError(UserError, RuntimeError):
    """The requested text could not be found, fetched or understood."""


# Fetch failures per cache location, remembered for the life of the process:
# offline, `apt-get update` can take minutes to time out, and test suites ask
# for the corpus many times.
_FETCH_FAILURES: dict[Path, CorpusError] = {}


def _corpus_home() -> Path:
    return cache_dir() / "corpus" / PACKAGE


def _find_deb() -> Path | None:
    # The deb may sit directly in cache_dir() (pre-seeded copies) or in
    # cache_dir()/corpus (where we download it). Newest version wins.
    cands: list[str] = []
    for d in (cache_dir() / "corpus", cache_dir()):
        cands += glob.glob(str(d / f"{PACKAGE}_*_all.deb"))
    if not cands:
        return None
    return Path(sorted(cands, key=lambda p: Path(p).name)[-1])


def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    except FileNotFoundError as e:  # tool missing (non-Debian machine)
        return subprocess.CompletedProcess(cmd, 127, "", str(e))


def _download_deb() -> Path:
    dest_dir = cache_dir() / "corpus"
    dest_dir.mkdir(parents=True, exist_ok=True)
    # Download into a private temp dir: apt-get writes the file in place, and a
    # concurrent or interrupted download must never look like a finished .deb.
    with tempfile.TemporaryDirectory(dir=dest_dir, prefix=".download-") as tmp:
        res = _run(["apt-get", "download", PACKAGE], Path(tmp))
        if res.returncode != 0:
            # Fresh machines have empty package lists; refresh once and retry.
            upd = _run(["apt-get", "update"], Path(tmp))
            res = _run(["apt-get", "download", PACKAGE], Path(tmp))
            if res.returncode != 0:
                raise CorpusError(
                    f"could not download Debian package {PACKAGE!r} "
                    f"(`apt-get download {PACKAGE}` failed: "
                    f"{(res.stderr or res.stdout).strip()[-500:]!r}; "
                    f"`apt-get update` exit status {upd.returncode}). "
                    f"Alternatively place a {PACKAGE}_*_all.deb in {dest_dir}. "
                    + _HOW_TO_BYPASS
                )
        debs = sorted(Path(tmp).glob(f"{PACKAGE}_*_all.deb"))
        if not debs:
            raise CorpusError(
                f"`apt-get download {PACKAGE}` succeeded but produced no .deb. "
                + _HOW_TO_BYPASS
            )
        final = dest_dir / debs[-1].name
        os.replace(debs[-1], final)
        return final


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:  # filesystems without hard links
        shutil.copy2(src, dst)


def _extract(deb: Path) -> Path:
    home = _corpus_home()
    home.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=home.parent, prefix=f".{PACKAGE}-tmp-"))
    try:
        raw = tmp / "raw"
        res = _run(["dpkg", "-x", str(deb), str(raw)], tmp)
        if res.returncode != 0:
            raise CorpusError(
                f"could not extract {deb} with `dpkg -x` "
                f"({(res.stderr or res.stdout).strip()[-500:]!r}). " + _HOW_TO_BYPASS
            )
        src = raw / _SOURCES_IN_DEB
        if not (src / HELDOUT_SUBDIR).is_dir():
            raise CorpusError(
                f"{deb} does not contain {_SOURCES_IN_DEB}/{HELDOUT_SUBDIR}/. "
                + _HOW_TO_BYPASS
            )
        staged = tmp / "final"
        staged.mkdir()
        os.replace(src, staged / "_sources")
        shutil.copytree(
            staged / "_sources",
            staged / "calib",
            ignore=lambda d, names: [HELDOUT_SUBDIR] if Path(d) == staged / "_sources" else [],
            copy_function=_link_or_copy,
        )
        (staged / "SOURCE").write_text(deb.name + "\n")
        # Atomic publish: readers see either no corpus or a complete one.
        try:
            os.rename(staged, home)
        except OSError:
            if not (home / "_sources").is_dir():
                raise
            # Another process won the race with an equivalent tree; keep theirs.
        return home / "_sources"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def python_docs_root(fetch: bool = True) -> Path:
    """Return the ``_sources`` directory of the Python 3.11 docs, fetching it if needed.

    With ``fetch=False`` only an already-extracted cache is accepted. Raises
    ``CorpusError`` (with a hint on passing your own text) if unavailable; a
    failed fetch is not retried within the same process.
    """
    home = _corpus_home()
    root = home / "_sources"
    if root.is_dir() and (home / "calib").is_dir():
        return root
    if not fetch:
        raise CorpusError(
            f"Python docs corpus is not cached at {home} and fetching was disabled; "
            "run `python -m hf_csa2.data.corpus` (or scripts/fetch_fixtures.sh). "
            + _HOW_TO_BYPASS
        )
    if home.exists():
        # Only reachable if someone tampered with the published tree.
        raise CorpusError(
            f"{home} exists but is incomplete (missing _sources/ or calib/); "
            "delete it and retry. " + _HOW_TO_BYPASS
        )
    if home in _FETCH_FAILURES:
        raise _FETCH_FAILURES[home]
    try:
        deb = _find_deb() or _download_deb()
        return _extract(deb)
    except CorpusError as err:
        _FETCH_FAILURES[home] = err
        raise


def corpus_split(split: str, fetch: bool = True) -> Path:
    """Directory holding one split of the Python docs corpus.

    ``"calib"`` -> ``<cache>/corpus/python3.11-doc/calib`` (all of ``_sources``
    except ``library/``, materialised as hard links); ``"heldout"`` ->
    ``<cache>/corpus/python3.11-doc/_sources/library``. Both are plain
    directories, so ``list_text_files``/``read_text`` work on them directly.
    """
    if split not in SPLITS:
        raise CorpusError(f"unknown split {split!r}; allowed: {', '.join(SPLITS)}")
    root = python_docs_root(fetch=fetch)
    return root.parent / "calib" if split == "calib" else root / HELDOUT_SUBDIR


def list_text_files(path: str | os.PathLike) -> list[Path]:
    """Text files under ``path``, in a deterministic order.

    A file is returned as ``[file]`` whatever its extension. A directory is
    walked recursively (symlinked directories are not followed, hidden
    files/directories are skipped) collecting ``*.txt``, ``*.rst`` and
    ``*.md`` files, sorted by their path components relative to ``path`` so
    the order is identical on every machine and filesystem.
    """
    p = Path(path)
    if p.is_file():
        return [p]
    if not p.is_dir():
        raise CorpusError(f"no such file or directory: {p}. " + _HOW_TO_BYPASS)
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(p):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for name in filenames:
            if not name.startswith(".") and name.endswith(TEXT_SUFFIXES):
                found.append(Path(dirpath) / name)
    return sorted(found, key=lambda f: f.relative_to(p).parts)


def read_text(path: str | os.PathLike, max_chars: int | None = None) -> str:
    """Concatenate ``list_text_files(path)`` with ``"\\n\\n"`` between files.

    Files are decoded as UTF-8 (undecodable bytes replaced, so the result never
    depends on locale). With ``max_chars`` the result is cut to at most that
    many characters, and files past that point are never opened.
    """
    if max_chars is not None and max_chars < 0:
        raise ValueError(f"max_chars must be >= 0, got {max_chars}")
    parts: list[str] = []
    total = 0
    for i, f in enumerate(list_text_files(path)):
        if max_chars is not None and total >= max_chars:
            break
        sep = "\n\n" if i else ""
        chunk = sep + f.read_text(encoding="utf-8", errors="replace")
        parts.append(chunk)
        total += len(chunk)
    text = "".join(parts)
    return text if max_chars is None else text[:max_chars]


def resolve_text(spec: str | os.PathLike) -> Path:
    """Turn a text spec into a path usable by ``list_text_files``/``read_text``.

    ``spec`` is ``"python-docs:calib"`` / ``"python-docs:heldout"`` (fetched on
    demand, see ``corpus_split``) or a path to an existing file or directory.
    Anything of the form ``name:split`` that is neither raises ``CorpusError``
    listing the allowed corpus names.
    """
    s = os.fspath(spec)
    if s in NAMED_CORPORA:
        return corpus_split(s.split(":", 1)[1])
    p = Path(s).expanduser()
    if p.exists():
        return p
    if ":" in s:
        raise CorpusError(
            f"unknown corpus {s!r}; allowed: {', '.join(NAMED_CORPORA)}, "
            "or a path to a file/directory. " + _HOW_TO_BYPASS
        )
    raise CorpusError(
        f"no such file or directory: {s!r} (named corpora: "
        f"{', '.join(NAMED_CORPORA)}). " + _HOW_TO_BYPASS
    )


def main(argv: list[str] | None = None) -> int:
    """Fetch the corpus and print ``root``/``calib``/``heldout`` paths with file counts."""
    del argv
    try:
        root = python_docs_root(fetch=True)
        print(f"root\t{root}\t{len(list_text_files(root))} files")
        for split in SPLITS:
            d = corpus_split(split)
            print(f"{split}\t{d}\t{len(list_text_files(d))} files")
    except CorpusError as e:
        print(f"corpus unavailable: {e}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    return 0


if __name__ == "__main__":
    sys.exit(main())
