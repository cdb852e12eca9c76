"""`dvc.lock` matches the committed code: the stages a newcomer runs from the README (`dvc repro prepare`,
`dvc repro regenerate`) have every code dependency and parameter locked at its current hash, so running
them rebuilds nothing that the lock does not already describe and leaves `git status` clean.

Data outputs are not checked (a fresh clone has none: "not in cache" is expected); a stale lock after a
change to the data code is, and the fix is to run the stage and commit the lock:

    dvc repro prepare regenerate && git add dvc.lock
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README_STAGES = ("prepare", "regenerate")


def test_readme_stages_are_locked_at_the_current_code():
    from dvc.repo import Repo

    # uninitialized: also outside a git checkout (an unpacked source tree); DVC reads dvc.yaml/dvc.lock
    with Repo(str(ROOT), uninitialized=True) as repo:
        status = repo.status(targets=list(README_STAGES))
    stale = []
    for stage, changes in status.items():
        for change in changes:
            if not isinstance(change, dict):  # e.g. "always changed" / "changed checksum"
                stale.append(f"{stage}: {change}")
                continue
            for path, what in change.get("changed deps", {}).items():
                # A data dep that a fresh checkout lacks (another stage's output) is "deleted": normal.
                if what != "deleted" or (ROOT / path).exists():
                    stale.append(f"{stage}: {path} {what}")
            stale += [f"{stage}: params {p}" for p in change.get("changed params", {})]
    assert not stale, (
        "dvc.lock is stale (run `dvc repro prepare regenerate` and commit dvc.lock):\n" + "\n".join(stale)
    )
