"""Validated, frozen run settings (pydantic-settings). See `loader.py` for precedence and errors."""

from .block_modes import BlockCausalConfig, CausalBlocksConfig  # registers both modes' sections
from .dllm import (
    MODE_CONFIGS,
    MODE_NAMES,
    ARConfig,
    BlockDiffusionConfig,
    DFlashConfig,
    DFlashSection,
    DLLMBaseConfig,
    DLLMConfig,
    HybridConfig,
    IDLMConfig,
    MDLMConfig,
    SCDDConfig,
    register_mode_config,
)
from .loader import (
    SETTINGS_ENV,
    Settings,
    SettingsError,
    deep_merge,
    importing_plugins,
    load_settings,
    load_settings_env,
    load_settings_json,
    load_settings_text,
    load_settings_with_origins,
    parse_overrides,
    read_yaml,
    settings_env_value,
)
from .pipeline import *  # noqa: F403 - eval, registry, flow, regenerate, listed in pipeline.__all__
from .pipeline import __all__ as _PIPELINE
from .rl import RL_ESTIMATORS, RL_REWARDS, EstimatorSettings, RLConfig
from .sections import *  # noqa: F403 - the section models, listed in sections.__all__
from .sections import __all__ as _SECTIONS

__all__ = (
    [
        "MODE_NAMES",
        "MODE_CONFIGS",
        "ARConfig",
        "BlockCausalConfig",
        "BlockDiffusionConfig",
        "CausalBlocksConfig",
        "DFlashConfig",
        "DFlashSection",
        "DLLMBaseConfig",
        "DLLMConfig",
        "HybridConfig",
        "IDLMConfig",
        "MDLMConfig",
        "SCDDConfig",
        "Settings",
        "SettingsError",
        "deep_merge",
        "importing_plugins",
        "load_settings",
        "SETTINGS_ENV",
        "load_settings_env",
        "settings_env_value",
        "load_settings_json",
        "load_settings_text",
        "load_settings_with_origins",
        "parse_overrides",
        "read_yaml",
        "register_mode_config",
        "RL_ESTIMATORS",
        "RL_REWARDS",
        "EstimatorSettings",
        "RLConfig",
    ]
    + list(_SECTIONS)
    + list(_PIPELINE)
)
