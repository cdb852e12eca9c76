"""The data steps of the flows (`flows/finetune.py`): prepare planned once, its units fanned out as
Metaflow foreach tasks, a join that checks them and swaps the data into place (data/prepare_units.py).

    planned = plan_data(settings)                    # DVC repro first when a dvc.yaml stage makes the dir
    for k in data_units(planned): prepare_unit(settings, planned, k)   # one task each in the flow
    data = join_data(settings, planned)              # {"content_hash", "reused", "rows", ...}
    data = prepare_data(settings)                    # the three in this process

Without `dataset.remote_dir` the staging dir the units write into sits next to `dataset.prepared_dir`:
the tasks need a filesystem they all see (a local run, or a shared volume under @kubernetes). With it
they share nothing but the store (data/remote.py): the plan puts its tokenizer in the store's staging,
each unit stages in a dir of its own and uploads its shards and record there, the join downloads them,
checks them, publishes the set (only if the pointer is where the plan found it) and clears the staging,
and every later consumer fetches the set into its own `prepared_dir`, pinned by `pin_published`.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from dllmflow.settings import Settings

log = logging.getLogger(__name__)

SettingsLike = Settings | dict[str, Any]


def prepare_data(settings: SettingsLike, *, force: bool = False) -> dict[str, Any]:
    """Run or reuse data prep in this process: `plan_data`, every unit, `join_data` (the flow runs
    the units as foreach tasks). Returns the data hash and how it was obtained."""
    from dllmflow.data.prepare_units import run_units

    planned = plan_data(settings, force=force, fan_out=False)  # one process: its own staging dir
    if planned["plan"]["reused"] is None:
        run_units(Settings.coerce(settings), planned["plan"])
    return join_data(settings, planned)


def plan_data(settings: SettingsLike, *, force: bool = False, fan_out: bool = True) -> dict[str, Any]:
    """The prepare plan (`dllmflow.data.prepare_units`), after DVC had its say: when
    `dataset.prepared_dir` is the output of a `dvc.yaml` stage, `dvc repro` runs it (DVC skips it when
    its params and deps hashes are unchanged; it prepares in one process), and the plan then finds
    the result reusable when it was prepared with exactly these settings. Else the plan lists the
    units for `prepare_unit` (one per flow foreach task) and `join_data` finishes.

    With `dataset.remote_dir` and `fan_out` (the flow's steps, each in a pod of its own), the units
    share nothing with this step: the plan's tokenizer goes to the store's staging (`remote_staging`),
    each unit fetches it and uploads its shards and record there, and the join downloads them. A set
    reused here is published from here (this step holds it)."""
    from dllmflow.data.prepare_units import plan_prepare
    from dllmflow.data.prepared_dir import read_manifest
    from dllmflow.data.remote import pointer_etag, publish_prepared, staging_url, upload_staged

    s = Settings.coerce(settings)
    remote = s.dataset.remote_dir
    via_dvc, dvc_skipped = None if force else _dvc_repro(s.dataset.prepared_dir)
    before = read_manifest(s.dataset.prepared_dir)
    planned = {
        "plan": plan_prepare(s, force=force),
        "dvc_stage": via_dvc,
        "dvc_skipped": dvc_skipped,
        "before_hash": (before or {}).get("content_hash"),
        # the published pointer as this plan found it: the join publishes only if no one moved it since
        "remote_etag": pointer_etag(remote) if remote else None,
        "remote_staging": None,
        "published": None,
    }
    plan = planned["plan"]
    if remote and plan["reused"] is not None:
        planned["published"] = publish_prepared(s.dataset.prepared_dir, remote, planned["remote_etag"])
    elif remote and fan_out:
        url = staging_url(remote, plan)
        staging = Path(plan["staging"])
        upload_staged(
            staging, url, sorted(p.relative_to(staging).as_posix() for p in staging.rglob("*") if p.is_file())
        )
        shutil.rmtree(staging, ignore_errors=True)  # the units and the join stage in dirs of their own
        planned["remote_staging"] = url
    return planned


def data_units(planned: dict[str, Any]) -> list[int]:
    """The foreach list of a plan: one index per unit ([0], a no-op task, when the data is reused)."""
    return list(range(len(planned["plan"]["source"]["units"])))


def prepare_unit(settings: SettingsLike, planned: dict[str, Any], k: int) -> None:
    """One unit's shards (a foreach task; a retry rewrites only this unit's files). With a store's
    staging, in a temporary dir of this task's own, uploaded there (the record last)."""
    from dllmflow.data.prepare_units import UNITS_DIR, run_unit
    from dllmflow.data.remote import download_staged, upload_staged

    s, url = Settings.coerce(settings), planned.get("remote_staging")
    if url is None:
        run_unit(s, planned["plan"], k)
        return
    home = Path(s.dataset.prepared_dir).parent  # this task's disk, where its prepared dir would be
    home.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{Path(s.dataset.prepared_dir).name}.unit-", dir=home) as tmp:
        download_staged(url, tmp, "tokenizer")
        rec = run_unit(s, {**planned["plan"], "staging": tmp}, k)
        if rec is not None:
            upload_staged(tmp, url, [*sorted(rec["files"]), f"{UNITS_DIR}/unit-{k:06d}.json"])


