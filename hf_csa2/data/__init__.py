"""Text data for calibration and evaluation (see ``hf_csa2.data.corpus``)."""

# Lazy re-exports (PEP 562): importing corpus eagerly here would make
# `python -m hf_csa2.data.corpus` warn that the module was already imported.
_CORPUS_API = (
    "CorpusError",
    "cache_dir",
    "python_docs_root",
    "corpus_split",
    "named_split",
    "list_text_files",
    "read_text",
    "resolve_text",
    "NAMED_CORPORA",
    "CORPORA",
)

__all__ = list(_CORPUS_API)


def __getattr__(name):
    if name in _CORPUS_API:
        from hf_csa2.data import corpus

        return getattr(corpus, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
