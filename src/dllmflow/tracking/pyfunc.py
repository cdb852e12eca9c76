"""The MLflow pyfunc of a registered dllmflow model (logged "from code": MLflow runs this file at load).

    m = mlflow.pyfunc.load_model("models:/dllmflow-tiny-mdlm@champion")
    m.predict(["What is 2 + 3?"])                                   # recorded sampler and settings
    m.predict(["What is 2 + 3?"], params={"steps": 32, "threshold": 0.9})
    m.predict(pd.DataFrame({"prompt": ["What is 2 + 3?"]}))        # one prompt string per row, else refused

Artifacts: `checkpoint` (the consolidated HF dir) and `generation` (sampler name + settings recorded at
training/evaluation time). Logged by `dllmflow.tracking.registry.register_model`. The checkpoint's own
code (`auto_map`) runs only when the caller consents:

    mlflow.pyfunc.load_model(uri, model_config={"trust_remote_code": True})
    DLLMFLOW_TRUST_REMOTE_CODE=1 mlflow models serve -m models:/...     # where no load argument reaches

A version registered with `trust_remote_code: true` (in `generation`) loads only with that consent (a
one-line refusal naming it otherwise); the record, and the settings.json inside the checkpoint, never
turn it on.
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
        from dllmflow.inference.registered import check_recorded_trust
        from dllmflow.inference.resolved import resolve
        from dllmflow.tracking.pyfunc_runtime import TRUST_ENV, caller_trusts

        self.generation = json.loads(Path(context.artifacts["generation"]).read_text())
        trust = caller_trusts(getattr(context, "model_config", None))
        how = f'load it with model_config={{"trust_remote_code": True}} (or {TRUST_ENV}=1)'
        check_recorded_trust(self.generation, trust, "registered model", how)
        checkpoint = resolve(context.artifacts["checkpoint"])  # once, whichever loader reads it
        if self.generation["sampler"] == SPECULATIVE:  # a DFlash draft + its frozen target
            from dllmflow.evaluation.acceptance import load_dflash_pair

            target = context.artifacts.get("target") or self.generation.get("target")
            self.pair = load_dflash_pair(checkpoint, target=target, trust_remote_code=trust)
        else:
            from dllmflow.inference.generate import load_for_generation

            self.model, self.tokenizer, self.trained = load_for_generation(
                checkpoint, trust_remote_code=trust
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
            speculative_texts,
            split_params,
        )

        prompts = prompts_of(model_input)
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
            return speculative_texts(self.pair, prompts, options.get("max_new_tokens", 128))
        return generate_texts(
            self.model,
            self.tokenizer,
            prompts,
            sampler=sampler,
            overrides=overrides,
            trained=self.trained,
            **settings,
        )


# The column of prompts in a DataFrame: `prompt`, or 0 (a list framed by pandas, as the signature of
# versions registered before the input schema was dropped made of a list).
PROMPT_COLUMNS = ("prompt", 0)


def prompts_of(model_input) -> list[str]:
    """The prompts of `model_input`: a string, a list/array of strings, or a DataFrame with one column
    of them (`prompt`, or the unnamed column MLflow makes of a list). Anything else (None, a number, a
    nested list, an extra column, an empty input or prompt) is a UserError naming the row/column, never
    a prompt made of its repr or of its first string."""
    if isinstance(model_input, str):
        rows = [model_input]
    elif hasattr(model_input, "columns"):  # pandas DataFrame
        columns = list(model_input.columns)
        extra = [c for c in columns if c not in PROMPT_COLUMNS] or columns[1:]
        if extra or not columns:
            raise UserError(
                f"unexpected column(s) {extra or columns} in the input: give one column of prompts "
                "(named `prompt`), one prompt string per row"
            )
        rows = model_input[columns[0]].tolist()
    elif isinstance(model_input, list | tuple) or hasattr(model_input, "tolist"):  # numpy arrays
        rows = model_input.tolist() if hasattr(model_input, "tolist") else list(model_input)
    else:
        raise UserError(
            f"input is a {type(model_input).__name__}: give a list of prompt strings or a DataFrame with "
            "a `prompt` column"
        )
    if not rows:
        raise UserError("no prompts in the input: give at least one prompt string")
    for i, row in enumerate(rows):
        if not isinstance(row, str):
            what = "missing (None/NaN)" if row is None or row != row else type(row).__name__  # NaN != NaN
            raise UserError(f"row {i}: {what}, not a prompt string (one prompt string per row)")
        if not row.strip():
            raise UserError(f"row {i}: an empty prompt")
    return rows


mlflow.models.set_model(DllmGenerator())
