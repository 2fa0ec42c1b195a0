import shutil
import subprocess
from pathlib import Path

import pytest

from hf_csa2.data import corpus
from hf_csa2.data.corpus import (
    CorpusError,
    cache_dir,
    corpus_split,
    list_text_files,
    python_docs_root,
    read_text,
    resolve_text,
)


def _write(root: Path, rel: str, text: str) -> Path:
    p = root / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text, encoding="utf-8")
    return p


@pytest.fixture
def tree(tmp_path):
    root = tmp_path / "docs"
    # Created in scrambled order so filesystem order cannot masquerade as sorting.
    for rel, text in [
        ("zeta.md", "zeta"),
        ("b/inner.rst", "inner"),
        ("a.txt", "alpha"),
        ("b/a/deep.rst.txt", "deep"),
        ("a-b.txt", "dash"),
        ("notes.py", "not text"),
        ("img.png", "binary"),
        (".hidden.txt", "hidden"),
        (".git/config.txt", "hidden dir"),
    ]:
        _write(root, rel, text)
    return root


def test_list_text_files_sorted_filtered_deterministic(tree):
    files = list_text_files(tree)
    rels = [f.relative_to(tree).as_posix() for f in files]
    assert rels == ["a-b.txt", "a.txt", "b/a/deep.rst.txt", "b/inner.rst", "zeta.md"]
    assert list_text_files(tree) == files
    assert list_text_files(str(tree)) == files


def test_list_text_files_single_file_any_extension(tree):
    f = tree / "notes.py"
    assert list_text_files(f) == [f]


def test_list_text_files_missing_path(tmp_path):
    with pytest.raises(CorpusError, match="--text"):
        list_text_files(tmp_path / "nope")


def test_read_text_joins_in_sorted_order(tree):
    assert read_text(tree) == "dash\n\nalpha\n\ndeep\n\ninner\n\nzeta"


def test_read_text_max_chars_honoured(tree):
    full = read_text(tree)
    for n in [0, 1, 3, 4, 5, 6, 7, 10, len(full) - 1, len(full), len(full) + 100]:
        out = read_text(tree, max_chars=n)
        assert out == full[:n]
        assert len(out) <= n
    with pytest.raises(ValueError):
        read_text(tree, max_chars=-1)


def test_read_text_stops_opening_files(tree, monkeypatch):
    opened = []
    orig = Path.read_text

    def spy(self, *a, **k):
        opened.append(self.name)
        return orig(self, *a, **k)

    monkeypatch.setattr(Path, "read_text", spy)
    assert read_text(tree, max_chars=4) == "dash"
    assert opened == ["a-b.txt"]


def test_cache_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_CSA2_CACHE", str(tmp_path / "c"))
    assert cache_dir() == tmp_path / "c"
    monkeypatch.delenv("HF_CSA2_CACHE")
    assert cache_dir() == Path.home() / ".cache" / "hf_csa2"


@pytest.mark.parametrize("spec", ["python-docs:bogus", "wikitext:test", "python-docs"])
def test_unknown_corpus_lists_allowed(spec):
    with pytest.raises(CorpusError) as ei:
        resolve_text(spec)
    msg = str(ei.value)
    assert "python-docs:calib" in msg and "python-docs:heldout" in msg
    assert "--text" in msg


def test_unknown_split_lists_allowed():
    with pytest.raises(CorpusError, match="calib.*heldout"):
        corpus_split("train")


def test_resolve_text_paths(tree):
    assert resolve_text(tree) == tree
    assert resolve_text(str(tree / "a.txt")) == tree / "a.txt"


