"""The settings root and `load_settings`: YAML files + env + overrides -> one frozen, validated `Settings`.

Precedence (highest first): keyword overrides > env (`DLLMFLOW_` prefix, `__` nesting, e.g.
`DLLMFLOW_TRAIN__LR=1e-4`) > YAML files (later override earlier, deep-merged) > code defaults.
Any failure raises `SettingsError` whose message names the dotted field and where it came from:

    from dllmflow.settings import load_settings
    s = load_settings("params/tiny_mdlm.yaml", train={"max_steps": 5})
    s.write_json("runs/x/settings.json")      # what the torchrun entry point reads back

Imports no torch.
"""

from __future__ import annotations

import base64
import contextlib
import contextvars
import gzip
import importlib
import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from dllmflow.common.files import atomic_write_json
from dllmflow.errors import UserError

from .dllm import DFlashSection, DLLMConfig, MDLMConfig
from .pipeline import EvalConfig, FlowConfig, RegenerateConfig, RegistryConfig
from .rl import RLConfig, check_lockstep_rollouts, check_rl_mode, import_reward
from .sections import (
    MAX_MICRO_BATCH_TOKENS,
    CheckpointConfig,
    DatasetConfig,
    DistributedConfig,
    LaunchConfig,
    ModelConfig,
    PeftSection,
    SafeName,
    TinyModelConfig,
    TokenizerConfig,
    TrainConfig,
)

ENV_PREFIX = "DLLMFLOW_"
ENV_DELIMITER = "__"
SETTINGS_ENV = "DLLMFLOW_SETTINGS"  # the trainers' settings, inline in their AppDef (settings_env_value)

# The merged YAML of the load in progress; pydantic-settings asks sources for data with no arguments.
_YAML_DATA: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar("_YAML_DATA", default=None)
# The one switch for importing `plugins` and user reward modules while settings validate. Off unless a
# caller turns it on: the loads of the caller's own recipe, overrides and env (`_load`), and the torchrun
# entry reading the settings.json its own launcher wrote. A dict or settings.json validated any other way
# (`Settings.coerce`, `model_validate`, a checkpoint's or export's file) keeps them as data.
_IMPORT_PLUGINS: contextvars.ContextVar[bool] = contextvars.ContextVar("_IMPORT_PLUGINS", default=False)


@contextlib.contextmanager
def importing_plugins(on: bool = True) -> Iterator[None]:
    """Settings validated inside the block import their `plugins` and user reward modules (`on`)."""
    token = _IMPORT_PLUGINS.set(on)
    try:
        yield
    finally:
        _IMPORT_PLUGINS.reset(token)


class SettingsError(UserError, ValueError):
    """A settings file, env var or override is invalid; the message names the field and its origin."""


class _YamlSource(PydanticBaseSettingsSource):
    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return (_YAML_DATA.get() or {}).get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        return dict(_YAML_DATA.get() or {})


