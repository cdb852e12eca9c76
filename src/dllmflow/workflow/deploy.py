"""Production decorators from the `recipe` Config: @schedule only with a cron, train @resources, tags.

What a flow carries into production, read from its `recipe` Config when the flow is parsed:

* `@schedule(cron=flow.schedule_cron)`, only when a cron is set (Metaflow's `@schedule` with no cron
  means daily, so a recipe without one must not get the decorator at all);
* the train step's `@resources`, placed by the torchx scheduler (`train_step_resources`);
* run tags (`run_tags`): mode, recipe and data hash, added by the steps with `current.run.add_tags`,
  so local runs and Argo runs are tagged alike and the data hash (known after `prepare`) is included.

    @deployment(config="recipe", train_step="train")
    @project(name=config_expr("recipe.flow.project"))
    class FinetuneFlow(FlowSpec):
        recipe = Config("recipe", ...)

`@project` stays a static decorator on the flow (its name from the Config): Metaflow builds the
`--branch` / `--production` options from the decorators the class is written with, so one added here
would have none.

    python flows/finetune.py --config recipe params/x.yaml --with kubernetes argo-workflows create
"""

from __future__ import annotations

from typing import Any

from metaflow import FlowMutator, resources, schedule, user_step_decorator

from dllmflow.settings import Settings


def train_step_resources(settings: Settings) -> dict[str, int]:
    """`@resources` of the step that launches torchx. A cluster scheduler runs the trainers in their
    own pods/jobs (they get `launch.resources` per node), so the step only submits and waits:
    `flow.resources`, no GPU. A local scheduler runs all `launch.nnodes` "nodes" inside the step, so
    the step requests `launch.resources` x nnodes (or `flow.resources` where that is larger)."""
    from dllmflow.errors import UserError
    from dllmflow.training.launch import check_scheduler, is_local_scheduler

    lc, step = settings.launch, settings.flow.resources
    check_scheduler(lc.scheduler)
    if not is_local_scheduler(lc.scheduler):
        if step.gpu:
            raise UserError(
                f"flow.resources.gpu={step.gpu} with launch.scheduler={lc.scheduler!r}: the train step "
                "only submits the torchx job; request the GPUs per node in launch.resources.gpu"
            )
        return {"cpu": step.cpu, "memory": step.memory_mb}
    per_node, n = lc.resources, lc.nnodes
    placed = {
        "cpu": max(step.cpu, per_node.cpu * n),
        "memory": max(step.memory_mb, per_node.memory_mb * n),
        "gpu": max(step.gpu, per_node.gpu * n),
    }
    return {k: v for k, v in placed.items() if v or k != "gpu"}  # gpu=0: no GPU request at all


def run_tags(settings: dict[str, Any], data: dict[str, Any] | None = None) -> list[str]:
    """Metaflow run tags: `mode:<mode>`, `recipe:<name>` and, once prepared, `data:<hash12>`."""
    tags = [f"mode:{settings['dllm']['mode']}", f"recipe:{settings['name']}"]
    if data and data.get("content_hash"):
        tags.append(f"data:{data['content_hash'][:12]}")
    return tags


@user_step_decorator
def lean_exit(step_name, flow, inputs=None, attributes=None):
    """After a step succeeds, `gc.freeze()` the objects its process holds: the process ends right after
    Metaflow saves the artifacts, and the interpreter's final collections over a process that imported
    torch, transformers or MLflow cost 0.5-1 s each (measured: torch + transformers 1.2 -> 0.2 s) that
    would sit between every two tasks. Objects made after it (the artifacts' pickles) are collected as
    usual; a failed step is left alone."""
    import gc

    yield
    gc.freeze()


class deployment(FlowMutator):  # lower case: used as a decorator, like Metaflow's own
    """Adds @schedule (when a cron is set), the train step's @resources from the Config, and `lean_exit`
    to every step."""

    def init(self, config: str = "recipe", train_step: str | None = None):
        self.config, self.train_step = config, train_step

    def pre_mutate(self, mutable_flow) -> None:
        settings = Settings.model_validate(getattr(mutable_flow, self.config).to_dict())
        flow = settings.flow
        if flow.schedule_cron:
            mutable_flow.add_decorator(
                schedule, deco_kwargs={"cron": flow.schedule_cron, "timezone": flow.schedule_timezone}
            )
        for _, each in mutable_flow.steps:
            each.add_decorator(lean_exit, duplicates=each.IGNORE)
        if self.train_step:
            step = getattr(mutable_flow, self.train_step)
            step.add_decorator(
                resources, deco_kwargs=train_step_resources(settings), duplicates=step.OVERRIDE
            )
