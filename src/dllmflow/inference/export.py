"""`dllmflow export`: what a checkpoint's export would publish, a staging copy of it, or the Hub push.

    dllmflow export --checkpoint runs/tiny_mdlm --push-to-hub me/tiny-mdlm --dry-run   # list + card
    dllmflow export --checkpoint runs/tiny_mdlm --output /tmp/tiny-mdlm                 # staging copy
    dllmflow export --checkpoint runs/tiny_mdlm --push-to-hub me/tiny-mdlm [--private]  # upload

`--checkpoint` resolves like `generate`'s (`dllmflow.runs.resolve_checkpoint`). The published folder
is the consolidated export as training wrote it (weights, configs with their `dllm` block, tokenizer,
settings.json, README.md model card); an export from before cards existed gets one written from its
settings.json. Every file is listed with its size and sha256. The folder is staged in a temp dir and
renamed into place (`--output`) or uploaded from there with `huggingface_hub.HfApi().upload_folder`,
so a failure leaves nothing half-written. An existing `--output` is replaced only when it is an export
(its config.json has the `dllm` block); a file or any other non-empty dir is refused, untouched.
`--dry-run` never touches the network.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from dllmflow.common.cli_args import add_flag
from dllmflow.common.files import sha256_file
from dllmflow.common.outputs import OutputPathError, check_output_dir
from dllmflow.errors import UserError
from dllmflow.runs import recorded_settings, resolve_checkpoint

_REPO_ID = re.compile(r"^[\w.-]+/[\w.-]+$|^[\w.-]+$")
_SKIPPED = (".tmp", ".lock")  # leftovers of an interrupted writer, never published


# ---- staging ------------------------------------------------------------------------------------


def stage_export(ckpt: str | os.PathLike, dest: str | os.PathLike, link: bool = False) -> Path:
    """Copy the export `ckpt` into the new dir `dest` (hard links with `link`, for a throwaway
    upload folder), adding a model card when it has none. `dest` appears whole or not at all."""
    from dllmflow.models.model_card import README

    ckpt, dest = Path(ckpt), Path(dest)
    replace = check_export_dir(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent))
    old = None
    try:
        for src in published_files(ckpt):
            out = tmp / src.relative_to(ckpt)
            out.parent.mkdir(parents=True, exist_ok=True)
            _link_or_copy(src, out, link)
        if not (tmp / README).is_file():
            _write_missing_card(ckpt, tmp)
        if replace or dest.exists():  # our previous export (or an empty dir): moved aside, then deleted
            old = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".old", dir=dest.parent))
            os.replace(dest, old)  # onto an empty dir of our own making
        os.replace(tmp, dest)
    except BaseException:
        if old is not None and not dest.exists():
            os.replace(old, dest)  # the swap failed halfway: the previous export goes back
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    os.chmod(dest, 0o755)  # mkdtemp creates 0700
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return dest


def check_export_dir(dest: Path) -> bool:
    """True when `dest` is an export (its config.json carries our `dllm` block: replaceable), False
    when absent or empty; else OutputPathError naming it (a file, an unrelated or other dir)."""
    from dllmflow.models.model_card import read_dllm_block

    ours = check_output_dir(dest, marker="config.json", kind="dllmflow export", field="--output")
    if ours and read_dllm_block(dest) is None:
        raise OutputPathError(
            f"--output = {dest}: its config.json has no `dllm` block, so it is not a dllmflow export; "
            "refusing to replace or delete it: choose an empty or new dir"
        )
    return ours


def published_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and not p.name.endswith(_SKIPPED))


def file_listing(folder: str | os.PathLike) -> list[dict[str, Any]]:
    """[{"path", "size", "sha256"}] of every file under `folder`, paths relative, sorted."""
    folder = Path(folder)
    return [
        {"path": p.relative_to(folder).as_posix(), "size": p.stat().st_size, "sha256": sha256_file(p)}
        for p in published_files(folder)
    ]


def _link_or_copy(src: Path, out: Path, link: bool) -> None:
    if link:
        try:
            os.link(src.resolve(), out)
            return
        except OSError:  # another filesystem: copy
            pass
    shutil.copy2(src, out)


def _write_missing_card(ckpt: Path, staged: Path) -> None:
    """A card for an export written before cards existed, and the `dllm` block in its config.json: a
    fresh file (written by rename), never the hard-linked original."""
    from dllmflow.diffusion.strategies.base import export_facts
    from dllmflow.models.model_card import write_export_card

    settings = recorded_settings(ckpt)
    if settings is None:
        raise UserError(
            f"{ckpt} has no README.md and no settings.json: not a dllmflow export "
            "(export a checkpoint that `dllmflow train` or the finetune flow wrote)"
        )
    # config.json only: some families' generation config classes refuse unknown keys
    facts = export_facts(settings, settings.dllm.mask_token_id)
    write_export_card(staged, facts, generation_config=False)


# ---- the Hub ------------------------------------------------------------------------------------


def push_to_hub(folder: Path, repo_id: str, private: bool = False, message: str | None = None) -> str:
    """Create `repo_id` if needed and upload `folder` as one commit; -> the commit URL. A failure
    (no network, no token, no permission) is a UserError saying so."""
    try:
        from huggingface_hub import HfApi
    except ImportError:
        raise UserError("--push-to-hub needs huggingface_hub: pip install huggingface_hub") from None
    api = HfApi()
    try:
        api.create_repo(repo_id, private=private, exist_ok=True)
        info = api.upload_folder(
            folder_path=str(folder), repo_id=repo_id, commit_message=message or "Upload dllmflow export"
        )
    except Exception as e:  # network, auth and Hub errors alike: one line, no traceback
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(
            f"push to {repo_id} failed ({type(e).__name__}: {reason}). Check the network and your token "
            "(`hf auth login` or HF_TOKEN); --dry-run shows what would be pushed without the network"
        ) from None
    return str(getattr(info, "commit_url", info))


# ---- CLI ----------------------------------------------------------------------------------------


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--checkpoint", required=True, help="consolidated dir, step dir, checkpoint root or run dir"
    )
    add_flag(
        parser, "--push-to-hub", metavar="REPO_ID", nargs="?", const="", help="Hub repo, e.g. me/tiny-mdlm"
    )
    add_flag(parser, "--dry-run", action="store_true", help="list the files and print the card; no network")
    parser.add_argument("--output", metavar="DIR", help="write a staging copy of what would be pushed here")
    parser.add_argument("--private", action="store_true", help="create the Hub repo private")
    add_flag(parser, "--commit-message", help="the Hub commit message")


def print_listing(listing: list[dict[str, Any]], card: str | None, out=None) -> None:
    out = out or sys.stdout
    width = max((len(f"{f['size']:,}") for f in listing), default=1)
    for f in listing:
        print(f"{f['size']:>{width},}  {f['sha256']}  {f['path']}", file=out)
    total = sum(f["size"] for f in listing)
    print(f"{len(listing)} files, {total:,} bytes", file=out)
    if card is not None:
        print(f"\n---- README.md (model card) ----\n{card}", file=out, end="")


def cli_main(args: argparse.Namespace) -> int:
    from dllmflow.models.model_card import README

    repo = args.push_to_hub
    if repo is not None and not repo:
        raise UserError("--push-to-hub needs a repo id, e.g. --push-to-hub me/tiny-mdlm")
    if repo and not _REPO_ID.match(repo):
        raise UserError(f"--push-to-hub {repo!r}: a repo id is NAME or OWNER/NAME (letters, digits, -_.)")
    ckpt = resolve_checkpoint(args.checkpoint)
    with tempfile.TemporaryDirectory(prefix="dllmflow-export-") as scratch:
        # --output is the staging copy itself; else a throwaway one of hard links
        staged = stage_export(ckpt, args.output or Path(scratch) / "export", link=not args.output)
        listing = file_listing(staged)
        print_listing(listing, (staged / README).read_text() if args.dry_run else None)
        if args.output:
            print(f"staged {staged}")
        if repo and not args.dry_run:
            url = push_to_hub(staged, repo, private=args.private, message=args.commit_message)
            print(f"pushed {len(listing)} files to {repo}: {url}")
        elif repo:
            print(f"dry run: nothing pushed to {repo}")
    return 0