class Settings(BaseSettings):
    """Everything one run needs. Frozen: resolved once, written to `settings.json`, passed along."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_nested_delimiter=ENV_DELIMITER,
        extra="forbid",
        frozen=True,
        nested_model_default_partial_update=True,
    )

    name: SafeName = Field("tiny", description="Run/recipe name (dir and MLflow names).")
    run_dir: str | None = Field(
        None, description="Where checkpoints, logs and settings.json go; None = runs/<name>."
    )
    # Validated before `dllm` (pydantic validates fields in definition order), so a mode a plugin
    # registers is known when `dllm.mode` is checked. Imported only from the caller's own recipe,
    # overrides or env, and by the torchrun entry from the settings.json its launcher wrote; a
    # checkpoint's or export's settings.json never imports anything. See docs/adding_a_mode.md.
    plugins: list[str] = Field(
        default_factory=list,
        description="Modules imported before validation, e.g. ones registering a mode (`register_mode`).",
    )
    model: ModelConfig = Field(default_factory=lambda: ModelConfig(tiny=TinyModelConfig()))
    tokenizer: TokenizerConfig = Field(default_factory=TokenizerConfig)
    dataset: DatasetConfig = Field(default_factory=DatasetConfig)
    dllm: DLLMConfig = Field(default_factory=MDLMConfig)
    dflash: DFlashSection | None = None
    train: TrainConfig = Field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)
    launch: LaunchConfig = Field(default_factory=LaunchConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    registry: RegistryConfig = Field(default_factory=RegistryConfig)
    flow: FlowConfig = Field(default_factory=FlowConfig)
    regenerate: RegenerateConfig = Field(default_factory=RegenerateConfig)
    peft: PeftSection | None = Field(None, description="LoRA adapters; the section's presence enables them.")
    rl: RLConfig | None = Field(None, description="GRPO stage (`dllmflow rl`); None = supervised training.")

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings, env_settings, _YamlSource(settings_cls))

    @field_validator("plugins")
    @classmethod
    def _import_plugins(cls, plugins: list[str]) -> list[str]:
        if not _IMPORT_PLUGINS.get():
            return plugins
        for name in plugins:
            try:
                importlib.import_module(name)
            except ImportError as e:
                raise ValueError(
                    f"cannot import plugin {name!r} ({e}); put its directory on PYTHONPATH or install its package"
                ) from None
        return plugins

    @field_validator("rl")
    @classmethod
    def _import_user_rewards(cls, rl: RLConfig | None) -> RLConfig | None:
        """A user's reward ("module:attr") imports, under the switch that guards `plugins`: never from a
        recorded settings.json (a checkpoint's, an export's)."""
        if rl is not None and _IMPORT_PLUGINS.get():
            for name in rl.user_rewards():
                try:
                    import_reward(name)
                except ValueError as e:
                    raise ValueError(f"rl.rewards: {e}") from None
        return rl

    @model_validator(mode="after")
    def _cross_section_rules(self) -> Settings:
        if self.dllm.mode == "dflash" and self.dflash is None:
            raise ValueError(
                "dflash: section required when dllm.mode is dflash (needs dflash.target_model_id)"
            )
        self.dataset.check_packing(self.dllm)
        self.dllm.check_eval(self.eval)
        self.dllm.check_sections(self)
        if self.eval.ar_control is not None:
            self.eval.ar_control.check(self.dllm, self.model)
        if self.eval.ar_baseline and self.dllm.mode == "ar":
            raise ValueError(
                "eval.ar_baseline: dllm.mode=ar is the AR model itself, evaluated as `ar`; use "
                "eval.untrained_baseline for its before"
            )
        world = self.launch.nnodes * self.launch.nproc_per_node
        check_rl_mode(self.rl, self.dllm, world)
        check_lockstep_rollouts(self.rl, self.distributed.strategy, world)
        micro = self.train.local_batch_size * self.dataset.seq_length
        if micro > MAX_MICRO_BATCH_TOKENS:  # each bound alone is sane; one forward of both is not
            raise ValueError(
                f"train.local_batch_size x dataset.seq_length = {micro} tokens in one forward, above "
                f"{MAX_MICRO_BATCH_TOKENS}: lower train.local_batch_size (gradient accumulation keeps the "
                "global batch)"
            )
        gbs, lbs = self.train.global_batch_size, self.train.local_batch_size
        if gbs % (lbs * world) and self.rl is None:  # GRPO's batch is rl.prompts_per_step x G
            raise ValueError(
                f"train.global_batch_size ({gbs}) must be a multiple of local_batch_size x world size ({lbs} x {world})"
            )
        return self

    @classmethod
    def coerce(cls, value: Settings | Mapping[str, Any], *, import_plugins: bool = False) -> Settings:
        """A `Settings` as is; a dict (a Metaflow artifact) validated once. Call it where a dict crosses
        into the library (the top of a flow step), then pass `Settings` down. Its `plugins` and reward
        modules are data unless `import_plugins` (only for a dict this process's caller wrote: a
        recorded dict must not run code here; the flow's own recipe parse imported them already)."""
        if isinstance(value, cls):
            return value
        try:
            with importing_plugins(import_plugins):
                return cls.model_validate(value)
        except ValidationError as e:
            raise SettingsError(format_validation_error(e, {})) from None

    # ---- derived values -------------------------------------------------------------------------
    @property
    def resolved_run_dir(self) -> Path:
        return Path(self.run_dir or f"runs/{self.name}")

    def with_run_dir(self, run_dir: str | os.PathLike) -> Settings:
        """These settings recording `run_dir`, the dir a run actually writes to (unchanged when the
        recorded one already resolves there), so settings.json, metrics and MLflow params name it."""
        if Path(run_dir).absolute() == self.resolved_run_dir.absolute():
            return self
        return self.model_copy(update={"run_dir": str(run_dir)})

    @property
    def world_size(self) -> int:
        return self.launch.nnodes * self.launch.nproc_per_node

    @property
    def grad_accum_steps(self) -> int:
        return self.train.global_batch_size // (self.train.local_batch_size * self.world_size)

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def write_json(self, path: str | os.PathLike) -> Path:
        """Write atomically (tmp + rename) so a reader never sees half a file."""
        return atomic_write_json(path, self.to_dict())

    def flat(self) -> dict[str, Any]:
        """Dotted-key view (MLflow params)."""
        return _flatten(self.to_dict())


# ---- loading ------------------------------------------------------------------------------------


def load_settings(*yaml_paths: str | os.PathLike, **overrides: Any) -> Settings:
    """Load and validate. `overrides` take nested dicts (`train={"lr": 1e-4}`) or dotted keys
    (`**{"train.lr": 1e-4}`)."""
    return _load([(str(p), read_yaml(p)) for p in yaml_paths], overrides)


def load_settings_with_origins(
    *yaml_paths: str | os.PathLike, **overrides: Any
) -> tuple[Settings, dict[str, str]]:
    """`load_settings`, plus where each leaf value came from (`dllmflow config show`): dotted key ->
    "default", the YAML path, "env DLLMFLOW_TRAIN__LR" or "override". Later sources win, as in the load."""
    documents = [(str(p), read_yaml(p)) for p in yaml_paths]
    settings = _load(documents, overrides)
    given = _origins(documents, _expand_dotted(overrides), leaves_only=True)
    shown = {}
    for key in _flatten(settings.to_dict()):
        probe = key  # a value set whole (a list, a section from one env var) marks every leaf below it
        while probe and probe not in given:
            probe = probe.rpartition(".")[0]
        shown[key] = given[probe] if probe else "default"
    return settings, {k: "override" if v == "overrides" else v for k, v in shown.items()}


def parse_overrides(pairs: list[str]) -> dict[str, Any]:
    """`--set a.b=1` pairs -> {"a.b": 1}; values parse as JSON, else YAML (numbers incl. 1e-4, bools,
    lists, strings)."""
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise UserError(f"--set {pair!r}: expected KEY=VALUE, e.g. --set train.lr=1e-4")
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip()] = yaml.safe_load(value)
    return out


