"""The library side of `flows/regenerate.py` and of the `regenerate` DVC stage: DFlash data regenerated
by the target itself, with a local target server started (and stopped) when no external one is set.

    python -m dllmflow.workflow.regenerate --params params/tiny_dflash_regen.yaml      # the dvc.yaml stage
    python flows/regenerate.py --config recipe params/tiny_dflash_regen.yaml run  # the same, as a flow

    from dllmflow.workflow import regenerate as regen_pipeline
    summary = regen_pipeline.regenerate_data(load_settings("params/tiny_dflash_regen.yaml"))
    summary["content_hash"], summary["shards_sha256"]

Order of work (everything relative to the working directory, the repo root):
1) `export_source`: `regenerate.input_data: embedded:<name>` is written as JSONL to
   `<regenerate.output_dir>.source/<name>.jsonl` (every row, in file order); anything else is used as is.
   All rows, not only the train split: `dllmflow prepare` on the regenerated shards splits them again by
   the same question hash (`dataset.eval_fraction`), so held-out questions never reach training, and
   the eval split the draft's acceptance is measured on is not empty.
2) `serve_target`: `regenerate.target_server` set (SGLang, vLLM, ...) -> used as is, nothing starts.
   Unset -> `dllmflow serve` over the local target, `dflash.target_model_id`. A `tiny:<dir>` target that
   does not exist yet is bootstrapped: `prepare` runs on the source into `<output_dir>.source/prepared`
   with the recipe's tokenizer settings (`tokenizer.name_or_path` dropped when it names <dir> itself,
   so a BPE is trained on the source text), then `build_tiny_target(<dir>, that tokenizer)` saves the
   seeded target with its tokenizer. A recipe that trains on the result sets
   `tokenizer.name_or_path: <dir>`, so the draft's data uses exactly the target's vocabulary.
3) `regenerate_data`: regenerate through the server. The local server's URL goes in `server_url=`, so
   the manifest keeps `target_server: null` and a rerun on another port still matches it. A rerun
   resumes automatically when the output dir holds shards; when every shard is done no server starts.
   Returns the summary plus `content_hash` (shards in order + manifest) and `shards_sha256` (equal to
   the `source.sha256` that `dllmflow prepare` records in its manifest when it reads these shards).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dllmflow.common.files import atomic_write_text
from dllmflow.errors import UserError
from dllmflow.settings import Settings

log = logging.getLogger(__name__)

DEFAULT_LOCAL_MODEL = "dflash-target"
# Handed to `regenerate` when every shard is already on disk: it sends no request, so nothing listens.
NO_SERVER_URL = "http://no-server.invalid/v1"


def source_dir(settings: Settings) -> Path:
    """Work dir next to the output (`<output_dir>.source`): exported rows and the bootstrap prep.
    Outside the output dir, so DVC's hash of the shards does not depend on it."""
    out = Path(settings.regenerate.output_dir)
    return out.with_name(out.name + ".source")


def check_settings(settings: Settings | dict[str, Any]) -> Settings:
    """What the flow's start step validates: an input, and a server or a local target to serve. A
    dict (the flow's artifact) is validated here, once; the rest of this module takes `Settings`."""
    s = Settings.coerce(settings)
    r = s.regenerate
    if not r.input_data:
        raise UserError(
            "regenerate.input_data is required (e.g. embedded:gsm8k, or a JSONL/parquet file or dir)"
        )
    if r.target_server is None and s.dflash is None:
        raise UserError(
            "regenerate.target_server is unset and there is no dflash.target_model_id to serve locally; "
            "set one of them"
        )
    if r.target_server is None and r.model is None:
        log.info("regenerate.model unset: the local server serves the target as %r", DEFAULT_LOCAL_MODEL)
    return s


# ---- 1) the rows to regenerate --------------------------------------------------------------------


