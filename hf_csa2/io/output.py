"""Where hf-csa2 may write, and how a folder is written so that nothing is ever lost.

Rules, checked before any model is loaded (:func:`check_output_dir`, :func:`check_output_file`):

* the output is never equal to, inside, or a parent of an input (source, converted model,
  teacher, plan, calibration text), compared after resolving symlinks, and never the current
  folder or one of its parents;
* an existing output folder is replaced only with ``overwrite`` and only if hf-csa2 wrote it
  (it holds :data:`OUTPUT_MARKER`) or it is empty;
* the nearest existing parent must be a folder we can create files in.

Writing (:func:`write_folder_atomically`) goes to a hidden temp folder beside the output,
gets normal permissions (``0666``/``0777`` minus the umask), then replaces the output by two
renames, after checking the rules above once more. Temp folders left by a killed process of
this host are removed by the next write next to them, and an output that was moved aside but
not yet replaced is put back. Every path is made absolute and normalised first, so the same
folder is checked and written (``missing/../out`` is ``out``); a symlink as output is refused.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import tempfile
from pathlib import Path
from typing import Callable, Iterable

from ..errors import UserError

#: Every folder hf-csa2 writes holds this file (the stage report); it is what makes a folder
#: ours to replace with ``overwrite``.
OUTPUT_MARKER = "conversion_report.json"


class OutputError(UserError, ValueError):
    """The output path cannot be used; the message says why and what to do."""


class OutputExistsError(OutputError, FileExistsError):
    """The output folder exists and ``overwrite`` was not given."""


def _resolved(path: str | os.PathLike) -> Path:
    return Path(path).expanduser().resolve()


def _absolute(path: str | os.PathLike) -> Path:
    """Absolute and normalised (``..`` removed), symlinks kept: the path that will be written."""
    return Path(os.path.abspath(os.path.expanduser(os.fspath(path))))


def _overlap(out: Path, inputs: Iterable[tuple[str, str | os.PathLike]], may_contain: bool = False) -> str | None:
    for role, path in inputs:
        if path is None:
            continue
        inp = _resolved(path)
        if out == inp:
            return f"is the {role} ({str(inp)!r})"
        if out in inp.parents and not may_contain:
            return f"contains the {role} ({str(inp)!r})"
        if inp in out.parents:
            return f"is inside the {role} ({str(inp)!r})"
    return None


def _check_writable_parent(out: Path, flag: str) -> None:
    """The nearest existing parent of ``out`` must be a folder we can create entries in."""
    parent = out.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise OutputError(f"{flag} {str(out)!r}: {str(parent)!r} is a file, not a folder")
    try:
        probe = tempfile.mkdtemp(dir=parent, prefix=".hf_csa2-write-check-")
    except OSError as err:
        raise OutputError(f"{flag} {str(out)!r}: cannot create files in {str(parent)!r} ({err.strerror})") from None
    os.rmdir(probe)


def is_ours(folder: Path) -> bool:
    """True when ``folder`` was written by hf-csa2 (or is an empty folder)."""
    return (folder / OUTPUT_MARKER).is_file() or (folder.is_dir() and not any(folder.iterdir()))


def _check_replaceable(out: Path, overwrite: bool, flag: str, shown) -> None:
    if out.is_symlink():
        raise OutputError(f"{flag} {str(shown)!r} is a symbolic link; give the real folder it points to")
    if out.exists():
        if not out.is_dir():
            raise OutputError(f"{flag} {str(shown)!r} exists and is not a folder")
        if not overwrite:
            raise OutputExistsError(f"{flag} {str(shown)!r} exists; pass --overwrite (overwrite=True) to replace it")
        if not is_ours(out):
            raise OutputError(f"{flag} {str(shown)!r} exists and was not written by hf-csa2 (it has no "
                              f"{OUTPUT_MARKER}); --overwrite replaces only hf-csa2's own folders. Remove it "
                              "yourself or choose another folder")


def check_output_dir(out_dir: str | os.PathLike, *, overwrite: bool = False,
                     inputs: Iterable[tuple[str, str | os.PathLike]] = (), flag: str = "--out") -> Path:
    """Check that ``out_dir`` may be written (rules in the module docstring); return it.

    ``inputs``: ``(role, path)`` pairs, e.g. ``("source", "models/llama")``; ``flag`` names the
    argument in messages. Stale temp folders of dead processes beside it are cleaned up.
    """
    out = _absolute(out_dir)
    resolved = _resolved(out)
    clash = _overlap(resolved, inputs)
    if clash:
        raise OutputError(f"{flag} {str(out_dir)!r} {clash}; write to a new folder elsewhere")
    cwd = Path.cwd().resolve()
    if resolved == cwd or resolved in cwd.parents:
        raise OutputError(f"{flag} {str(out_dir)!r} is the current folder or one of its parents; give a new folder")
    if out.parent.is_dir() and not out.is_symlink():
        remove_stale_temps(out)  # first: it may put back an output a killed run had moved aside
    _check_replaceable(out, overwrite, flag, out_dir)
    _check_writable_parent(out, flag)
    return out


def check_output_file(path: str | os.PathLike, *, inputs: Iterable[tuple[str, str | os.PathLike]] = (),
                      flag: str = "--json", overwrite: bool = True) -> Path:
    """Check that the file ``path`` may be written: not a folder, not an input nor inside an
    input folder (we never add files to a model folder we read), parent writable."""
    out = _absolute(path)
    if out.is_dir():
        raise OutputError(f"{flag} {str(path)!r} is a folder; allowed: a file path")
    resolved = _resolved(out)
    clash = _overlap(resolved, inputs)
    if clash:
        raise OutputError(f"{flag} {str(path)!r} {clash}; write it elsewhere")
    if out.exists() and not overwrite:
        raise OutputExistsError(f"{flag} {str(path)!r} exists; pass --overwrite to replace it")
    _check_writable_parent(resolved, flag)
    return out


def check_results_dir(path: str | os.PathLike, *, inputs: Iterable[tuple[str, str | os.PathLike]] = (),
                      flag: str = "--out") -> Path:
    """Check a folder that results are added to (nothing in it is deleted): not an input nor
    inside one (we never add files to a model folder we read), parent writable."""
    out = _absolute(path)
    resolved = _resolved(out)
    clash = _overlap(resolved, inputs, may_contain=True)
    if clash:
        raise OutputError(f"{flag} {str(path)!r} {clash}; write the results elsewhere")
    if out.exists() and not out.is_dir():
        raise OutputError(f"{flag} {str(path)!r} exists and is not a folder")
    _check_writable_parent(resolved, flag)
    return out


# -- temp folders -------------------------------------------------------------------------
# Names carry the host as well as the pid: on a folder shared between machines (or
# containers) a pid means nothing elsewhere, so only this host's dead processes are judged.

_HOST = re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname())[:40] or "host"


def _temp_path(out: Path, kind: str) -> Path:
    return out.parent / f".{out.name}.{kind}-{_HOST}-{os.getpid()}"


def _temp_pattern(name: str) -> re.Pattern:
    # the host part is missing in names written by hf-csa2 before it was added
    return re.compile(rf"\.{re.escape(name)}\.(tmp|old)-(?:(.+)-)?(\d+)")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def remove_stale_temps(out: Path) -> None:
    """Tidy ``.NAME.tmp-HOST-PID`` / ``.NAME.old-HOST-PID`` folders beside ``out`` left by dead
    processes of this host: temp folders are removed; an ``old`` folder (the previous output,
    moved aside just before its replacement was renamed in) becomes ``out`` again when ``out``
    is missing, and is removed otherwise."""
    out = _absolute(out)
    pattern = _temp_pattern(out.name)
    for entry in sorted(out.parent.iterdir()):
        match = pattern.fullmatch(entry.name)
        if not match or entry.is_symlink() or not entry.is_dir():
            continue
        kind, host, pid = match.group(1), match.group(2) or _HOST, int(match.group(3))
        if host != _HOST or (pid != os.getpid() and _pid_alive(pid)):
            continue
        if kind == "old" and not out.exists() and not out.is_symlink():
            entry.rename(out)
        else:
            shutil.rmtree(entry, ignore_errors=True)


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def give_normal_permissions(folder: Path) -> None:
    """``0666``/``0777`` minus the umask for everything under ``folder`` (some writers, e.g.
    atomic file helpers, create ``0600`` files that other users of a shared folder cannot read)."""
    mask = _umask()
    for root, dirs, files in os.walk(folder):
        os.chmod(root, 0o777 & ~mask)
        for name in files:
            os.chmod(os.path.join(root, name), 0o666 & ~mask)


def write_folder_atomically(out_dir: str | os.PathLike, write: Callable[[Path], None], *,
                            overwrite: bool = False) -> Path:
    """Call ``write(tmp)`` on a fresh temp folder beside ``out_dir``, then move it into place.

    The output is replaced only after ``write`` succeeded, and only if it may be (it does not
    exist, or ``overwrite`` and hf-csa2 wrote it: checked again right before the renames); on
    any failure (Ctrl-C included) the temp folder is removed and an existing output is left as
    it was.
    """
    out = _absolute(out_dir)
    _check_replaceable(out, overwrite, "output folder", out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(out)
    tmp, old = _temp_path(out, "tmp"), _temp_path(out, "old")
    try:
        tmp.mkdir()
        write(tmp)
        give_normal_permissions(tmp)
        _check_replaceable(out, overwrite, "output folder", out_dir)  # it may have appeared meanwhile
        if out.exists():
            out.rename(old)
        tmp.rename(out)
    except BaseException:
        if old.exists() and not out.exists():
            old.rename(out)
        raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    if old.exists():
        shutil.rmtree(old, ignore_errors=True)
    return out


__all__ = ["OUTPUT_MARKER", "OutputError", "OutputExistsError", "check_output_dir", "check_output_file", "check_results_dir",
           "give_normal_permissions", "is_ours", "remove_stale_temps", "write_folder_atomically"]
