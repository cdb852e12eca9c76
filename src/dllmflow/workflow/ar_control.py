"""The AR control arm of the finetune flow (`eval.ar_control`): the base causal LM fine-tuned next-token
(mode `ar`) on the run's own prepared rows, beside the dLLM, and the side by side of the two.

    control = train(ar_control.control_settings(settings, run_dir), ar_control.control_dir(run_dir))
    export = resolve_run(ar_control.arm_dir(run_dir, "ar_control"))   # the control's, with its training
    result = ar_control.evaluate_control(settings, export, "ar_control")     # the `ar_control` evaluation
    side = ar_control.comparison(settings, run_dir, evals, "llada")   # register: speeds, dLLM vs control
    print(card.comparison_table(side))                       # (workflow/card.py: its tables)

The control's settings are the run's with `dllm: {mode: ar}` (the mask id kept: the same tokenizer and
embedding rows), its own run dir `<flow run>/ar_control`, the step budget of `eval.ar_control.steps`
(default `train.max_steps`) and of the eval section only `CONTROL_EVAL`; the model, LoRA, optimizer,
schedule, batch sizes, seed, data and launch are the run's. It is evaluated with the run's own eval
section (same prompts, limit, generation length, batch size, answer parser: `evaluation/control.py`).

Where it runs in the flow: inside the `train` step (`workflow.finetune.train`, after the dLLM, or before
it for a mode that trains on the control), not in a step of its own; its evaluation is the `ar_control`
branch of `evaluate`, its speed is timed in `register` (`comparison`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dllmflow import runs
from dllmflow.inference.resolved import ResolvedCheckpoint
from dllmflow.settings import Settings, deep_merge
from dllmflow.settings.pipeline import AR_CONTROL

CONTROL_DIR = AR_CONTROL  # <flow run dir>/ar_control

# The eval fields the control's settings keep from the run's: what is asked, how it is scored, and the
# knobs the `ar` sampler takes. Everything else (the dLLM samplers' knobs, the sweep, the baselines,
# `ar_control` itself) stays at its default, so a new dLLM knob needs no entry here.
CONTROL_EVAL = ("split", "limit", "max_new_tokens", "n_shot", "batch_size", "seed", "temperature")


def enabled(settings: Settings) -> bool:
    """`eval.ar_control` is on and this is a fine-tune (a GRPO run, `rl:`, has no control arm: its
    recipe may share the eval section of the fine-tune it starts from)."""
    control = settings.eval.ar_control
    return control is not None and control.enabled and settings.rl is None


def flow_dir(run_dir: str | Path) -> Path:
    """The flow run's dir from a training run dir (a curriculum's last stage dir is below it)."""
    path = Path(run_dir)
    return path.parent if path.name.startswith(runs.STAGE_PREFIX) else path


def control_dir(run_dir: str | Path) -> Path:
    return flow_dir(run_dir) / CONTROL_DIR


def control_settings(settings: Settings, run_dir: str | Path) -> Settings:
    """The AR control's settings: the run's, trained causally into `control_dir(run_dir)`. Its eval
    section keeps `CONTROL_EVAL` of the run's and leaves every other field at its default."""
    s = settings
    update = {
        "dllm": {"mode": "ar", "mask_token_id": s.dllm.mask_token_id},
        "train": {"max_steps": s.eval.ar_control.steps or s.train.max_steps},
        "run_dir": str(control_dir(run_dir)),
        "dataset": {"packing": False},  # a causal read of a packed row would cross documents
        "dflash": None,
    }
    data = s.to_dict()
    data["dllm"] = {}  # the dLLM mode's own fields do not carry over
    data["eval"] = {k: v for k, v in data["eval"].items() if k in CONTROL_EVAL}
    return Settings.model_validate(deep_merge(data, update))


def on_control(settings: Settings, control_export: str | Path, remote_dir: str | None = None) -> Settings:
    """The run's settings with the control's export as its model (a mode that trains on top of the
    control, `trains_on_control`: uno's drafting adapter); its tokenizer stays the recipe's (the same
    files: the control is the recipe's model fine-tuned). `remote_dir`: the control's
    `checkpoint.remote_dir`, where a trainer whose disk lacks the export fetches it (`model.remote_dir`)."""
    model = settings.model.model_copy(
        update={"pretrained_model_name_or_path": str(control_export), "tiny": None, "remote_dir": remote_dir}
    )
    return settings.model_copy(update={"model": model})


def arm_dir(run_dir: str | Path, evaluation: str) -> Path:
    """The run dir whose export `evaluation` decodes: the control's for the `ar_control` evaluation, else
    the run's own."""
    return control_dir(run_dir) if evaluation == AR_CONTROL else Path(run_dir)


def evaluate_control(settings: Settings, checkpoint: ResolvedCheckpoint, evaluation: str) -> dict[str, Any]:
    """The `ar_control` evaluation of the control's export (`arm_dir`, resolved by the caller): decoded by
    the `ar` sampler, asked and scored with the run's own eval section (so as the dLLM is), its training
    beside (its speed: `comparison`)."""
    from dllmflow.evaluation.accuracy import evaluate

    result = evaluate(checkpoint, settings=settings, sampler="ar", limit=settings.eval.limit)
    result["training"] = checkpoint.training
    result["model"] = (
        f"AR control: {settings.model.pretrained_model_name_or_path or 'the tiny base'} fine-tuned next-token"
    )
    return result


def comparison(
    settings: Settings, run_dir: str, evals: dict[str, dict[str, Any]], gated: str
) -> dict[str, Any] | None:
    """The dLLM (`gated`) vs the AR control (evaluation/control.py), or None without the control. First
    both arms' speed into their results: the gated sampler at the setting it is registered at and the
    AR control, loaded side by side in this one process and timed interleaved
    (`evaluation.speed.measure_speeds`). Not in the evaluation tasks: the flow runs those in parallel,
    so a figure taken there depends on what else ran beside it (measured: the demo's AR control read
    0.30 s per answer there, 0.011 s alone)."""
    from dllmflow.evaluation.control import compare_arms
    from dllmflow.evaluation.speed import speeds_of
    from dllmflow.evaluation.sweep import chosen_setting

    if not enabled(settings) or AR_CONTROL not in evals or gated not in evals:
        return None
    arms = {
        gated: (runs.find_consolidated(run_dir), gated, chosen_setting(evals[gated])),
        AR_CONTROL: (runs.find_consolidated(control_dir(run_dir)), "ar", None),
    }
    for name, speed in speeds_of(arms, settings).items():
        evals[name]["metrics"].update(speed)
    return compare_arms(gated, evals[gated], evals[AR_CONTROL], identity=settings.dllm.trains_on_control)
