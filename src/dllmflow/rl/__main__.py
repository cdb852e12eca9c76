"""The GRPO entry point: one process per rank, started by torchrun (or plain python for one rank).

    torchrun --nproc_per_node 2 -m dllmflow.rl --run-dir runs/x [--resume | --overwrite]  # $DLLMFLOW_SETTINGS
    python -m dllmflow.rl --settings runs/x/settings.json          # a single in-process rank

`dllmflow rl` (workflow/grpo.py) resolves the settings (with `rl.init_from` resolved to the starting
export) and launches this through torchx, as `dllmflow train` launches dllmflow.training.main. Same
contract as that entry (training/main.py): the settings come only from the launcher (inline in
$DLLMFLOW_SETTINGS, or a --settings file whose directory is the run dir); rank 0 holds the run dir's lock; a failure prints `[rank N] ... failed: ...` and exits 1;
after an elastic restart it resumes from LATEST. Its user rewards ("module:attr") are imported from
those settings, which the caller's own launcher wrote from the caller's recipe.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from dllmflow.rl.grpo_trainer import run_grpo
    from dllmflow.training.main import main as training_main

    return training_main(argv, run=run_grpo, prog="python -m dllmflow.rl")


if __name__ == "__main__":
    sys.exit(main())
