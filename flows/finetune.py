"""FinetuneFlow: prepare -> train (torchx/torchrun) -> evaluate (one branch per sampler) -> register.

    python flows/finetune.py --config recipe params/tiny_mdlm.yaml run
    python flows/finetune.py --config recipe params/tiny_mdlm.yaml run --max-steps 20 --eval-limit 8
    python flows/finetune.py resume                      # after a failure: reruns from the failed step
    python flows/finetune.py --config recipe params/tiny_mdlm.yaml card view end

The `recipe` Config is validated by `dllmflow.settings` before any step runs (a typo fails at parse
time, naming the field). Steps are thin: each calls one `dllmflow.workflow.finetune` function and keeps its
small result as an artifact. Production: `argo-workflows create` deploys the same flow on the
`@schedule` from `flow.schedule_cron` (needs a cloud datastore; see infra/argo.md).
"""

from metaflow import Config, FlowSpec, Parameter, card, config_expr, current, resources, retry, schedule, step


@schedule(cron=config_expr("recipe.flow.schedule_cron"))
class FinetuneFlow(FlowSpec):
    # Named `recipe`: Metaflow 2.19 reserves the parameter name `params`.
    recipe = Config(
        "recipe", default="params/tiny_mdlm.yaml", parser="dllmflow.workflow.finetune.parse_params_config"
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
        self.next(self.prepare)

    @step
    def prepare(self):
        from dllmflow.workflow import finetune as workflow

        self.data = workflow.prepare_data(self.settings, force=self.force_prepare)
        self.next(self.train)

    @retry(times=config_expr("recipe.flow.train_retries"))
    @resources(
        cpu=config_expr("recipe.flow.resources.cpu"),
        gpu=config_expr("recipe.flow.resources.gpu"),
        memory=config_expr("recipe.flow.resources.memory_mb"),
    )
    @step
    def train(self):
        from dllmflow.settings import Settings
        from dllmflow.workflow import finetune as workflow

        settings = Settings.coerce(self.settings)
        # A retry (or a resumed flow) continues from the run dir's LATEST checkpoint.
        self.training = workflow.train(settings, self.run_dir)
        self.samplers = workflow.eval_samplers(settings)
        self.next(self.evaluate, foreach="samplers")

    @step
    def evaluate(self):
        from dllmflow.workflow import finetune as workflow

        self.sampler = self.input
        self.eval_result = workflow.evaluate_sampler(self.settings, self.training["run_dir"], self.sampler)
        self.next(self.join)

    @step
    def join(self, inputs):
        self.evals = {inp.sampler: inp.eval_result for inp in inputs}
        self.merge_artifacts(inputs, include=["settings", "run_dir", "data", "training"])
        self.next(self.register)

    @step
    def register(self):
        from dllmflow.workflow import finetune as workflow

        self.registration = workflow.register(
            self.settings,
            self.training["run_dir"],
            self.evals,
            data=self.data,
            training=self.training,
            pathspec=f"{current.flow_name}/{current.run_id}",
        )
        self.next(self.end)

    @card(type="blank", id="report")
    @step
    def end(self):
        from dllmflow.settings import Settings
        from dllmflow.workflow import finetune as workflow

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
        print(workflow.next_steps_message(settings, self.registration, current.pathspec))


if __name__ == "__main__":
    FinetuneFlow()