def _origins(
    documents: list[tuple[str, dict[str, Any]]], expanded: dict[str, Any], leaves_only: bool = False
) -> dict[str, str]:
    """Dotted key -> the source that set it last (YAML path, env var, "overrides")."""
    origins: dict[str, str] = {}
    for source, data in documents:
        for key in _flatten(data, leaves_only=leaves_only):
            origins[key] = source
    for key in _env_paths():
        origins[key] = f"env {ENV_PREFIX}{key.upper().replace('.', ENV_DELIMITER)}"
    for key in _flatten(expanded, leaves_only=leaves_only):
        origins[key] = "overrides"
    return origins


def _load(documents: list[tuple[str, dict[str, Any]]], overrides: dict[str, Any]) -> Settings:
    merged: dict[str, Any] = {}
    for _, data in documents:
        merged = deep_merge(merged, data)
    expanded = _expand_dotted(overrides)
    origins = _origins(documents, expanded)
    token = _YAML_DATA.set(merged)
    try:
        with importing_plugins():  # the caller's own recipe, overrides and env
            return Settings(**expanded)
    except ValidationError as e:
        raise SettingsError(format_validation_error(e, origins)) from None
    finally:
        _YAML_DATA.reset(token)


def load_settings_text(text: str, source: str = "<config>", **overrides: Any) -> Settings:
    """Validate YAML text (a Metaflow `Config` hands its parser the file content, not a path).
    Env and overrides apply as in `load_settings`."""
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise SettingsError(f"{source}: invalid YAML: {getattr(e, 'problem', e)}") from None
    if not isinstance(data, dict):
        raise SettingsError(f"{source}: top level must be a mapping of sections, got {type(data).__name__}")
    return _load([(source, data)], overrides)


def load_settings_json(path: str | os.PathLike, import_plugins: bool = False) -> Settings:
    """Read a `settings.json` written by `Settings.write_json`. No env or YAML is consulted: what ran
    is what was recorded. Its `plugins` are not imported (a checkpoint's file must not run code here);
    only the torchrun entry, reading the file its own launcher wrote from the caller's recipe, passes
    `import_plugins=True`. A recorded plugin mode then needs its module imported by the caller."""
    path = Path(path)
    if not path.is_file():
        raise SettingsError(f"{path}: settings file not found")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise SettingsError(f"{path}: invalid JSON ({e})") from None
    return _validate_recorded(data, str(path), import_plugins)


