"""GRPOFlow: start (resolve the SFT parent) -> rl (torchx/torchrun GRPO) -> evaluate (per sampler) -> register -> end.

    python flows/grpo.py --config recipe params/tiny_addition_grpo.yaml run --init-from runs/tiny_addition
    python flows/grpo.py run --init-from models:/dllmflow-tiny-addition@champion --max-steps 20
    python flows/grpo.py card get end --id report card.html

The `recipe` Config is validated by `dllmflow.settings` before any step runs (the `rl:` section's checks
included). `--init-from` (else `rl.init_from`) names the supervised parent: a run dir, an export or a
registered model; the registered GRPO version carries it as `parent_*` tags. Evaluation, the gate
against the current champion and the card are the fine-tune flow's (the card adds the reward and
held-out accuracy curves; the results table's "EM untrained" column is the parent's exact match here).
Steps are thin: each calls one `dllmflow.workflow.grpo` function; with `checkpoint.remote_dir`, evaluate,
register and end first restore from the bucket what their pod's disk lacks (`dllmflow.workflow.restore`).
"""

from metaflow import Config, FlowSpec, Parameter, card, config_expr, current, project, retry, step

from dllmflow.workflow.deploy import deployment, run_tags


@deployment(config="recipe", train_step="rl")
@project(name=config_expr("recipe.flow.project"))
class GRPOFlow(FlowSpec):
    recipe = Config(
        "recipe",
        default="params/tiny_addition_grpo.yaml",
        parser="dllmflow.workflow.finetune.parse_params_config",
    )
    init_from = Parameter(
        "init-from", default="", help="Starting model (run dir, export, models:/...); '' = rl.init_from."
    )
    max_steps = Parameter(
        "max-steps", type=int, default=0, help="Override train.max_steps (0 = from params)."
    )
    eval_limit = Parameter("eval-limit", type=int, default=0, help="Override eval.limit (0 = from params).")

    @step
    def start(self):
        from dllmflow.workflow import finetune, grpo

        settings, self.parent, self.mlflow_run_id = grpo.start(
            dict(self.recipe), init_from=self.init_from, max_steps=self.max_steps, eval_limit=self.eval_limit,
            pathspec=f"{current.flow_name}/{current.run_id}",
        )  # fmt: skip
        self.settings = settings.to_dict()
        self.run_dir = finetune.flow_run_dir(settings, current.origin_run_id or current.run_id)
        current.run.add_tags(run_tags(self.settings))
        self.next(self.rl)

    @retry(times=config_expr("recipe.flow.train_retries"))
    @step
    def rl(self):
        from dllmflow.workflow import finetune, grpo

        self.samplers = finetune.eval_samplers(self.settings)
        # A retry (or a resumed flow) continues from the run dir's LATEST checkpoint.
        self.training = grpo.train(
            self.settings, self.run_dir, parent=self.parent, mlflow_run_id=self.mlflow_run_id
        )
        self.next(self.evaluate, foreach="samplers")

    @step
    def evaluate(self):
        from dllmflow.workflow import grpo
        from dllmflow.workflow.restore import restore_run_dir

        restore_run_dir(self.settings, self.run_dir)  # a pod without the trainers' disk: from the bucket
        self.sampler = self.input
        self.eval_result = grpo.evaluate(self.settings, self.training["run_dir"], self.sampler)
        self.next(self.register)

    @step
    def register(self, inputs):
        from dllmflow.workflow import grpo
        from dllmflow.workflow.restore import restore_run_dir

        self.evals = {inp.sampler: inp.eval_result for inp in inputs}
        self.merge_artifacts(inputs, include=["settings", "run_dir", "training", "parent", "mlflow_run_id"])
        restore_run_dir(self.settings, self.run_dir)
        self.registration = grpo.register(
            self.settings, self.training["run_dir"], self.evals, training=self.training,
            pathspec=f"{current.flow_name}/{current.run_id}", mlflow_run_id=self.mlflow_run_id,
        )  # fmt: skip
        self.next(self.end)

    @card(type="blank", id="report")
    @step
    def end(self):
        from dllmflow.workflow import finetune, grpo
        from dllmflow.workflow.restore import restore_run_dir

        restore_run_dir(self.settings, self.run_dir)
        grpo.fill_card(
            current.card["report"], self.settings, self.training["run_dir"], self.evals, self.training,
            self.registration,
        )  # fmt: skip
        print(
            finetune.next_steps_message(self.settings, self.registration, current.pathspec, evals=self.evals)
        )


if __name__ == "__main__":
    GRPOFlow()