def export_source(settings: Settings) -> str:
    """Path of the chat rows to regenerate: embedded data written as JSONL (rewritten only when its
    bytes change), else `regenerate.input_data` unchanged."""
    from dllmflow.data.chat import EMBEDDED
    from dllmflow.data.gsm8k import EMBEDDED_PREFIX

    s = check_settings(settings)
    spec = s.regenerate.input_data
    if not spec.startswith(EMBEDDED_PREFIX):
        return spec
    name = spec[len(EMBEDDED_PREFIX) :]
    if name not in EMBEDDED:
        raise UserError(
            f"regenerate.input_data={spec!r}: unknown embedded dataset; choose one of {sorted(EMBEDDED)}"
        )
    loader, _ = EMBEDDED[name]
    text = "".join(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n" for r in loader())
    path = source_dir(s) / f"{name}.jsonl"
    if not path.is_file() or path.read_text(encoding="utf-8") != text:
        atomic_write_text(path, text)
    return str(path)


# ---- 2) the target server -------------------------------------------------------------------------


def _bootstrap_settings(s: Settings, source: str, target_dir: str) -> Settings:
    """Settings of the prep whose tokenizer a tiny target is built with: default dataset knobs (so the
    downstream recipe's dataset section cannot change the target), the recipe's tokenizer."""
    tok = s.tokenizer.model_dump(mode="json")
    named = tok.get("name_or_path")
    if named is not None and os.path.normpath(named) == os.path.normpath(target_dir):
        tok["name_or_path"] = None  # the target's own tokenizer: it is what we are about to make
    data = {
        "name": f"{s.name}-bootstrap",
        "tokenizer": tok,
        "dataset": {
            "path_or_dataset_id": source,
            "messages_column": s.regenerate.messages_column,
            "prepared_dir": str(source_dir(s) / "prepared"),
        },
    }
    return Settings.model_validate(data)


def local_target_path(settings: Settings, source: str | None = None) -> str:
    """Local model dir (or hub id) of `dflash.target_model_id`; builds a missing `tiny:<dir>` target
    from a tokenizer prepared on `source` (see the module docstring)."""
    s = check_settings(settings)
    if s.dflash is None:
        raise UserError("no dflash: section: set dflash.target_model_id, or regenerate.target_server")
    target_id = s.dflash.target_model_id
    from dllmflow.models.dflash_target import TINY_TARGET_PREFIX, resolve_target_path

    if not target_id.startswith(TINY_TARGET_PREFIX):
        return resolve_target_path(target_id, None)
    target_dir = target_id[len(TINY_TARGET_PREFIX) :]
    if (Path(target_dir) / "config.json").is_file():
        return target_dir  # built before (or pulled by DVC): reuse, never rebuild over it
    from dllmflow.data.prepare import prepare
    from dllmflow.data.tokenizer import load_tokenizer

    boot = _bootstrap_settings(s, source or export_source(s), target_dir)
    prepare(boot)
    log.info("building the tiny target %s with the tokenizer of %s", target_dir, boot.dataset.prepared_dir)
    return resolve_target_path(target_id, load_tokenizer(boot.dataset.prepared_dir))


def served_model_name(settings: Settings) -> str:
    return settings.regenerate.model or DEFAULT_LOCAL_MODEL


@contextlib.contextmanager
def serve_target(settings: Settings, source: str | None = None) -> Iterator[str]:
    """Yield the target server's base URL: `regenerate.target_server`, or a local `dllmflow serve` of
    the dflash target started here and stopped on exit."""
    s = check_settings(settings)
    if s.regenerate.target_server:
        yield s.regenerate.target_server.rstrip("/")
        return
    from dllmflow.inference.serve_cli import local_server

    target = local_target_path(s, source)
    log.info("starting a local server for %s", target)
    cap = max(1024, s.regenerate.max_new_tokens)  # the server must accept what the client asks for
    with local_server(target, served_model_name=served_model_name(s), max_tokens_cap=cap) as url:
        yield url


# ---- 3) regenerate --------------------------------------------------------------------------------


def regenerate_config(s: Settings, source: str):
    """The `RegenerateConfig` actually run: the exported source, and a model name for a local server."""
    update: dict[str, Any] = {"input_data": source}
    if s.regenerate.target_server is None:
        update["model"] = served_model_name(s)
    return s.regenerate.model_copy(update=update)


def pending_shards(cfg) -> list[int]:
    """Shards of `cfg` not yet on disk (what a resumed run would request)."""
    from dllmflow.data.regen_input import build_prompts, load_rows
    from dllmflow.data.regen_shards import scan_shards

    rows = load_rows(cfg.input_data, cfg.split, cfg.dataset_name, cfg.shuffle_seed)
    prompts, _ = build_prompts(rows, cfg.messages_column, cfg.input_data)
    done = scan_shards(cfg.output_dir)
    return [i for i in range(-(-len(prompts) // cfg.shard_size)) if i not in done]


def shard_files(out_dir: str | os.PathLike) -> list[Path]:
    from dllmflow.data.regen_shards import scan_shards, shard_path

    return [shard_path(out_dir, i) for i in sorted(scan_shards(out_dir))]


def content_hash(out_dir: str | os.PathLike) -> str:
    """sha256 over (name, bytes) of every shard in index order, then the manifest."""
    from dllmflow.data.regen_shards import MANIFEST

    h = hashlib.sha256()
    for p in [*shard_files(out_dir), Path(out_dir) / MANIFEST]:
        h.update(p.name.encode() + b"\0")
        h.update(p.read_bytes())
    return h.hexdigest()


def shards_sha256(out_dir: str | os.PathLike) -> str:
    """The hash `dllmflow prepare` records as `source.sha256` for this dir (shards only, by name)."""
    from dllmflow.common.files import sha256_file

    h = hashlib.sha256()
    for p in shard_files(out_dir):
        h.update(f"{p.name}\0{sha256_file(p)}\n".encode())
    return h.hexdigest()


def regenerate_data(
    settings: Settings | dict[str, Any], resume: bool | None = None, *, progress: bool | None = False
) -> dict[str, Any]:
    """Export the source, serve the target (unless external), regenerate, stop the server. `resume=None`
    resumes when the output dir already holds shards (a changed setting then fails, naming it)."""
    from dllmflow.data.regen_client import regenerate
    from dllmflow.data.regen_shards import scan_shards

    s = check_settings(settings)
    source = export_source(s)
    cfg = regenerate_config(s, source)
    if resume is None:
        resume = bool(scan_shards(cfg.output_dir))
    local = cfg.target_server is None
    if resume and not pending_shards(cfg):
        # Nothing left to request: skip starting a server (regenerate still checks the manifest).
        summary = regenerate(cfg, resume=True, server_url=NO_SERVER_URL, progress=progress)
        started = False
    elif local:
        with serve_target(s, source) as url:
            summary = regenerate(cfg, resume=resume, server_url=url, progress=progress)
        started = True
    else:
        summary = regenerate(cfg, resume=resume, progress=progress)
        started = False
    return {
        **summary,
        "input_data": source,
        "target_server": cfg.target_server,
        "model": cfg.model,
        "local_server_started": started,
        "content_hash": content_hash(cfg.output_dir),
        "shards_sha256": shards_sha256(cfg.output_dir),
    }


# ---- `python -m dllmflow.workflow.regenerate` (the dvc.yaml stage) --------------------------------------


def main(argv: list[str] | None = None) -> int:
    from dllmflow.common.cli_args import HelpFormatter, add_flag
    from dllmflow.settings import load_settings

    p = argparse.ArgumentParser(
        prog="python -m dllmflow.workflow.regenerate",
        description=__doc__.split("\n")[0],
        formatter_class=HelpFormatter,
    )
    p.add_argument(
        "--params", nargs="+", required=True, metavar="YAML", help="Recipe YAML(s), later override earlier."
    )
    p.add_argument(
        "--fresh", action="store_true", help="Never resume (fails if the output dir holds shards)."
    )
    add_flag(p, "--log-level", default="INFO")
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        summary = regenerate_data(load_settings(*args.params), resume=False if args.fresh else None)
    except UserError as e:
        print(f"regen_pipeline: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