def test_no_fetch_when_not_cached(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_CSA2_CACHE", str(tmp_path))
    with pytest.raises(CorpusError, match="not cached"):
        python_docs_root(fetch=False)


def _leftovers(cache: Path) -> list[str]:
    return sorted(p.name for p in (cache / "corpus").iterdir() if p.name.startswith("."))


@pytest.mark.skipif(shutil.which("dpkg-deb") is None, reason="needs dpkg-deb to build a fake package")
def test_extraction_layout_from_local_deb(monkeypatch, tmp_path):
    # A tiny stand-in package exercises extraction/layout without any network.
    pkg = tmp_path / "pkg"
    src = pkg / "usr/share/doc/python3.11/html/_sources"
    _write(src, "tutorial/index.rst.txt", "tutorial")
    _write(src, "contents.rst.txt", "contents")
    _write(src, "library/os.rst.txt", "os module")
    (pkg / "DEBIAN").mkdir()
    (pkg / "DEBIAN/control").write_text(
        "Package: python3.11-doc\nVersion: 0.0-test\nArchitecture: all\n"
        "Maintainer: test <t@example.com>\nDescription: test\n"
    )
    cache = tmp_path / "cache"
    (cache / "corpus").mkdir(parents=True)
    deb = cache / "corpus" / "python3.11-doc_0.0-test_all.deb"
    subprocess.run(["dpkg-deb", "--build", str(pkg), str(deb)], check=True, capture_output=True)
    monkeypatch.setenv("HF_CSA2_CACHE", str(cache))

    root = python_docs_root(fetch=True)
    assert root == cache / "corpus" / "python3.11-doc" / "_sources"
    rel = lambda base, fs: [f.relative_to(base).as_posix() for f in fs]  # noqa: E731
    calib = corpus_split("calib")
    held = corpus_split("heldout")
    assert rel(calib, list_text_files(calib)) == ["contents.rst.txt", "tutorial/index.rst.txt"]
    assert rel(held, list_text_files(held)) == ["os.rst.txt"]
    assert (root.parent / "SOURCE").read_text().strip() == deb.name
    assert _leftovers(cache) == []
    # Second call is a pure cache hit.
    assert python_docs_root(fetch=False) == root


def test_failed_extraction_leaves_nothing(monkeypatch, tmp_path):
    cache = tmp_path / "cache"
    (cache / "corpus").mkdir(parents=True)
    (cache / "corpus" / "python3.11-doc_0.0-bad_all.deb").write_bytes(b"not a deb")
    monkeypatch.setenv("HF_CSA2_CACHE", str(cache))
    with pytest.raises(CorpusError, match="--text"):
        python_docs_root(fetch=True)
    assert not (cache / "corpus" / "python3.11-doc").exists()
    assert _leftovers(cache) == []
    with pytest.raises(CorpusError):  # remembered, not retried
        python_docs_root(fetch=True)


@pytest.fixture(scope="module")
def docs_root():
    try:
        return python_docs_root(fetch=True)
    except CorpusError as e:
        pytest.skip(f"Python docs corpus unavailable (run scripts/fetch_fixtures.sh): {e}")


@pytest.mark.real
def test_splits_disjoint_nonempty_and_cover_sources(docs_root):
    calib, held = corpus_split("calib"), corpus_split("heldout")
    calib_rel = {f.relative_to(calib).as_posix() for f in list_text_files(calib)}
    # heldout is _sources/library, so compare in _sources-relative terms.
    held_rel = {f.relative_to(docs_root).as_posix() for f in list_text_files(held)}
    all_rel = {f.relative_to(docs_root).as_posix() for f in list_text_files(docs_root)}
    assert len(calib_rel) > 50 and len(held_rel) > 50
    assert calib_rel.isdisjoint(held_rel)
    assert calib_rel | held_rel == all_rel
    assert not any(r.startswith(corpus.HELDOUT_SUBDIR + "/") for r in calib_rel)
    assert len(read_text(calib, max_chars=10_000)) == 10_000
    assert len(read_text(held, max_chars=10_000)) == 10_000


@pytest.mark.real
def test_named_specs_resolve_to_splits(docs_root):
    assert resolve_text("python-docs:calib") == corpus_split("calib")
    assert resolve_text("python-docs:heldout") == corpus_split("heldout")
