"""What a registered model does at `predict` (the glue `tracking/pyfunc.py` calls): split the call's
params into the sampler, the recorded settings and the caller's overrides, and generate, with a
diffusion sampler or (DFlash) speculative decoding. Also the MLflow signature those params come from,
which registration logs.

    sampler, settings, overrides = split_params(generation, params)   # generation.json + predict params
    texts = generate_texts(model, tokenizer, prompts, sampler=sampler,      # prompts: pyfunc.prompts_of
                           overrides=overrides, trained=trained, **settings)   # trained: load_for_generation's

Whether the sampler may decode the registered mode is `diffusion.modes.check_sampler` (an error here:
a served model must not answer with a sampler that decodes another mode's model).
"""

from __future__ import annotations

from typing import Any

SPECULATIVE = "acceptance"  # the DFlash evaluation/decoding: greedy speculative decoding (lossless)


def generate_texts(
    model: Any,
    tokenizer: Any,
    prompts: list[str],
    *,
    sampler: str = "llada",
    overrides: dict[str, Any] | None = None,
    trained: Any = None,
    **settings: Any,
) -> list[str]:
    """Chat-templated prompts -> generated texts with `sampler`: its preset, then the recorded
    `settings` (knobs it does not take are dropped: models registered before the per-sampler configs
    recorded every knob of every sampler), then the caller's `overrides` (one it does not take is an
    error naming it). A sampler that does not fit the checkpoint's training mode, or prompts + new
    tokens beyond the model's positions, are refused; so are overrides of the wrong type or beyond their
    caps (`steps` past the generation length: `diffusion.samplers.asked`)."""
    import torch

    from dllmflow.diffusion.modes import check_sampler
    from dllmflow.diffusion.samplers import SAMPLERS
    from dllmflow.diffusion.samplers.asked import build_asked_config
    from dllmflow.inference.generate import decode_response, encode_prompt, validate_sampler_request
    from dllmflow.models.limits import check_generation_fits

    validate_sampler_request(sampler)
    check_sampler(getattr(getattr(trained, "dllm", None), "mode", None), sampler)
    config = build_asked_config(sampler, overrides, tokenizer, defaults=settings)  # strict, then capped
    torch.manual_seed(config.seed)
    runner = SAMPLERS[sampler](
        model, tokenizer, config, mask_id=model.config.mask_token_id, training_settings=trained
    )
    ids = [encode_prompt(tokenizer, p) for p in prompts]
    check_generation_fits(model, max(map(len, ids), default=0), config.max_new_tokens, runner.mask_id)
    result = runner.generate(ids)
    return [decode_response(tokenizer, seq) for seq in result.sequences]


TRUST_ENV = "DLLMFLOW_TRUST_REMOTE_CODE"  # the pyfunc's consent where no load argument reaches it


def caller_trusts(model_config: dict[str, Any] | None) -> bool:
    """The caller's consent to run a registered checkpoint's own code: `trust_remote_code` in the
    `model_config` of `mlflow.pyfunc.load_model(uri, model_config={"trust_remote_code": True})`, else
    ${TRUST_ENV}=1 (for `mlflow models serve`). Never the registered record."""
    import os

    given = (model_config or {}).get("trust_remote_code")
    if given is not None:
        return given is True or str(given).lower() in ("1", "true")
    return os.environ.get(TRUST_ENV, "").lower() in ("1", "true")


def recorded_params(sampler: str, sampler_settings: dict[str, Any]) -> dict[str, Any]:
    """What a registered model generates with (its signature's param defaults): the sampler and its
    preset under the recorded settings."""
    from dllmflow.diffusion.samplers.configs import build_sampler_config  # torch-free: register calls this

    if sampler == SPECULATIVE:
        return {"sampler": sampler, **sampler_settings}
    preset = build_sampler_config(sampler, defaults=sampler_settings).model_dump()
    return {"sampler": sampler, **sampler_settings, **preset}


def split_params(generation: dict[str, Any], params: dict[str, Any] | None) -> tuple[str, dict, dict]:
    """One `predict` call's (sampler, recorded settings, the caller's overrides). MLflow fills each param
    the caller left out with its signature default (the recorded value), so only a value that differs
    from the record is the caller's own, checked strictly against the sampler's options."""
    recorded = generation.get("sampler_settings", {})
    params = from_param_sentinels(params or {})
    base = recorded_params(generation["sampler"], recorded)
    overrides = {k: v for k, v in params.items() if base.get(k) != v}
    sampler = overrides.pop("sampler", None) or generation["sampler"]
    params.pop("sampler", None)
    return sampler, {**recorded, **params}, overrides


def speculative_texts(pair: tuple, prompts: list[str], max_new_tokens: int) -> list[str]:
    """DFlash: greedy speculative decoding with the draft against its frozen target (same text as the
    target's own greedy decoding, fewer target forwards)."""
    from dllmflow.evaluation.acceptance import speculative_generate
    from dllmflow.inference.generate import decode_response, encode_prompt

    draft, target, tokenizer, _, cfg = pair
    mask_id = cfg.mask_token_id if cfg.mask_token_id is not None else tokenizer.mask_token_id
    out = []
    for prompt in prompts:
        result = speculative_generate(
            draft,
            target,
            encode_prompt(tokenizer, prompt),
            int(max_new_tokens),
            int(cfg.block_size),
            list(cfg.target_layer_ids),
            mask_id,
            tokenizer.eos_token_id,
        )
        out.append(decode_response(tokenizer, result.tokens))
    return out


# MLflow params need a typed default; a sampler knob that is unset (None) travels as this sentinel.
_UNSET = {"long": -1, "double": -1.0, "string": ""}
_PARAM_TYPES = {
    "sampler": "string",
    "steps": "long",
    "max_new_tokens": "long",
    "block_size": "long",
    "temperature": "double",
    "threshold": "double",
    "remasking": "string",
    "cache": "string",  # none | exact | prefix | dual, each sampler its modes; another is refused (HTTP 400)
    "seed": "long",
}


def from_param_sentinels(params: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in params.items() if k in _PARAM_TYPES and v != _UNSET[_PARAM_TYPES[k]]}


def build_signature(sampler: str, sampler_settings: dict[str, Any]):
    from mlflow.models import ModelSignature
    from mlflow.types.schema import ColSpec, ParamSchema, ParamSpec, Schema

    recorded = recorded_params(sampler, sampler_settings)
    params = []
    for name, dtype in _PARAM_TYPES.items():
        value = recorded.get(name)
        params.append(ParamSpec(name, dtype, _UNSET[dtype] if value is None else value))
    # No input schema: MLflow's column enforcement kept the first column of a nested list (`[["a", "b"]]`
    # answered "a"); `pyfunc.prompts_of` checks the input as given, refusing what is not one prompt per row.
    return ModelSignature(
        inputs=None,
        outputs=Schema([ColSpec("string", "text")]),
        params=ParamSchema(params),
    )
