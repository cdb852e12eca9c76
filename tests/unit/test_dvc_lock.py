"""`dvc.lock` matches the committed code: the stages a newcomer runs from the README (`dvc repro prepare`,
`dvc repro regenerate`) have every code dependency and parameter locked at its current hash, so running
them rebuilds nothing that the lock does not already describe and leaves `git status` clean.

Data outputs are not checked (a fresh clone has none: "not in cache" is expected); a stale lock after a
change to the data code is, and the fix is to run the stage and commit the lock:

    dvc repro prepare regenerate && git add dvc.lock
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README_STAGES = ("prepare", "regenerate")


def _tracked() -> set[str]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return set(out.splitlines())


def test_readme_stages_are_locked_at_the_current_code():
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: DVC needs one")
    from dvc.repo import Repo

    tracked = _tracked()
    with Repo(str(ROOT)) as repo:
        status = repo.status(targets=list(README_STAGES))
    stale = []
    for stage, changes in status.items():
        for change in changes:
            if not isinstance(change, dict):  # e.g. "always changed" / "changed checksum"
                stale.append(f"{stage}: {change}")
                continue
            for path, what in change.get("changed deps", {}).items():
                if path in tracked or what != "deleted":  # a missing data dep is a fresh clone's normal state
                    stale.append(f"{stage}: {path} {what}")
            stale += [f"{stage}: params {p}" for p in change.get("changed params", {})]
    assert not stale, (
        "dvc.lock is stale (run `dvc repro prepare regenerate` and commit dvc.lock):\n" + "\n".join(stale)
    )
