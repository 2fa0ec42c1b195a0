"""Real English text for calibration and held-out evaluation.

The only sizeable English text guaranteed to be reachable on our machines
(package registries only, no general network) comes from Debian packages, so
every named corpus is one Debian package, fetched with ``apt-get download``
(``apt-get update`` once on failure), unpacked with ``dpkg -x`` and laid out
as plain split directories. Two corpora of different domains are registered in
``CORPORA``:

``python-docs`` -- package ``python3.11-doc``: the reStructuredText sources of
the Python documentation (~11 MB of ``*.rst.txt`` files under
``usr/share/doc/python3.11/html/_sources/``). Technical prose and code.

* ``"python-docs:calib"``   -- everything under ``_sources`` except ``library/``
  (tutorial, reference, howto, c-api, whatsnew, faq, ...). It is materialised
  as its own directory of hard links at extraction time, so that every
  consumer can treat a split as a plain directory and ``list_text_files``
  needs no exclusion rules.
* ``"python-docs:heldout"`` -- ``_sources/library`` (the standard library reference).

``fortunes`` -- package ``fortunes`` (the fortune-mod data files): English
quotations, verse, jokes, aphorisms and definitions, i.e. another domain and
register than the docs (literary and conversational, not technical), for
checking that a result is not specific to documentation text. Each topic file
``usr/share/games/fortunes/<topic>`` becomes ``<topic>.txt`` with its ``%``
separator lines turned into empty lines (entries are separated by blank lines),
decoded as UTF-8 with undecodable bytes replaced. The ``.dat`` indexes and
``.u8`` symlinks are ignored, and so are the topics that are ASCII art or about
computing (``FORTUNES_EXCLUDED``: art, ascii-art, computers, debian, linux,
linuxcookie, perl, translate-me).

* ``"fortunes:heldout"`` -- topics ``FORTUNES_HELDOUT``: people, politics,
  songs-poems, wisdom, humorists, law, science (quotations by and about
  people, political and legal quips, songs and poems, proverbs, humorists'
  lines, sayings about science): whole topics, so that held-out entries share
  no topic file with calibration, chosen to mix the three registers (quotation,
  verse, joke); about 40% of the kept text.
* ``"fortunes:calib"``   -- every other kept topic (cookie, definitions,
  men-women, work, platitudes, zippy, startrek, tao, ...: 25 topics in
  fortunes 1:1.99.1-7.3).

Approximate sizes, measured by tokenizing each whole split (``read_text`` of
its directory, no special tokens) with the SmolLM2-135M tokenizer
(``resolve_alias("smollm2-135m")``); python3.11-doc 3.11.2-6+deb12u8,
fortunes 1:1.99.1-7.3:

=====================  =====  ==========  ==============
split                  files  characters  SmolLM2 tokens
=====================  =====  ==========  ==============
python-docs:calib        180   4.72 M      1.25 M
python-docs:heldout      317   6.33 M      1.61 M
fortunes:calib            25   1.21 M      338 K
fortunes:heldout           7   0.79 M      215 K
=====================  =====  ==========  ==============

Splits are disjoint by construction (checked by the tests).

Cache layout (``cache_dir()`` is ``$HF_CSA2_CACHE`` or ``~/.cache/hf_csa2``)::

    cache_dir()/corpus/<package>_<version>_all.deb   # downloaded package
    cache_dir()/corpus/python3.11-doc/
        SOURCE          # name of the .deb the tree was extracted from
        _sources/       # python_docs_root(): every .rst.txt of the docs
        calib/          # corpus_split("calib"): _sources minus library/ (hard links)
    cache_dir()/corpus/fortunes/
        SOURCE
        calib/<topic>.txt
        heldout/<topic>.txt

Each tree is built in a temporary directory and published with one rename, so
readers see either no corpus or a complete one.

Anything that accepts text takes a *spec* (see ``resolve_text``): either a
path to a file/directory of your own text, or one of ``NAMED_CORPORA``
(``"python-docs:calib"``, ``"python-docs:heldout"``, ``"fortunes:calib"``,
``"fortunes:heldout"``).

Run ``python -m hf_csa2.data.corpus`` to fetch every corpus and print the paths.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..cache import cache_dir
from ..errors import UserError

TEXT_SUFFIXES = (".txt", ".rst", ".md")
SPLITS = ("calib", "heldout")

# Python docs (python3.11-doc).
PACKAGE = "python3.11-doc"
_SOURCES_IN_DEB = Path("usr/share/doc/python3.11/html/_sources")
HELDOUT_SUBDIR = "library"
NAMED_PREFIX = "python-docs"

# fortune-mod data (fortunes).
_FORTUNES_IN_DEB = Path("usr/share/games/fortunes")
FORTUNES_EXCLUDED = frozenset(
    {"art", "ascii-art", "computers", "debian", "linux", "linuxcookie", "perl", "translate-me"}
)
FORTUNES_HELDOUT = frozenset(
    {"people", "politics", "songs-poems", "wisdom", "humorists", "law", "science"}
)

# Distinct exit status of ``python -m hf_csa2.data.corpus`` when a corpus is
# merely unavailable (as opposed to a crash), so scripts can tell them apart.
EXIT_UNAVAILABLE = 3

_HOW_TO_BYPASS = (
    "To use your own text instead, pass a file or directory of .txt/.rst/.md "
    "files (e.g. --text DIR)."
)


class CorpusError(UserError, RuntimeError):
    """The requested text could not be found, fetched or understood."""


@dataclass(frozen=True)
class NamedCorpus:
    """How one named corpus is made from one Debian package.

    ``layout(corpus, raw, staged)`` turns the ``dpkg -x`` tree ``raw`` into the
    split directories under ``staged`` (the future ``home()``), raising
    ``CorpusError`` when the package does not look as expected. The split rule
    is data: ``heldout`` names what goes to the held-out split (top-level
    ``_sources`` subdirectories, or fortune topics), ``excluded`` what is
    dropped altogether; everything else is calibration text.
    """

    name: str  # prefix of the specs: "<name>:<split>"
    package: str  # Debian package, fetched with `apt-get download`
    layout: Callable[[NamedCorpus, Path, Path], None]
    split_dirs: tuple[tuple[str, str], ...]  # (split, directory relative to home())
    heldout: frozenset[str]
    excluded: frozenset[str] = frozenset()
    rule: str = ""  # one-line description of the split rule

    @property
    def splits(self) -> tuple[str, ...]:
        return tuple(s for s, _ in self.split_dirs)

    @property
    def specs(self) -> tuple[str, ...]:
        return tuple(f"{self.name}:{s}" for s in self.splits)

    def home(self) -> Path:
        """Where the extracted tree lives (whether or not it exists yet)."""
        return cache_dir() / "corpus" / self.package

    def split_path(self, split: str) -> Path:
        """Directory of ``split`` inside ``home()`` (no fetching, no checks)."""
        return self.home() / dict(self.split_dirs)[split]


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:  # filesystems without hard links
        shutil.copy2(src, dst)


def _layout_python_docs(corpus: NamedCorpus, raw: Path, staged: Path) -> None:
    src = raw / _SOURCES_IN_DEB
    for sub in sorted(corpus.heldout):
        if not (src / sub).is_dir():
            raise CorpusError(f"does not contain {_SOURCES_IN_DEB}/{sub}/")
    os.replace(src, staged / "_sources")
    shutil.copytree(
        staged / "_sources",
        staged / "calib",
        ignore=lambda d, names: (
            [n for n in names if n in corpus.heldout] if Path(d) == staged / "_sources" else []
        ),
        copy_function=_link_or_copy,
    )


def fortune_to_text(data: bytes) -> str:
    """One fortune topic file as plain text: UTF-8 (errors replaced), every
    ``%`` separator line replaced by an empty line, no leading/trailing blank
    lines, one final newline (``""`` if the file holds no entry)."""
    text = data.decode("utf-8", errors="replace")
    lines = ["" if line.strip() == "%" else line for line in text.split("\n")]
    body = "\n".join(lines).strip("\n")
    return body + "\n" if body.strip() else ""


def _layout_fortunes(corpus: NamedCorpus, raw: Path, staged: Path) -> None:
    src = raw / _FORTUNES_IN_DEB
    if not src.is_dir():
        raise CorpusError(f"does not contain {_FORTUNES_IN_DEB}/")
    topics: dict[str, str] = {}
    for name in sorted(os.listdir(src)):
        p = src / name
        # Topics have no extension; skip the .dat indexes, .u8 symlinks and anything odd.
        if "." in name or p.is_symlink() or not p.is_file() or name in corpus.excluded:
            continue
        text = fortune_to_text(p.read_bytes())
        if text:
            topics[name] = text
    missing = sorted(corpus.heldout - topics.keys())
    if missing:
        raise CorpusError(f"lacks the held-out fortune topics {', '.join(missing)} in {_FORTUNES_IN_DEB}/")
    if not topics.keys() - corpus.heldout:
        raise CorpusError(f"has no calibration topics in {_FORTUNES_IN_DEB}/")
    for split in SPLITS:
        (staged / split).mkdir()
    for topic, text in topics.items():
        split = "heldout" if topic in corpus.heldout else "calib"
        (staged / split / f"{topic}.txt").write_text(text, encoding="utf-8")


CORPORA: dict[str, NamedCorpus] = {
    c.name: c
    for c in (
        NamedCorpus(
            name=NAMED_PREFIX,
            package=PACKAGE,
            layout=_layout_python_docs,
            split_dirs=(("calib", "calib"), ("heldout", f"_sources/{HELDOUT_SUBDIR}")),
            heldout=frozenset({HELDOUT_SUBDIR}),
            rule="heldout = _sources/library (stdlib reference); calib = the rest of _sources",
        ),
        NamedCorpus(
            name="fortunes",
            package="fortunes",
            layout=_layout_fortunes,
            split_dirs=(("calib", "calib"), ("heldout", "heldout")),
            heldout=FORTUNES_HELDOUT,
            excluded=FORTUNES_EXCLUDED,
            rule=(
                f"heldout = topics {', '.join(sorted(FORTUNES_HELDOUT))}; calib = every other "
                f"topic except {', '.join(sorted(FORTUNES_EXCLUDED))}"
            ),
        ),
    )
}
NAMED_CORPORA = tuple(spec for c in CORPORA.values() for spec in c.specs)

# Fetch failures per corpus location, remembered for the life of the process:
# offline, `apt-get update` can take minutes to time out, and test suites ask
# for the corpus many times.
_FETCH_FAILURES: dict[Path, CorpusError] = {}
# Result of the one `apt-get update` a process runs (empty: not run yet), so a
# second package that fails to download does not wait for it again.
_APT_UPDATE: list[subprocess.CompletedProcess] = []


def _find_deb(package: str) -> Path | None:
    # The deb may sit directly in cache_dir() (pre-seeded copies) or in
    # cache_dir()/corpus (where we download it). Newest version wins.
    cands: list[str] = []
    for d in (cache_dir() / "corpus", cache_dir()):
        cands += glob.glob(str(d / f"{glob.escape(package)}_*_all.deb"))
    if not cands:
        return None
    return Path(sorted(cands, key=lambda p: Path(p).name)[-1])


def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    except FileNotFoundError as e:  # tool missing (non-Debian machine)
        return subprocess.CompletedProcess(cmd, 127, "", str(e))


def _apt_update(cwd: Path) -> subprocess.CompletedProcess:
    if not _APT_UPDATE:
        _APT_UPDATE.append(_run(["apt-get", "update"], cwd))
    return _APT_UPDATE[0]


def _download_deb(package: str) -> Path:
    dest_dir = cache_dir() / "corpus"
    dest_dir.mkdir(parents=True, exist_ok=True)
    # Download into a private temp dir: apt-get writes the file in place, and a
    # concurrent or interrupted download must never look like a finished .deb.
    with tempfile.TemporaryDirectory(dir=dest_dir, prefix=".download-") as tmp:
        res = _run(["apt-get", "download", package], Path(tmp))
        if res.returncode != 0:
            # Fresh machines have empty package lists; refresh once and retry.
            upd = _apt_update(Path(tmp))
            res = _run(["apt-get", "download", package], Path(tmp))
            if res.returncode != 0:
                raise CorpusError(
                    f"could not download Debian package {package!r} "
                    f"(`apt-get download {package}` failed: "
                    f"{(res.stderr or res.stdout).strip()[-500:]!r}; "
                    f"`apt-get update` exit status {upd.returncode}). "
                    f"Alternatively place a {package}_*_all.deb in {dest_dir}. "
                    + _HOW_TO_BYPASS
                )
        debs = sorted(Path(tmp).glob(f"{glob.escape(package)}_*_all.deb"))
        if not debs:
            raise CorpusError(
                f"`apt-get download {package}` succeeded but produced no .deb. "
                + _HOW_TO_BYPASS
            )
        final = dest_dir / debs[-1].name
        os.replace(debs[-1], final)
        return final


def _is_complete(corpus: NamedCorpus) -> bool:
    return all(corpus.split_path(s).is_dir() for s in corpus.splits)


def _extract(corpus: NamedCorpus, deb: Path) -> Path:
    home = corpus.home()
    home.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=home.parent, prefix=f".{corpus.package}-tmp-"))
    try:
        raw = tmp / "raw"
        res = _run(["dpkg", "-x", str(deb), str(raw)], tmp)
        if res.returncode != 0:
            raise CorpusError(
                f"could not extract {deb} with `dpkg -x` "
                f"({(res.stderr or res.stdout).strip()[-500:]!r}). " + _HOW_TO_BYPASS
            )
        staged = tmp / "final"
        staged.mkdir()
        try:
            corpus.layout(corpus, raw, staged)
        except CorpusError as e:
            raise CorpusError(f"{deb} {e}. " + _HOW_TO_BYPASS) from None
        (staged / "SOURCE").write_text(deb.name + "\n")
        # Atomic publish: readers see either no corpus or a complete one.
        try:
            os.rename(staged, home)
        except OSError:
            if not _is_complete(corpus):
                raise
            # Another process won the race with an equivalent tree; keep theirs.
        return home
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _get(name: str) -> NamedCorpus:
    corpus = CORPORA.get(name)
    if corpus is None:
        raise CorpusError(
            f"unknown corpus {name!r}; allowed: {', '.join(NAMED_CORPORA)}. " + _HOW_TO_BYPASS
        )
    return corpus


def corpus_home(name: str, fetch: bool = True) -> Path:
    """The extracted tree of the named corpus (see ``CORPORA``), fetching it if needed.

    With ``fetch=False`` only an already-extracted cache is accepted. Raises
    ``CorpusError`` (with a hint on passing your own text) if unavailable; a
    failed fetch is not retried within the same process.
    """
    corpus = _get(name)
    home = corpus.home()
    if _is_complete(corpus):
        return home
    if not fetch:
        raise CorpusError(
            f"{corpus.name} corpus (Debian package {corpus.package}) is not cached at {home} "
            "and fetching was disabled; run `python -m hf_csa2.data.corpus` "
            "(or scripts/fetch_fixtures.sh). " + _HOW_TO_BYPASS
        )
    if home.exists():
        # Only reachable if someone tampered with the published tree.
        raise CorpusError(
            f"{home} exists but is incomplete (missing "
            f"{', '.join(d + '/' for _, d in corpus.split_dirs)}); delete it and retry. "
            + _HOW_TO_BYPASS
        )
    if home in _FETCH_FAILURES:
        raise _FETCH_FAILURES[home]
    try:
        deb = _find_deb(corpus.package) or _download_deb(corpus.package)
        return _extract(corpus, deb)
    except CorpusError as err:
        _FETCH_FAILURES[home] = err
        raise


def python_docs_root(fetch: bool = True) -> Path:
    """Return the ``_sources`` directory of the Python 3.11 docs, fetching it if needed.

    With ``fetch=False`` only an already-extracted cache is accepted. Raises
    ``CorpusError`` (with a hint on passing your own text) if unavailable; a
    failed fetch is not retried within the same process.
    """
    return corpus_home(NAMED_PREFIX, fetch=fetch) / "_sources"


def named_split(name: str, split: str, fetch: bool = True) -> Path:
    """Directory holding one split of the named corpus ``name`` (a key of ``CORPORA``).

    Python docs: ``"calib"`` -> ``<cache>/corpus/python3.11-doc/calib`` (all
    of ``_sources`` except ``library/``, materialised as hard links);
    ``"heldout"`` -> ``<cache>/corpus/python3.11-doc/_sources/library``.
    Fortunes: ``<cache>/corpus/fortunes/calib`` and ``.../heldout``. All are
    plain directories, so ``list_text_files``/``read_text`` work on them directly.
    """
    corpus = _get(name)
    if split not in corpus.splits:
        raise CorpusError(f"unknown split {split!r}; allowed: {', '.join(corpus.splits)}")
    corpus_home(name, fetch=fetch)
    return corpus.split_path(split)


def corpus_split(split: str, fetch: bool = True, corpus: str = NAMED_PREFIX) -> Path:
    """``named_split(corpus, split)``; the corpus defaults to the Python docs."""
    return named_split(corpus, split, fetch=fetch)


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

    ``spec`` is one of ``NAMED_CORPORA`` (``"python-docs:calib"``,
    ``"fortunes:heldout"``, ...; fetched on demand, see ``named_split``) or a
    path to an existing file or directory. Anything of the form ``name:split``
    that is neither raises ``CorpusError`` listing the allowed corpus names.
    """
    s = os.fspath(spec)
    if s in NAMED_CORPORA:
        name, split = s.split(":", 1)
        return named_split(name, split)
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
    """Fetch every corpus; print each one's home and each split's path with its file count.

    Returns ``EXIT_UNAVAILABLE`` if any corpus could not be fetched (after trying all).
    """
    del argv
    unavailable = False
    for corpus in CORPORA.values():
        try:
            home = corpus_home(corpus.name, fetch=True)
            print(f"{corpus.name}\t{home}\t(Debian package {corpus.package})")
            for split, spec in zip(corpus.splits, corpus.specs):
                d = named_split(corpus.name, split)
                print(f"{spec}\t{d}\t{len(list_text_files(d))} files")
        except CorpusError as e:
            print(f"corpus {corpus.name} unavailable: {e}", file=sys.stderr)
            unavailable = True
    return EXIT_UNAVAILABLE if unavailable else 0


if __name__ == "__main__":
    sys.exit(main())
