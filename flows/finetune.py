"""FinetuneFlow: prepare (planned, one task per data unit, joined) -> train (torchx/torchrun) -> evaluate
(one branch per sampler) -> register.

    python flows/finetune.py run                         # the demo recipe: params/tiny_addition.yaml
    python flows/finetune.py --config recipe params/tiny_mdlm.yaml run --max-steps 20 --eval-limit 8
    python flows/finetune.py resume                      # after a failure: reruns from the failed step
    python flows/finetune.py card get end --id report card.html   # the last run's card as HTML

The `recipe` Config is validated by `dllmflow.settings` before any step runs (a typo fails at parse
time, naming the field). Steps are thin: each calls one `dllmflow.workflow.finetune` function and keeps its
small result as an artifact. Runs are tagged `mode:`, `recipe:` and `data:<hash12>` (add your own with
`--tag`). Production: `argo-workflows create` deploys the same flow under `@project(flow.project)`, on
`@schedule` only when `flow.schedule_cron` is set, with the train step's `@resources` placed by
`launch.scheduler` (`dllmflow.workflow.deploy`; needs a cloud datastore; see infra/argo.md). With
`checkpoint.remote_dir`, evaluate, register and end first restore from the bucket what they read and
their pod's disk lacks (`dllmflow.workflow.restore`), so no step needs the trainers' volume.

With `eval.ar_control` the AR control trains inside the `train` step, not in a step of its own (the
graph does not show it): after the dLLM, or before it for a mode that trains on the control (uno), into
`<run dir>/ar_control`. `train`'s artifact holds it under "ar_control"; it is evaluated as the
`ar_control` branch of `evaluate` and timed beside the dLLM in `register` (workflow/ar_control.py).
"""

from metaflow import Config, FlowSpec, Parameter, card, config_expr, current, project, retry, step

from dllmflow.workflow.deploy import deployment, run_tags


@deployment(config="recipe", train_step="train")
@project(name=config_expr("recipe.flow.project"))
class FinetuneFlow(FlowSpec):
    # Named `recipe`: Metaflow 2.19 reserves the parameter name `params`.
    recipe = Config(
        "recipe", default="params/tiny_addition.yaml", parser="dllmflow.workflow.finetune.parse_params_config"
    )

    max_steps = Parameter(
        "max-steps", type=int, default=0, help="Override train.max_steps (0 = from params)."
    )
    eval_limit = Parameter("eval-limit", type=int, default=0, help="Override eval.limit (0 = from params).")
    force_prepare = Parameter(
        "force-prepare", type=bool, default=False, help="Redo data prep even if unchanged."
    )

    @step
    def start(self):
        from dllmflow.workflow import finetune as workflow

        settings = workflow.resolve_flow_settings(
            dict(self.recipe), max_steps=self.max_steps, eval_limit=self.eval_limit
        )
        # A plain dict (JSON) artifact: each later step validates it once (Settings.coerce).
        self.settings = settings.to_dict()
        self.run_dir = workflow.flow_run_dir(settings, current.origin_run_id or current.run_id)
        # The MLflow run, open from here on: training logs into it live, register adds the evaluations.
        self.mlflow_run_id = workflow.start_tracking(
            settings, pathspec=f"{current.flow_name}/{current.run_id}"
        )
        current.run.add_tags(run_tags(self.settings))
        self.next(self.prepare_plan)

    # Data prep fans out: the plan (DVC repro or reuse, the source cut into units, the tokenizer fitted
    # once), one task per unit (run in parallel; --max-workers locally), and the join `prepare`, which
    # checks every unit's shards against their checksums and swaps the data into place.
    @step
    def prepare_plan(self):
        from dllmflow.workflow import finetune as workflow

        self.data_plan = workflow.plan_data(self.settings, force=self.force_prepare)
        self.data_units = workflow.data_units(self.data_plan)
        self.next(self.prepare_unit, foreach="data_units")

    @retry(times=2)  # a unit killed mid-shard reruns; it rewrites only its own shards
    @step
    def prepare_unit(self):
        from dllmflow.workflow import finetune as workflow

        workflow.prepare_unit(self.settings, self.data_plan, self.input)
        self.next(self.prepare)

    @step
    def prepare(self, inputs):
        from dllmflow.workflow import finetune as workflow

        self.merge_artifacts(inputs, include=["settings", "run_dir", "mlflow_run_id", "data_plan"])
        self.data = workflow.join_data(self.settings, self.data_plan)
        # dataset.remote_dir: later steps and the trainers fetch exactly the set this join published
        self.settings = workflow.pin_published(self.settings, self.data)
        current.run.add_tags(run_tags(self.settings, self.data))
        self.next(self.train)

    # @resources comes from @deployment: the GPUs go where the trainers run (this step or the torchx job).
    @retry(times=config_expr("recipe.flow.train_retries"))
    @step
    def train(self):
        from dllmflow.settings import Settings
        from dllmflow.workflow import finetune as workflow

        settings = Settings.coerce(self.settings)
        # A run resumed from one started before live tracking has no MLflow run yet: register opens one.
        self.mlflow_run_id = getattr(self, "mlflow_run_id", None)
        # Before training: it also checks eval.cache / eval.sweep against these samplers.
        self.samplers = workflow.eval_samplers(settings)
        # A retry (or a resumed flow) continues from the run dir's LATEST checkpoint. The AR control
        # (eval.ar_control) trains here too, in this step: see the module docstring.
        self.training = workflow.train(settings, self.run_dir, mlflow_run_id=self.mlflow_run_id)
        self.next(self.evaluate, foreach="samplers")

    @step
    def evaluate(self):
        from dllmflow.workflow import finetune as workflow
        from dllmflow.workflow.restore import restore_run_dir

        restore_run_dir(self.settings, self.run_dir)  # a pod without the trainers' disk: from the bucket
        self.sampler = self.input
        self.eval_result = workflow.evaluate_sampler(self.settings, self.training["run_dir"], self.sampler)
        self.next(self.register)

    @step
    def register(self, inputs):
        # The join of the sampler branches does the registration: a step less (a task process and
        # its launch, ~2 s of a tiny run); a failure here resumes here.
        from dllmflow.workflow import finetune as workflow
        from dllmflow.workflow.restore import restore_run_dir

        self.evals = {inp.sampler: inp.eval_result for inp in inputs}
        self.merge_artifacts(inputs, include=["settings", "run_dir", "data", "training", "mlflow_run_id"])
        restore_run_dir(self.settings, self.run_dir)
        self.registration = workflow.register(
            self.settings,
            self.training["run_dir"],
            self.evals,
            data=self.data,
            training=self.training,
            pathspec=f"{current.flow_name}/{current.run_id}",
            mlflow_run_id=self.mlflow_run_id,
        )
        self.next(self.end)

    @card(type="blank", id="report")
    @step
    def end(self):
        from dllmflow.settings import Settings
        from dllmflow.workflow import finetune as workflow
        from dllmflow.workflow.restore import restore_run_dir

        restore_run_dir(self.settings, self.run_dir)
        # Again here: a resumed run clones start/prepare, so their tags never reach it.
        current.run.add_tags(run_tags(self.settings, self.data))
        settings = Settings.coerce(self.settings)
        workflow.fill_card(
            current.card["report"],
            settings,
            self.training["run_dir"],
            self.evals,
            self.data,
            self.training,
            self.registration,
        )
        print(
            workflow.next_steps_message(
                settings,
                self.registration,
                current.pathspec,
                evals=self.evals,
                run_dir=self.training["run_dir"],
            )
        )


if __name__ == "__main__":
    FinetuneFlow()