def settings_env_value(settings: Settings) -> str:
    """`settings` as one environment value (compact JSON, gzip, base64: a few KB): how the launcher hands
    the trainers their settings inside the torchx AppDef, so no node reads a file another machine wrote."""
    raw = json.dumps(settings.to_dict(), separators=(",", ":"), sort_keys=True).encode()
    return base64.b64encode(gzip.compress(raw, mtime=0)).decode("ascii")


def load_settings_env(value: str | None, import_plugins: bool = False) -> Settings:
    """The settings `settings_env_value` encoded (read from $DLLMFLOW_SETTINGS by the torchrun entry);
    validated like a recorded settings.json, with the same rule for its `plugins`."""
    if not value:
        raise SettingsError(f"${SETTINGS_ENV} is not set: the trainer has no settings (pass --settings FILE)")
    try:
        data = json.loads(gzip.decompress(base64.b64decode(value, validate=True)))
    except (ValueError, OSError, EOFError) as e:  # binascii.Error, gzip.BadGzipFile and JSON are ValueErrors
        raise SettingsError(f"${SETTINGS_ENV}: not settings written by the launcher ({e})") from None
    return _validate_recorded(data, f"${SETTINGS_ENV}", import_plugins)


def _validate_recorded(data: Any, source: str, import_plugins: bool) -> Settings:
    try:
        with importing_plugins(import_plugins):
            return Settings.model_validate(data)
    except ValidationError as e:
        message = format_validation_error(e, {k: source for k in _flatten(data, False)})
        plugins = data.get("plugins") if isinstance(data, dict) else None
        if plugins and not import_plugins:
            message += f" (its plugins {plugins} are not imported from a recorded file: import them yourself)"
        raise SettingsError(message) from None


def read_yaml(path: str | os.PathLike) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise SettingsError(f"{path}: params file not found")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise SettingsError(f"{path}: invalid YAML{where}: {getattr(e, 'problem', e)}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise SettingsError(f"{path}: top level must be a mapping of sections, got {type(data).__name__}")
    return data


def deep_merge(base: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """`new` wins; nested dicts merge key by key (lists and scalars replace)."""
    out = dict(base)
    for k, v in new.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def format_validation_error(err: ValidationError, origins: dict[str, str]) -> str:
    lines = []
    for item in err.errors():
        path = _dotted_loc(item["loc"])
        origin = _origin_of(path, origins)
        msg = item["msg"].removeprefix("Value error, ")
        if item["type"] == "extra_forbidden":
            msg = "unknown field (check the spelling; see dllmflow.settings for the fields)"
        elif item["type"] == "finite_number":
            msg = f"must be a finite number, got {item['input']!r}"
        lines.append(f"{path or '<root>'}: {msg} [from {origin}]")
    head = "invalid settings:" if len(lines) > 1 else "invalid setting"
    return head + ("\n  " + "\n  ".join(lines) if len(lines) > 1 else ": " + lines[0])


# ---- helpers ------------------------------------------------------------------------------------


def _dotted_loc(loc: tuple[Any, ...]) -> str:
    return ".".join(str(part) for part in loc)


def _origin_of(path: str, origins: dict[str, str]) -> str:
    probe = path
    while probe:
        if probe in origins:
            return origins[probe]
        # A missing field is attributed to whoever wrote its section.
        siblings = [v for k, v in origins.items() if k.startswith(probe + ".")]
        if siblings:
            return siblings[-1]
        probe = probe.rpartition(".")[0]
    return "defaults"


def _flatten(d: dict[str, Any], leaves_only: bool = True, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            if not leaves_only:
                out[key] = v
            out.update(_flatten(v, leaves_only, key + "."))
        else:
            out[key] = v
    return out


def _expand_dotted(overrides: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in overrides.items():
        nested: Any = v
        for part in reversed(k.split(".")[1:]):
            nested = {part: nested}
        out = deep_merge(out, {k.split(".")[0]: nested})
    return out


def _env_paths() -> list[str]:
    return [
        k[len(ENV_PREFIX) :].lower().replace(ENV_DELIMITER, ".")
        for k in os.environ
        if k.upper().startswith(ENV_PREFIX)
    ]
