"""What `dllmflow evaluate` (accuracy.py) and the lm-eval adapter (harness.py) share: a checkpoint
loaded with one sampler for evaluation, the prompts asked (their ids and digest), and the protocol two
figures must share to compare. How a question is asked and an answer read is the task layer's
(data/task.py), which RL shares; which eval knob a sampler takes is diffusion/samplers/eval_knobs.py.

    loaded = build_eval_runner(checkpoint, settings, sampler="llada")    # model, tokenizer, sampler, settings
    loaded.checkpoint                    # what it resolved to, once (inference/resolved.py): pass it on
    asked = eval_prompts(loaded.tokenizer, prepared_dir, "eval", limit, n_shot)   # ids, in length order

Both evaluators import from here, never from each other.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, ClassVar

from dllmflow.data.task import task_chats
from dllmflow.diffusion.samplers.eval_knobs import SAMPLER_SPECIFIC, cache_modes, eval_defaults, sampler_takes
from dllmflow.errors import UserError
from dllmflow.inference.resolved import ResolvedCheckpoint, resolve

# ---- the protocol two figures must share to compare ---------------------------------------------


@dataclass(frozen=True)
class EvalProtocol:
    """What an exact-match figure was measured on besides the model, as an evaluation records it
    (`result["protocol"]`; a part it does not record is None). One type for both comparisons, each
    a view of it:

      GATE   the champion gate: the rows asked (the split's content, the limit), how they are asked
             (n-shot), how answers are decoded (sampler, its whole setting, length) and read (the parser);
      ARMS   the AR control beside its dLLM: the same prompts (their ids' digest, the chat template, the
             prepared rows) scored alike; the samplers differ by design, so they are not part of it."""

    split_sha256: str | None = None
    limit: int | None = None
    n_shot: int | None = None
    sampler: str | None = None
    sampler_settings: dict | None = None
    max_new_tokens: int | None = None
    answer_parser: str | None = None
    prepared_dir: str | None = None
    split: str | None = None
    chat_template_sha256: str | None = None
    prompts_sha256: str | None = None

    GATE: ClassVar[tuple[str, ...]] = (
        "split_sha256", "limit", "n_shot", "sampler", "sampler_settings", "max_new_tokens", "answer_parser",
    )  # fmt: skip
    ARMS: ClassVar[tuple[str, ...]] = (
        "prepared_dir", "split", "limit", "n_shot", "max_new_tokens", "chat_template_sha256", "prompts_sha256",
        "answer_parser", "split_sha256",
    )  # fmt: skip

    @classmethod
    def of(cls, protocol: dict[str, Any]) -> EvalProtocol:
        """The protocol part of a recorded protocol dict (anything else it holds, e.g. checkpoint or batch
        size, is not part of it)."""
        return cls(**{f.name: protocol.get(f.name) for f in fields(cls)})

    def part(self, keys: tuple[str, ...]) -> dict[str, Any]:
        return {k: getattr(self, k) for k in keys}

    def differing(self, other: EvalProtocol, keys: tuple[str, ...]) -> list[str]:
        """The keys of the view `keys` where `other` differs, in the view's order."""
        return [k for k in keys if getattr(self, k) != getattr(other, k)]


GATE_PROTOCOL = EvalProtocol.GATE  # the gate's view, by its old name (the registry tag's keys)


def split_sha256(prepared_dir: str | Path, split: str) -> str:
    """sha256 of a split's content as asked and scored (each row's id, chat and reference answer, in
    order): equal for the same held-out rows whatever tokenizer the prepared dir was made with."""
    from dllmflow.data.dataset import PreparedDataset

    h = hashlib.sha256()
    for r in PreparedDataset(prepared_dir, split).rows(None):
        h.update(json.dumps([r["id"], r["messages"], r["answer"]], sort_keys=True).encode() + b"\n")
    return h.hexdigest()


def protocol_fingerprint(protocol: dict[str, Any]) -> dict[str, Any]:
    """The gate's view of an evaluation's protocol (None for a part it does not record)."""
    return EvalProtocol.of(protocol).part(EvalProtocol.GATE)


def protocol_differences(candidate: dict[str, Any], champion: dict[str, Any]) -> list[str]:
    """'key: champion -> candidate' for every part of the gate's view that differs."""
    a, b = EvalProtocol.of(candidate), EvalProtocol.of(champion)
    out = []
    for key in a.differing(b, EvalProtocol.GATE):
        mine, theirs = getattr(a, key), getattr(b, key)
        if isinstance(mine, dict) and isinstance(theirs, dict):  # name the sampler options that differ
            keys = sorted(k for k in {*mine, *theirs} if mine.get(k) != theirs.get(k))
            out += [f"{key}.{k}: {theirs.get(k)!r} -> {mine.get(k)!r}" for k in keys]
        else:
            out.append(f"{key}: {theirs!r} -> {mine!r}")
    return out


# ---- the weights an evaluation ran ----------------------------------------------------------------


def checkpoint_record(checkpoint: str | Path | ResolvedCheckpoint) -> dict[str, str | None]:
    """`ResolvedCheckpoint.record` of `checkpoint` (what an evaluation records of the weights it ran);
    one that is not a local dir (a registered model's URI) is recorded as given."""
    from dllmflow.runs import resolve_checkpoint

    if isinstance(checkpoint, ResolvedCheckpoint):
        return checkpoint.record
    try:
        found = resolve_checkpoint(checkpoint)  # only where the weights are: no records read
    except UserError:
        return {"checkpoint": str(checkpoint)}
    return ResolvedCheckpoint(str(checkpoint), found).record


# ---- prompts ------------------------------------------------------------------------------------


def template_hash(tokenizer) -> str:
    template = getattr(tokenizer, "chat_template", None) or ""
    return hashlib.sha256(template.encode()).hexdigest()[:16]


# ---- the checkpoint and its sampler -------------------------------------------------------------


@dataclass
class EvalRunner:
    """A checkpoint loaded for evaluation with one sampler (shared by `evaluate`, the sweep and the
    lm-eval adapter in `harness.py`). settings: the run's Settings or the checkpoint's own (None = neither)."""

    model: Any
    tokenizer: Any
    runner: Any  # a dllmflow.diffusion.samplers Sampler
    settings: Any
    sampler: str
    trained: Any = None  # the checkpoint's own training Settings (settings.json), what samplers match
    checkpoint: ResolvedCheckpoint | None = None  # what was loaded, resolved once (`build_eval_runner`)

    @property
    def eval_cfg(self) -> Any:
        return self.settings.eval if self.settings is not None else None

    def with_overrides(self, overrides: dict[str, Any] | None) -> EvalRunner:
        """The same loaded model with the sampler rebuilt from its preset < settings.eval < `overrides`
        (a sweep point): the model loads once for every setting."""
        runner = build_runner(
            self.model, self.tokenizer, self.settings, self.sampler, overrides, self.trained
        )
        return replace(self, runner=runner)


def build_runner(
    model: Any,
    tokenizer: Any,
    settings: Any,
    sampler: str,
    overrides: dict[str, Any] | None,
    trained: Any = None,
) -> Any:
    """`sampler` on a loaded model, its config from preset < settings.eval < `overrides` (the caller's
    flags or a sweep point: parsed strictly and capped, `inference.generate.flag_config`)."""
    from dllmflow.diffusion.samplers import SAMPLERS
    from dllmflow.inference.generate import flag_config

    defaults = eval_defaults(settings.eval if settings is not None else None, sampler)
    config = flag_config(sampler, overrides or {}, tokenizer, defaults=defaults)
    return SAMPLERS[sampler](
        model, tokenizer, config, mask_id=model.config.mask_token_id, training_settings=trained
    )


def default_eval_sampler(checkpoint: str | Path | ResolvedCheckpoint, settings: Any = None) -> str:
    """What `evaluate` decodes with when no sampler is asked for: the first of the recipe's
    `eval.samplers` that fits the checkpoint's mode (its recorded settings.json, else the recipe's),
    else the checkpoint's own default (its export's, else its mode's first sampler). A recipe whose
    `eval.samplers` has none that fits is refused, naming them and the samplers that fit."""
    return _default_sampler(resolve(checkpoint), settings)


def _default_sampler(resolved: ResolvedCheckpoint, settings: Any) -> str:
    from dllmflow.diffusion.modes import MODES, SamplerMisfitError, check_sampler
    from dllmflow.diffusion.samplers import SAMPLERS

    ckpt, trained = resolved.path, resolved.settings
    mode = (trained or settings).dllm.mode if (trained or settings) is not None else None
    asked = [n for n in (getattr(getattr(settings, "eval", None), "samplers", None) or []) if n in SAMPLERS]
    for name in asked:
        try:
            check_sampler(mode, name)
            return name
        except SamplerMisfitError:
            continue
    if asked:
        fits = ", ".join(MODES[mode].samplers) if mode in MODES else "none"
        raise UserError(
            f"eval.samplers {asked}: none decodes {ckpt} (dllm.mode={mode}); samplers that fit: {fits}. "
            "Pass --sampler or use the recipe the checkpoint was trained with"
        )
    if trained is None and mode in MODES and MODES[mode].default_sampler:  # the recipe's mode
        return MODES[mode].default_sampler
    return resolved.default_sampler


def build_eval_runner(
    checkpoint: str | Path | ResolvedCheckpoint,
    settings: Any = None,
    sampler: str | None = None,
    overrides: dict[str, Any] | None = None,
    device: str | None = None,
) -> EvalRunner:
    """Load `checkpoint` (on `device`, None = cuda if available) and build `sampler` (None:
    `default_eval_sampler`) from its preset < settings.eval < `overrides` (one the sampler does not take
    is an error; `mask_id` picks the mask token). A sampler that does not decode the checkpoint's mode
    is refused before the load, as the server and the pyfunc refuse it. `checkpoint` is resolved once
    (a `ResolvedCheckpoint` is used as it is) and kept as `EvalRunner.checkpoint`."""
    from dllmflow.diffusion.modes import check_sampler
    from dllmflow.inference.generate import load_export, validate_sampler_request

    if sampler:  # an asked sampler is named before the checkpoint is looked for
        validate_sampler_request(sampler)
    ckpt = resolve(checkpoint)
    if not sampler:
        sampler = _default_sampler(ckpt, settings)
        validate_sampler_request(sampler)
    check_sampler(getattr(getattr(ckpt.settings or settings, "dllm", None), "mode", None), sampler)
    overrides = dict(overrides or {})
    if settings is not None:  # before the load: a cache no sampler of the mode can use is refused
        check_eval_settings(settings)
    # A checkpoint's code runs only if the caller trusts it: --trust-remote-code or the settings passed.
    trust = bool(overrides.pop("trust_remote_code", False)) or bool(
        settings and settings.model.trust_remote_code
    )
    model, tokenizer, trained = load_export(
        ckpt,
        mask_id=overrides.pop("mask_id", None),
        adapter=overrides.pop("adapter", None),
        device=device,
        trust_remote_code=trust,
    )
    settings = settings or trained
    runner = build_runner(model, tokenizer, settings, sampler, overrides, trained)
    return EvalRunner(model, tokenizer, runner, settings, sampler, trained, ckpt)


def evaluated_samplers(settings: Any) -> list[str]:
    """The samplers the eval section applies to: `eval.samplers`, else every sampler of the mode (the
    mode's extra evaluations, such as DFlash acceptance, are not samplers and take no sampler setting)."""
    from dllmflow.diffusion.modes import MODES
    from dllmflow.diffusion.samplers import SAMPLERS

    names = settings.eval.samplers or MODES[settings.dllm.mode].samplers
    return [n for n in names if n in SAMPLERS]


def check_eval_settings(settings: Any) -> None:
    """`eval.cache`, `eval.batch_positions` and each `eval.sweep` value must be usable by at least one
    evaluated sampler (the others run without it, as with any eval knob they do not take); else a
    SettingsError naming the field, the mode and what each sampler takes. Torch-free (the sampler
    configs, not the samplers): the flow's recipe parse runs it, and the train step again."""
    from dllmflow.settings import SettingsError

    samplers = evaluated_samplers(settings)
    if not samplers:
        return
    checks = [("eval.cache", "cache", settings.eval.cache)]
    checks += [(f"eval.{k}", k, getattr(settings.eval, k)) for k in SAMPLER_SPECIFIC]
    if settings.eval.sweep is not None:
        checks += [(f"eval.sweep.{k}", k, v) for k, vs in settings.eval.sweep.axes().items() for v in vs]
    for where, key, value in checks:
        if value is None or any(sampler_takes(n, key, value) for n in samplers):
            continue
        if key == "cache":
            takes = "; ".join(f"{n} takes cache: {', '.join(cache_modes(n))}" for n in samplers)
        else:
            takes = f"none of them has a {key} option"
        raise SettingsError(
            f"{where}: {value!r} cannot be used by any sampler evaluated for dllm.mode={settings.dllm.mode} "
            f"({', '.join(samplers)}): {takes}. Drop it or pick a value one of them takes"
        )


def resolve_prepared_dir(checkpoint: str, settings: Any, prepared_dir: str | Path | None) -> Path:
    """The prepared dir an evaluation asks: `prepared_dir`, else the settings' (fetched first when
    `dataset.remote_dir` is set). `checkpoint`: the checkpoint's name, for the message without either."""
    if prepared_dir is None:
        if settings is None:
            raise UserError(
                f"{checkpoint}: no settings.json next to the weights; pass --params or --prepared-dir"
            )
        from dllmflow.data.remote import local_prepared_dir

        prepared_dir = local_prepared_dir(settings)  # fetched here first when dataset.remote_dir is set
    return Path(prepared_dir)


@dataclass
class EvalPrompts:
    """The held-out rows of one evaluation and the prompt ids each is asked with."""

    rows: list[dict]
    chats: list[list[dict]]
    prompts: list[list[int]]  # chat template + generation prompt, token ids
    order: list[int]  # row indices, shortest prompt first (a batch pads little)

    @property
    def sha256(self) -> str:
        """Of the prompt ids asked, in row order: two evaluations with equal digests asked the same."""
        return hashlib.sha256(repr(self.prompts).encode()).hexdigest()[:16]

    def protocol(self) -> dict[str, str]:
        """What an evaluation's protocol records of the prompts it asked."""
        return {"prompts_sha256": self.sha256}


def eval_prompts(
    tokenizer: Any, prepared_dir: Path, split: str, limit: int | None, n_shot: int
) -> EvalPrompts:
    """The first `limit` rows of `split` of the prepared data as prompts of `tokenizer`'s chat template:
    what every evaluator asks (the dLLM samplers, the AR baseline), so their scores compare."""
    from dllmflow.data.dataset import PreparedDataset

    rows = PreparedDataset(prepared_dir, split).rows(limit)
    if not rows:
        raise UserError(f"{prepared_dir}: split {split!r} has no rows to evaluate")
    chats = task_chats(prepared_dir, rows, n_shot)
    prompts = [
        list(tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_dict=False))
        for chat in chats
    ]
    order = sorted(range(len(rows)), key=lambda i: len(prompts[i]))
    return EvalPrompts(rows, chats, prompts, order)
