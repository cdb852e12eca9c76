"""Test-only fault injection: kill a training run right after step N (after its checkpoint).

The product never reads a fault-injection variable; the Trainer only runs the hooks it is given in
code. In-process tests pass the hook:

    from _plugins.fault_hooks import FailAfterStep
    run_training(settings, run_dir, hooks=[FailAfterStep(2)])

Subprocess tests (`dllmflow train` -> torchx -> torchrun -> ranks, Metaflow steps) cannot pass code, so
`with_fault_env` puts this directory first on the child's PYTHONPATH (inherited by torchx's local
scheduler, torchrun's workers and Metaflow's step processes) with DLLM_TEST_FAIL_AT_STEP (and
DLLM_TEST_FAIL_RANK); its `sitecustomize.py` then registers the hook on the Trainer from outside.

Stdlib only: sitecustomize imports it in every child interpreter.
"""

from __future__ import annotations

import os
from pathlib import Path

FAIL_AT_STEP_ENV = "DLLM_TEST_FAIL_AT_STEP"
FAIL_RANK_ENV = "DLLM_TEST_FAIL_RANK"
FAIL_KILL_ENV = "DLLM_TEST_FAIL_KILL"  # "1": die by SIGKILL (kill -9: no exception, no cleanup) instead
PLUGIN_DIR = Path(__file__).resolve().parent


class FailAfterStep:
    """A Trainer hook (duck-typed `after_step`) raising after step `step` on every rank, or on `rank`."""

    def __init__(self, step: int, rank: int | None = None, kill: bool = False) -> None:
        self.step, self.rank, self.kill = step, rank, kill

    def after_step(self, trainer, step: int) -> None:
        if step == self.step and self.rank in (None, trainer.info.rank):
            if self.kill:
                import signal

                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError(f"injected failure after step {step} ({FAIL_AT_STEP_ENV}={self.step})")


def with_fault_env(
    env: dict[str, str], fail_at: int | None = None, rank: int | None = None, kill: bool = False
) -> dict[str, str]:
    """A copy of `env` whose children load the plugin; with `fail_at`, they fail after that step
    (`kill`: by SIGKILL, as `kill -9` would)."""
    env = {k: v for k, v in env.items() if k not in (FAIL_AT_STEP_ENV, FAIL_RANK_ENV, FAIL_KILL_ENV)}
    if fail_at is not None:
        env[FAIL_AT_STEP_ENV] = str(fail_at)
        if rank is not None:
            env[FAIL_RANK_ENV] = str(rank)
        if kill:
            env[FAIL_KILL_ENV] = "1"
    parts = [str(PLUGIN_DIR)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(parts)
    return env


def hook_from_env() -> FailAfterStep | None:
    """The hook the test asked a child process for, or None."""
    step = os.environ.get(FAIL_AT_STEP_ENV)
    if not step:
        return None
    rank = os.environ.get(FAIL_RANK_ENV)
    return FailAfterStep(int(step), int(rank) if rank else None, kill=os.environ.get(FAIL_KILL_ENV) == "1")
