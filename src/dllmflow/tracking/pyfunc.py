"""The MLflow pyfunc of a registered dllmflow model (logged "from code": MLflow runs this file at load).

    m = mlflow.pyfunc.load_model("models:/dllmflow-tiny-mdlm@champion")
    m.predict(["What is 2 + 3?"])                                   # recorded sampler and settings
    m.predict(["What is 2 + 3?"], params={"steps": 32, "threshold": 0.9})

Artifacts: `checkpoint` (the consolidated HF dir) and `generation` (sampler name + settings recorded at
training/evaluation time). Logged by `dllmflow.tracking.registry.register_model`. The checkpoint's own
code (`auto_map`) runs only if the registering run trusted it (`trust_remote_code` in `generation`,
written at registration), never because of the settings.json inside the checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlflow
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE
from mlflow.pyfunc import PythonModel

from dllmflow.errors import UserError
from dllmflow.tracking.pyfunc_runtime import SPECULATIVE  # DFlash: greedy speculative decoding (lossless)


class InvalidGenerationRequest(MlflowException, UserError):
    """A bad `params` (an unknown sampler, an option the sampler does not take, a bad value): still a
    UserError for Python callers, and an MlflowException so `mlflow models serve` answers HTTP 400 with
    this message (any other exception becomes a generic error whose reason is only in the traceback)."""

    def __init__(self, message: str):
        super().__init__(message, error_code=INVALID_PARAMETER_VALUE)


class DllmGenerator(PythonModel):
    """`predict(prompts)` generates text; `params` may override any setting the sampler takes (another
    one is an error naming it)."""

    def load_context(self, context):
        self.generation = json.loads(Path(context.artifacts["generation"]).read_text())
        trust = bool(self.generation.get("trust_remote_code", False))
        if self.generation["sampler"] == SPECULATIVE:  # a DFlash draft + its frozen target
            from dllmflow.evaluation.acceptance import load_dflash_pair

            target = context.artifacts.get("target") or self.generation.get("target")
            self.pair = load_dflash_pair(
                context.artifacts["checkpoint"], target=target, trust_remote_code=trust
            )
        else:
            from dllmflow.inference.generate import load_for_generation

            self.model, self.tokenizer, _ = load_for_generation(
                context.artifacts["checkpoint"], trust_remote_code=trust
            )

    def predict(self, context, model_input, params=None):
        try:
            return self._predict(model_input, params)
        except UserError as e:
            raise InvalidGenerationRequest(str(e)) from None

    def _predict(self, model_input, params):
        from dllmflow.diffusion.modes import check_sampler
        from dllmflow.tracking.pyfunc_runtime import (
            generate_texts,
            prompts_of,
            speculative_texts,
            split_params,
        )

        sampler, settings, overrides = split_params(self.generation, params)
        registered = self.generation["sampler"]
        if sampler == SPECULATIVE != registered:  # only a DFlash registration loads a draft + target
            raise UserError(
                f"sampler {SPECULATIVE!r} decodes a DFlash draft with its target; this model was "
                f"registered with sampler {registered!r}"
            )
        if sampler != SPECULATIVE:  # the registered sampler or the caller's: it must fit the mode
            check_sampler(self.generation.get("mode"), sampler)
        if sampler == SPECULATIVE:
            options = {**settings, **overrides}
            return speculative_texts(self.pair, prompts_of(model_input), options.get("max_new_tokens", 128))
        return generate_texts(
            self.model,
            self.tokenizer,
            prompts_of(model_input),
            sampler=sampler,
            overrides=overrides,
            **settings,
        )


mlflow.models.set_model(DllmGenerator())
