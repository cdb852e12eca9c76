"""The tiny prepared dataset most integration modules train on; each keeps its own module-scoped `prep`
fixture calling it with its recipe and row limit:

    from _prepared import prepare_tiny

    @pytest.fixture(scope="module")
    def prep(tmp_path_factory): return prepare_tiny(tmp_path_factory, RECIPE, limit=64)
"""

from __future__ import annotations

from pathlib import Path


def prepare_tiny(tmp_path_factory, recipe: Path, limit: int = 32, **dataset) -> Path:
    """`recipe`'s data prepared into a fresh temp dir (first `limit` rows; more `dataset` overrides)."""
    from dllmflow.data.prepare import prepare
    from dllmflow.settings import load_settings

    out = tmp_path_factory.mktemp("prepared") / "tiny"
    prepare(load_settings(recipe, dataset={"limit": limit, "prepared_dir": str(out), **dataset}))
    return out


def remote_run_settings(recipe: Path, prep: Path, remote: str | None, max_steps: int = 4, **sections):
    """`recipe` on the prepared `prep` (32 rows), a few steps of 4 rows, a checkpoint every 2 steps
    mirrored to `remote` (None: local only); `sections` override whole sections (eval=...)."""
    from dllmflow.settings import load_settings

    return load_settings(
        recipe,
        dataset={"limit": 32, "prepared_dir": str(prep)},
        train={"max_steps": max_steps, "global_batch_size": 4, "local_batch_size": 4, "warmup_steps": 1},
        checkpoint={"every_steps": 2, "keep_last": 2, "remote_dir": remote},
        **sections,
    )
