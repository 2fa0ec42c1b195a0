"""The one base class of every error caused by what a user asked for.

The CLI prints a :class:`UserError` as one line and exits 2; any other exception is a bug
in hf-csa2 and keeps its traceback (exit 1). Each layer defines its own subclass next to the
code that raises it (``PlanError``, ``SourceError``, ``CorpusError``, ``OutputError``, ...),
so a library user can catch one kind or all of them.
"""

from __future__ import annotations


class UserError(Exception):
    """Bad input: the message names the problem and what is allowed."""


class InputError(UserError, ValueError):
    """A bad argument or input file that belongs to no more specific kind (e.g. models
    with different tokenizers passed to one perplexity comparison)."""


def one_line(err: BaseException, limit: int | None = None) -> str:
    """An error's message on one line (transformers' messages span several), capped at ``limit``."""
    text = " ".join(str(err).split()) or type(err).__name__
    return text if limit is None or len(text) <= limit else text[: limit - 3] + "..."


__all__ = ["InputError", "UserError", "one_line"]