def join_data(settings: SettingsLike, planned: dict[str, Any]) -> dict[str, Any]:
    """Check every unit's shards, write the manifest, swap the data into place (`join_prepare`); with
    `dataset.remote_dir`, publish it (from a store's staging: downloaded into a staging dir of this
    step's own first, removed from the store once published)."""
    from dllmflow.data.prepare_units import join_prepare
    from dllmflow.data.remote import download_staged, publish_prepared, remove_staged

    s = Settings.coerce(settings)
    remote, url, plan = s.dataset.remote_dir, planned.get("remote_staging"), planned["plan"]
    if url is not None:
        out_dir = Path(s.dataset.prepared_dir)
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
        plan = {**plan, "staging": str(staging), "out_dir": str(out_dir)}
        try:
            download_staged(url, staging)
            manifest = join_prepare(s, plan)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    else:
        manifest = join_prepare(s, plan)
    published = planned.get("published")
    if remote and published is None:
        published = publish_prepared(s.dataset.prepared_dir, remote, planned.get("remote_etag"))
    if url is not None:
        remove_staged(url)
    via_dvc = planned["dvc_stage"]
    return {
        "prepared_dir": s.dataset.prepared_dir,
        "content_hash": manifest["content_hash"],
        # sha256 of the input files (for DFlash: the regenerated shards), for the model's lineage.
        "source_sha256": manifest.get("source", {}).get("sha256"),
        # True when nothing was rebuilt: DVC skipped the stage, or prepare() matched its fingerprint.
        "reused": planned["dvc_skipped"] if via_dvc else planned["before_hash"] == manifest["content_hash"],
        "dvc_stage": via_dvc,
        "dvc_rev": _git_rev() if via_dvc else None,
        "rows": {name: split["rows"] for name, split in manifest.get("splits", {}).items()},
        "units": manifest.get("units", 1),
        # dataset.remote_dir: the set every later step and trainer fetches ({"content_hash", "set", ...})
        "published": published,
    }


def _dvc_repro(out_dir: str) -> tuple[str | None, bool]:
    """`dvc repro` of the dvc.yaml stage whose `outs` is `out_dir`, through DVC's Python API (the CLI
    in a subprocess imported DVC a second time: the tiny flow's prepare step took 6.6 s, now 1.8 s). Returns
    (stage name, skipped: its params and deps hashes were unchanged), or (None, False) when this is
    not a DVC repo, no stage makes `out_dir`, or DVC failed (then prepare() runs directly)."""
    if not Path("dvc.yaml").is_file() or not Path(".dvc").is_dir():
        return None, False
    stage = None
    try:
        from dvc.repo import Repo

        with Repo(".") as repo:
            stage = next(
                (
                    st.addressing
                    for st in repo.index.stages
                    if any(os.path.normpath(str(o.def_path)) == os.path.normpath(out_dir) for o in st.outs)
                ),
                None,
            )
            if stage is None:
                return None, False
            return stage, not repo.reproduce(stage)  # [] = nothing reproduced: it didn't change
    except Exception as e:  # a broken DVC setup must not stop the flow: prepare() still runs
        log.warning("dvc repro %s failed, preparing directly: %s", stage or "(reading dvc.yaml)", e)
    return None, False


def _git_rev() -> str | None:
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def pin_published(settings: SettingsLike, data: dict[str, Any]) -> dict[str, Any]:
    """The settings with `dataset.content_hash` pinned to the set the join published (unchanged without
    `dataset.remote_dir`): each trainer fetches that set, whatever the pointer names by then."""
    s = Settings.coerce(settings)
    if not s.dataset.remote_dir or not data.get("published"):
        return settings if isinstance(settings, dict) else s.to_dict()
    dataset = s.dataset.model_copy(update={"content_hash": data["content_hash"]})
    return s.model_copy(update={"dataset": dataset}).to_dict()
