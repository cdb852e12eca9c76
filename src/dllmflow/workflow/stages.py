"""Where each training run of a flow run lives: its stages' run dirs (one, or a curriculum's) and their
`checkpoint.remote_dir` prefixes, as the train step launches them and the steps after it read them back
(workflow/restore.py), and the AR control's (`<flow run>/ar_control`). Plain functions of the settings.

    from dllmflow.workflow.stages import training_stages, control_settings, control_stages
    [st.checkpoint.remote_dir for st in training_stages(settings, "runs/tiny_idlm/flow-7")]
"""

from __future__ import annotations

from pathlib import Path

from dllmflow.settings import Settings
from dllmflow.workflow import ar_control


def training_stages(s: Settings, run_dir: str) -> list[Settings]:
    """Each training stage's settings as `train` launches them (one, or a curriculum's): its run dir
    under `run_dir` and its `checkpoint.remote_dir` prefix (workflow/restore.py reads them back)."""
    from dllmflow.diffusion.strategies import STRATEGIES

    stages = STRATEGIES[s.dllm.mode].training_stages(s.with_run_dir(run_dir))
    return [with_remote_run(st, run_dir) for st in stages]


def with_remote_run(stage: Settings, flow_dir: str) -> Settings:
    """`checkpoint.remote_dir` names the recipe's prefix in the object store; each flow run (and each
    curriculum stage) mirrors under its own sub-prefix, as its local run dir sits under `runs/<name>`."""
    remote = stage.checkpoint.remote_dir
    if not remote:
        return stage
    rel = Path(stage.resolved_run_dir).absolute().relative_to(Path(flow_dir).absolute().parent)
    checkpoint = stage.checkpoint.model_copy(update={"remote_dir": f"{remote.rstrip('/')}/{rel.as_posix()}"})
    return stage.model_copy(update={"checkpoint": checkpoint})


def control_settings(s: Settings, run_dir: str) -> Settings:
    """The AR control's settings (`ar_control.control_settings`), mirrored under this flow run's prefix
    (`<checkpoint.remote_dir>/flow-<id>/ar_control`): never a prefix another flow run of the recipe shares,
    whose finished control a new run would otherwise take for its own."""
    return ar_control.control_settings(with_remote_run(s.with_run_dir(run_dir), run_dir), run_dir)


def control_stages(s: Settings, run_dir: str) -> list[Settings]:
    """The AR control's stages (one) as `train` launches them: in `<run_dir>/ar_control`, under its prefix."""
    return training_stages(control_settings(s, run_dir), str(ar_control.control_dir(run_dir)))
