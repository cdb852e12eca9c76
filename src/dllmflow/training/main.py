"""The training entry point: one process per rank, started by torchrun (or plain python for one rank).

    torchrun --nproc_per_node 2 -m dllmflow.training.main --run-dir RUN [--resume | --overwrite]   # $DLLMFLOW_SETTINGS
    python -m dllmflow.training.main --settings runs/tiny/settings.json          # a single in-process rank

It knows nothing of Metaflow or torchx. The settings come from the launcher, never from a file another
machine wrote: the torchx AppDef (`training.launch.build_app`, for `dllmflow train`, the flow and the
`dllmflow.train` component) carries them inline in $DLLMFLOW_SETTINGS (`settings_env_value`) with
`--run-dir`, so a node needs no shared volume; rank 0 then records them as RUN/settings.json on its disk.
`--settings FILE` reads a settings.json instead (a hand-started rank), its directory the run dir. It runs `Trainer(...).run()` (training/trainer.py): rank 0 holds the
run dir's lock for the whole run, so a second writer fails at once with one line naming the holder's
pid (on every rank). What rank 0 prints on stdout (progress, a resume's fallback `warning:` line)
reaches the terminal of `dllmflow train`, which relays it. A failure prints one line
`[rank N] dllmflow.training.main failed: ...` (plus the traceback for non-user errors) and exits 1, which
the launcher quotes. After an elastic restart (TORCHELASTIC_RESTART_COUNT > 0) it resumes from LATEST
(and `--overwrite` no longer applies: the restart must not delete the checkpoints of its own run).
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from pathlib import Path

from dllmflow.errors import UserError

FAIL_MARKER = "dllmflow.training.main failed:"


def main(argv: list[str] | None = None, *, run=None, prog: str = "python -m dllmflow.training.main") -> int:
    """`run(settings, run_dir, resume=, overwrite=) -> TrainResult`: the loop to run (None = supervised
    `run_training`; dllmflow.rl passes GRPO's)."""
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    parser.add_argument("--settings", help="a settings.json (default: the launcher's $DLLMFLOW_SETTINGS)")
    parser.add_argument(
        "--run-dir", help="where the run writes (default: --settings' dir, else the settings')"
    )
    parser.add_argument("--resume", action="store_true", help="continue from RUN/checkpoints/LATEST")
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="delete RUN's checkpoints and metrics, then train from step 0",
    )
    args = parser.parse_args(argv)
    rank = os.environ.get("RANK", "0")
    try:
        from dllmflow.settings import SETTINGS_ENV, load_settings_env, load_settings_json
        from dllmflow.training.trainer import run_training

        # written by our launcher from the caller's recipe: its plugins are the caller's
        if args.settings:
            settings = load_settings_json(args.settings, import_plugins=True)
        else:
            settings = load_settings_env(os.environ.get(SETTINGS_ENV), import_plugins=True)
        resume = args.resume or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
        default = Path(args.settings).parent if args.settings else settings.resolved_run_dir
        run_dir = Path(args.run_dir or default).resolve()
        result = (run or run_training)(
            settings, run_dir, resume=resume, overwrite=args.overwrite and not resume
        )
        if rank == "0":
            print(f"training done: step {result.final_step}, checkpoint {result.checkpoint_dir}", flush=True)
        return 0
    except Exception as e:  # every rank reports its own failure; torchrun then stops the others
        if not isinstance(e, UserError):
            traceback.print_exc()
        print(f"[rank {rank}] {FAIL_MARKER} {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        from dllmflow.training.distributed import shutdown

        shutdown()


if __name__ == "__main__":
    sys.exit(main())
