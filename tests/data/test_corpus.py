import dataclasses
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from hf_csa2 import data
from hf_csa2.data import corpus
from hf_csa2.data.corpus import (
    CORPORA,
    FORTUNES_EXCLUDED,
    FORTUNES_HELDOUT,
    NAMED_CORPORA,
    CorpusError,
    cache_dir,
    corpus_split,
    fortune_to_text,
    list_text_files,
    named_split,
    python_docs_root,
    read_text,
    resolve_text,
)
from hf_csa2.data.windows import token_windows


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


@pytest.mark.parametrize(
    "spec", ["python-docs:bogus", "wikitext:test", "python-docs", "fortunes:bogus", "fortunes", "fortune:heldout"]
)
def test_unknown_corpus_lists_allowed(spec):
    with pytest.raises(CorpusError) as ei:
        resolve_text(spec)
    msg = str(ei.value)
    assert "python-docs:calib" in msg and "python-docs:heldout" in msg
    assert "fortunes:calib" in msg and "fortunes:heldout" in msg
    assert all(name in msg for name in NAMED_CORPORA)
    assert "--text" in msg


def test_unknown_corpus_name_in_api_lists_allowed():
    for call in (lambda: named_split("wikitext", "calib"), lambda: corpus_split("heldout", corpus="fortune")):
        with pytest.raises(CorpusError) as ei:
            call()
        assert all(name in str(ei.value) for name in NAMED_CORPORA), str(ei.value)
    with pytest.raises(CorpusError, match="calib.*heldout"):
        named_split("fortunes", "train")


def test_registry_describes_both_corpora():
    assert set(CORPORA) == {"python-docs", "fortunes"}
    assert set(NAMED_CORPORA) == {"python-docs:calib", "python-docs:heldout", "fortunes:calib", "fortunes:heldout"}
    assert NAMED_CORPORA == tuple(f"{n}:{s}" for n, c in CORPORA.items() for s in c.splits)
    assert len(set(NAMED_CORPORA)) == len(NAMED_CORPORA)
    fortunes = CORPORA["fortunes"]
    assert fortunes.package == "fortunes" and CORPORA["python-docs"].package == "python3.11-doc"
    assert fortunes.heldout == {"people", "politics", "songs-poems", "wisdom", "humorists", "law", "science"}
    assert fortunes.excluded == {
        "art", "ascii-art", "computers", "debian", "linux", "linuxcookie", "perl", "translate-me"
    }
    assert not fortunes.heldout & fortunes.excluded
    # Every corpus lives in its own cache directory, so fetch failures are remembered apart.
    assert len({c.home() for c in CORPORA.values()}) == len(CORPORA)
    with pytest.raises(dataclasses.FrozenInstanceError):
        fortunes.package = "fortunes-min"  # type: ignore[misc]
    # The lazy package-level re-exports see the same objects.
    assert data.NAMED_CORPORA is NAMED_CORPORA and data.CORPORA is CORPORA and data.named_split is named_split


@pytest.mark.parametrize(
    "raw, text",
    [
        (b"one\n%\ntwo\nlines\n%\n", "one\n\ntwo\nlines\n"),
        (b"%\nfirst\n%\nsecond\n", "first\n\nsecond\n"),  # leading separator (e.g. tao)
        (b"a\r\n%\r\nb", "a\r\n\nb\n"),  # CRLF separator line is a separator too
        (b"15% off\n%%\n100%\n%\n", "15% off\n%%\n100%\n"),  # only lone-% lines separate
        (b"caf\xc3\xa9 \xff\n%\n", "caf\u00e9 \ufffd\n"),  # UTF-8, bad bytes replaced
        (b"%\n%\n", ""),
    ],
)
def test_fortune_to_text(raw, text):
    assert fortune_to_text(raw) == text


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


needs_dpkg_deb = pytest.mark.skipif(shutil.which("dpkg-deb") is None, reason="needs dpkg-deb to build a fake package")


def _build_deb(pkg: Path, package: str, cache: Path) -> Path:
    """Build the tree ``pkg`` into ``cache/corpus/<package>_0.0-test_all.deb``."""
    (pkg / "DEBIAN").mkdir()
    (pkg / "DEBIAN/control").write_text(
        f"Package: {package}\nVersion: 0.0-test\nArchitecture: all\n"
        "Maintainer: test <t@example.com>\nDescription: test\n"
    )
    (cache / "corpus").mkdir(parents=True, exist_ok=True)
    deb = cache / "corpus" / f"{package}_0.0-test_all.deb"
    subprocess.run(["dpkg-deb", "--build", str(pkg), str(deb)], check=True, capture_output=True)
    return deb


@needs_dpkg_deb
def test_extraction_layout_from_local_deb(monkeypatch, tmp_path):
    # A tiny stand-in package exercises extraction/layout without any network.
    pkg = tmp_path / "pkg"
    src = pkg / "usr/share/doc/python3.11/html/_sources"
    _write(src, "tutorial/index.rst.txt", "tutorial")
    _write(src, "contents.rst.txt", "contents")
    _write(src, "library/os.rst.txt", "os module")
    cache = tmp_path / "cache"
    deb = _build_deb(pkg, "python3.11-doc", cache)
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


