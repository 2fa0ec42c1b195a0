"""``hf-csa2 push``: validate a folder, write its card, and upload exactly the validated files.

Order: the repo ID and flags are checked, the folder validated and its card built (every
problem listed in one error), the file set staged into a temporary folder (links, not copies,
where the file system allows) with the card as README.md, the staged set loaded and run
without hf-csa2; only then is ``HfApi`` created (its token comes from ``huggingface-cli
login`` / ``HF_TOKEN``, never from us, never printed) and the staged folder uploaded.
``--dry-run`` stops before ``HfApi``: it prints the files, their sizes and the card.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..errors import one_line
from ..export.deepseek_v3 import export_checkpoint
from ..io.output import OUTPUT_MARKER
from ..io.sources import looks_like_hub_id
from .card import CARD_FILE, CardError, build_card, card_facts
from .provenance import folder_provenance, read_json, source_provenance
from .validate import PublishError, PublishSet, check_folder, load_problems

PUSH_FORMATS = ("native", "deepseek_v3")
#: Above this many bytes (and without --create-pr / --revision / a commit message to keep) the
#: upload goes through ``upload_large_folder`` (resumable, several workers) where the installed
#: huggingface_hub has it (1.x); 2.x's ``upload_folder`` is resumable itself.
LARGE_FOLDER_BYTES = 5 * 1024**3


@dataclass
class PushOptions:
    """What ``hf-csa2 push`` was asked (the CLI flags)."""

    private: bool = False
    revision: str | None = None
    create_pr: bool = False
    commit_message: str | None = None
    format: str = "native"
    include: tuple[str, ...] = ()
    license: str | None = None
    base_model: str | None = None
    eval_files: tuple[str, ...] = ()


def check_options(repo_id: str, options: PushOptions) -> None:
    """Flag problems, before any folder is read."""
    problems = []
    if not looks_like_hub_id(repo_id):
        problems.append(f"repo ID {repo_id!r}; allowed: OWNER/NAME (letters, digits, '.', '_', '-')")
    if options.format not in PUSH_FORMATS:
        problems.append(f"--format {options.format!r}; allowed: {', '.join(PUSH_FORMATS)}")
    if options.base_model is not None and not looks_like_hub_id(options.base_model):
        problems.append(f"--base-model {options.base_model!r}; allowed: a Hub repository ID OWNER/NAME")
    missing = [f for f in options.eval_files if not Path(f).is_file()]
    if missing:
        problems.append(f"--eval file not found: {', '.join(missing)}")
    if problems:
        raise PublishError("; ".join(problems))


def check_push_after(repo_id: str, origin: str, options: PushOptions) -> None:
    """For ``convert`` / ``train`` ``--push-to-hub``: the flags, and that the card will know the
    base model and license of ``origin`` (the source, or the converted student), checked before
    any work starts so a long run does not end in a refused upload."""
    check_options(repo_id, options)
    path = Path(origin)
    found = folder_provenance(path) if (path / OUTPUT_MARKER).is_file() else source_provenance(origin)
    missing = []
    if not (options.base_model or found.base_model):
        missing.append(f"--push-to-hub: the Hub repository of {origin!r} is unknown; give --base-model REPO_ID")
    if not (options.license or found.license):
        missing.append(f"--push-to-hub: the license of {origin!r} is unknown; give --license ID (e.g. apache-2.0)")
    if missing:
        raise PublishError("; ".join(missing))


def _link_or_copy(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


@contextmanager
def staged_folder(folder: str | os.PathLike, repo_id: str, options: PushOptions, *, check_load: bool = True,
                  log: Callable[[str], None] = print):
    """Yield ``(PublishSet, staged folder, card)`` for ``folder``: validated, its card written as
    README.md beside exactly the files to upload; removed afterwards. :class:`PublishError`
    lists every problem (nothing is staged then)."""
    check_options(repo_id, options)
    with tempfile.TemporaryDirectory(prefix="hf-csa2-push-") as work:
        work = Path(work)
        source = Path(folder)
        if options.format == "deepseek_v3":
            log(f"exporting {source} to the DeepSeek-V3 format")
            source = export_checkpoint(source, work / "exported")
        chosen, problems = check_folder(source, options.include)
        card = None
        try:
            facts = card_facts(source, license=options.license, base_model=options.base_model,
                               eval_files=[Path(f) for f in options.eval_files])
            card = build_card(source, repo_id, facts)
        except (CardError, PublishError) as err:
            problems.append(one_line(err))
        except (OSError, ValueError, KeyError, TypeError) as err:  # a report we cannot read: listed, no traceback
            problems.append(f"the card cannot be built: {one_line(err, 300)}")
        if problems:
            raise PublishError(f"{source} cannot be published: " + "; ".join(problems))
        staged = work / "upload"
        for rel in chosen.files:
            _link_or_copy(source / rel, staged / rel)
        card.save(staged / CARD_FILE)
        if check_load:
            base = None
            if chosen.kind == "adapter":
                base = read_json(source / "adapter_config.json").get("base_model_name_or_path")
            log("checking that the files load and run without hf-csa2 (trust_remote_code=True)")
            problems = load_problems(staged, chosen.kind, base)
            if problems:
                raise PublishError(f"{source} cannot be published: " + "; ".join(problems))
        yield chosen, staged, card


def format_file_list(chosen: PublishSet) -> str:
    lines = [f"{chosen.sizes[f]:>14,}  {f}" for f in chosen.files]
    lines.append(f"{chosen.total_bytes:>14,}  total ({len(chosen.files)} files + {CARD_FILE}, the card below)")
    return "\n".join(lines)


def push(folder: str | os.PathLike, repo_id: str, options: PushOptions | None = None, *, dry_run: bool = False,
         api=None, log: Callable[[str], None] = print) -> dict:
    """Publish ``folder`` as ``repo_id`` (see the module docstring); ``api``: an ``HfApi`` (or a
    stand-in with its methods), created here only after validation. Returns what was (or, with
    ``dry_run``, would be) uploaded: ``{"repo_id", "files", "card", "url"}``."""
    options = options or PushOptions()
    with staged_folder(folder, repo_id, options, log=log) as (chosen, staged, card):
        result = {"repo_id": repo_id, "files": [*chosen.files, CARD_FILE], "card": str(card), "url": None}
        if dry_run:
            log(f"dry run: would upload to {repo_id}" + (f" (branch {options.revision})" if options.revision else "")
                + (" as a pull request" if options.create_pr else "") + (" (private)" if options.private else ""))
            log(format_file_list(chosen))
            log(f"--- {CARD_FILE} ---\n{card}")
            return result
        if api is None:
            from huggingface_hub import HfApi

            api = HfApi()
        message = options.commit_message or f"Upload {Path(folder).name} with hf-csa2"
        api.create_repo(repo_id, repo_type="model", private=options.private, exist_ok=True)
        large = chosen.total_bytes > LARGE_FOLDER_BYTES
        # huggingface_hub 1.x only: 2.0 removed upload_large_folder, its upload_folder commits a big
        # folder in parts and resumes by itself
        if large and hasattr(api, "upload_large_folder") and not (
                options.create_pr or options.revision or options.commit_message):
            api.upload_large_folder(repo_id=repo_id, folder_path=str(staged), repo_type="model",
                                    private=options.private)
            result["url"] = f"https://huggingface.co/{repo_id}"
        else:
            if options.revision and not options.create_pr:
                api.create_branch(repo_id, branch=options.revision, repo_type="model", exist_ok=True)
            info = api.upload_folder(repo_id=repo_id, folder_path=str(staged), repo_type="model",
                                     commit_message=message, revision=options.revision, create_pr=options.create_pr)
            result["url"] = str(getattr(info, "pr_url", None) or getattr(info, "commit_url", None) or info)
        log(f"uploaded {len(result['files'])} files to {repo_id}: {result['url']}")
        return result


def write_card(folder: str | os.PathLike, out: str | os.PathLike | None, repo_id: str | None,
               options: PushOptions | None = None) -> Path:
    """``hf-csa2 card``: write only the card of ``folder`` (default ``FOLDER/README.md``)."""
    options = options or PushOptions()
    folder = Path(folder)
    repo_id = repo_id or f"USER/{folder.resolve().name}"
    check_options(repo_id, options)
    if not folder.is_dir():
        raise PublishError(f"{str(folder)!r} is not a folder")
    facts = card_facts(folder, license=options.license, base_model=options.base_model,
                       eval_files=[Path(f) for f in options.eval_files])
    path = Path(out) if out else folder / CARD_FILE
    build_card(folder, repo_id, facts).save(path)
    return path


__all__ = ["LARGE_FOLDER_BYTES", "PUSH_FORMATS", "PushOptions", "check_options", "check_push_after", "format_file_list", "push",
           "staged_folder", "write_card"]