def _fake_fortunes_tree(root: Path, heldout=FORTUNES_HELDOUT) -> Path:
    games = root / "usr/share/games/fortunes"
    for topic in sorted(heldout):
        _write(games, topic, f"{topic} one\nsecond line\n%\n{topic} two\n%\n")
        (games / f"{topic}.u8").symlink_to(topic)
        (games / f"{topic}.dat").write_bytes(b"\x00\x00\x00\x02binary index")
    _write(games, "cookie", "cookie one\n%\n15% off\n%\n")
    _write(games, "tao", "%\nThe Way\n%\nThe Way that can be experienced\n%\n")
    _write(games, "empty", "%\n")  # no entry: no file
    for topic in FORTUNES_EXCLUDED:
        _write(games, topic, f"{topic} text\n%\n")
    (games / "cookie.u8").symlink_to("cookie")
    _write(root, "usr/share/doc/fortunes/copyright", "not a topic")
    return root


@needs_dpkg_deb
def test_fortunes_layout_from_local_deb(monkeypatch, tmp_path):
    cache = tmp_path / "cache"
    deb = _build_deb(_fake_fortunes_tree(tmp_path / "pkg"), "fortunes", cache)
    # Another package whose name starts with "fortunes" must never be picked up.
    (cache / "corpus" / "fortunes-min_9.9_all.deb").write_bytes(b"not a deb")
    monkeypatch.setenv("HF_CSA2_CACHE", str(cache))

    held = resolve_text("fortunes:heldout")
    calib = resolve_text("fortunes:calib")
    home = cache / "corpus" / "fortunes"
    assert (held, calib) == (home / "heldout", home / "calib")
    assert named_split("fortunes", "heldout") == held
    assert corpus_split("calib", corpus="fortunes") == calib
    names = lambda d: sorted(f.name for f in list_text_files(d))  # noqa: E731
    assert names(held) == sorted(f"{t}.txt" for t in FORTUNES_HELDOUT)
    assert names(calib) == ["cookie.txt", "tao.txt"]
    assert sorted(p.name for p in home.rglob("*") if p.is_file()) == sorted(
        ["SOURCE"] + names(held) + names(calib)
    )  # no excluded topic, .dat, .u8 or doc file anywhere
    assert (calib / "cookie.txt").read_text() == "cookie one\n\n15% off\n"
    assert (calib / "tao.txt").read_text() == "The Way\n\nThe Way that can be experienced\n"
    assert (held / "law.txt").read_text() == "law one\nsecond line\n\nlaw two\n"
    for f in list_text_files(home):
        assert not any(line.strip() == "%" for line in f.read_text().splitlines()), f
    assert (home / "SOURCE").read_text().strip() == deb.name
    assert _leftovers(cache) == []
    assert not (cache / "corpus" / "python3.11-doc").exists()  # only what was asked for
    assert corpus.corpus_home("fortunes", fetch=False) == home  # pure cache hit


@needs_dpkg_deb
def test_fortunes_deb_without_heldout_topic_is_rejected(monkeypatch, tmp_path):
    cache = tmp_path / "cache"
    _build_deb(_fake_fortunes_tree(tmp_path / "pkg", FORTUNES_HELDOUT - {"law", "wisdom"}), "fortunes", cache)
    monkeypatch.setenv("HF_CSA2_CACHE", str(cache))
    with pytest.raises(CorpusError, match="law, wisdom") as ei:
        resolve_text("fortunes:heldout")
    assert "--text" in str(ei.value)
    assert not (cache / "corpus" / "fortunes").exists()
    assert _leftovers(cache) == []


def _failing_apt(monkeypatch):
    calls = []

    def fake_run(cmd, cwd):
        calls.append(cmd)
        if cmd[0] == "apt-get":
            return subprocess.CompletedProcess(cmd, 100, "", "E: Temporary failure resolving 'deb.debian.org'")
        return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)

    monkeypatch.setattr(corpus, "_run", fake_run)
    monkeypatch.setattr(corpus, "_APT_UPDATE", [])
    return calls


def test_offline_fetch_raises_and_is_remembered(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_CSA2_CACHE", str(tmp_path))
    calls = _failing_apt(monkeypatch)
    with pytest.raises(CorpusError) as ei:
        resolve_text("fortunes:heldout")
    msg = str(ei.value)
    assert "'fortunes'" in msg and "Temporary failure" in msg and "--text" in msg
    assert calls == [["apt-get", "download", "fortunes"], ["apt-get", "update"], ["apt-get", "download", "fortunes"]]
    with pytest.raises(CorpusError) as again:  # remembered: no second attempt
        resolve_text("fortunes:calib")
    assert again.value is ei.value and len(calls) == 3
    # The other corpus is tried on its own, without waiting for `apt-get update` again.
    with pytest.raises(CorpusError, match="python3.11-doc"):
        resolve_text("python-docs:heldout")
    assert calls[3:] == [["apt-get", "download", "python3.11-doc"]] * 2
    assert not (tmp_path / "corpus" / "fortunes").exists()
    assert _leftovers(tmp_path) == []


def test_fetch_without_apt_get_on_path(monkeypatch, tmp_path):
    (tmp_path / "empty").mkdir()
    monkeypatch.setenv("HF_CSA2_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setattr(corpus, "_APT_UPDATE", [])
    with pytest.raises(CorpusError, match="could not download Debian package 'fortunes'.*--text"):
        named_split("fortunes", "heldout")


def test_main_reports_unavailable(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("HF_CSA2_CACHE", str(tmp_path))
    _failing_apt(monkeypatch)
    assert corpus.main([]) == corpus.EXIT_UNAVAILABLE
    err = capsys.readouterr().err
    assert all(f"corpus {name} unavailable" in err for name in CORPORA), err


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


@pytest.fixture(scope="module")
def fortunes_home():
    try:
        return corpus.corpus_home("fortunes", fetch=True)
    except CorpusError as e:
        pytest.skip(f"fortunes corpus unavailable (run scripts/fetch_fixtures.sh): {e}")


def _deb_topics(deb: Path) -> set[str]:
    listing = subprocess.run(["dpkg-deb", "-c", str(deb)], check=True, capture_output=True, text=True).stdout
    topics = set()
    for line in listing.splitlines():
        if line.startswith("-"):  # regular files only (the .u8 entries are symlinks)
            path = line.split()[5]
            head, _, name = path.rpartition("/")
            if head == "./usr/share/games/fortunes" and "." not in name:
                topics.add(name)
    return topics


@pytest.mark.real
def test_fortunes_splits_disjoint_nonempty_clean(fortunes_home):
    calib, held = named_split("fortunes", "calib"), named_split("fortunes", "heldout")
    calib_topics = {f.stem for f in list_text_files(calib)}
    held_topics = {f.stem for f in list_text_files(held)}
    assert held_topics == FORTUNES_HELDOUT
    assert len(calib_topics) >= 10 and {"cookie", "definitions", "work"} <= calib_topics
    assert calib_topics.isdisjoint(held_topics)
    assert not (calib_topics | held_topics) & FORTUNES_EXCLUDED
    deb = corpus._find_deb("fortunes")
    if deb is not None and shutil.which("dpkg-deb"):
        # Nothing but the excluded topics (and empty files) is dropped.
        assert calib_topics | held_topics == _deb_topics(deb) - FORTUNES_EXCLUDED
    for f in list_text_files(fortunes_home):
        text = f.read_text(encoding="utf-8")
        assert not any(line.strip() == "%" for line in text.splitlines()), f
        assert "\n\n" in text or f.stem == "pratchett", f  # entries separated by blank lines
    assert len(read_text(calib, max_chars=10_000)) == 10_000
    assert len(read_text(held, max_chars=10_000)) == 10_000


@pytest.mark.real
def test_fortunes_specs_resolve_to_splits(fortunes_home):
    assert resolve_text("fortunes:calib") == fortunes_home / "calib" == named_split("fortunes", "calib")
    assert resolve_text("fortunes:heldout") == fortunes_home / "heldout" == named_split("fortunes", "heldout")


@pytest.mark.real
def test_main_prints_every_split(fortunes_home, docs_root, capsys):
    assert corpus.main([]) == 0
    out = capsys.readouterr().out.splitlines()
    for spec in NAMED_CORPORA:
        (line,) = [ln for ln in out if ln.startswith(spec + "\t")]
        path, count = line.split("\t")[1:]
        assert Path(path) == resolve_text(spec)
        assert int(count.split()[0]) == len(list_text_files(path)) > 0


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from transformers import AutoTokenizer

    from hf_csa2.io.sources import SourceError, resolve_alias

    try:
        gguf = resolve_alias("smollm2-135m")
    except SourceError as err:  # only a failed fetch skips; a failed load is a bug
        pytest.skip(f"SmolLM2 checkpoint cannot be fetched (offline?): {err}")
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


@pytest.mark.real
def test_fortunes_heldout_token_windows(fortunes_home, smollm2_tokenizer):
    w = token_windows(smollm2_tokenizer, "fortunes:heldout", window=2048, max_windows=4)
    assert w.dtype == torch.long and tuple(w.shape) == (4, 2048)
    text = read_text(named_split("fortunes", "heldout"))
    full = smollm2_tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    assert len(full) > 50_000  # ~215K tokens measured; far more than 4 windows
    assert w.flatten().tolist() == full[: 4 * 2048]
    assert "%" not in {t.strip() for t in smollm2_tokenizer.decode(w[0]).splitlines()}
