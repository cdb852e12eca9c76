"""Validated, frozen run settings (pydantic-settings). See `loader.py` for precedence and errors."""

from .dllm import (
    MODES,
    BlockDiffusionConfig,
    DFlashConfig,
    DFlashSection,
    DLLMConfig,
    HybridConfig,
    IDLMConfig,
    MDLMConfig,
    SCDDConfig,
)
from .loader import Settings, SettingsError, deep_merge, load_settings, load_settings_json, load_settings_text, read_yaml
from .sections import (
    CheckpointConfig,
    DatasetConfig,
    DistributedConfig,
    EvalConfig,
    FlowConfig,
    LaunchConfig,
    ModelConfig,
    RegenerateConfig,
    RegistryConfig,
    TinyModelConfig,
    TokenizerConfig,
    TrainConfig,
)

__all__ = [
    "MODES", "BlockDiffusionConfig", "CheckpointConfig", "DFlashConfig", "DFlashSection", "DLLMConfig",
    "DatasetConfig", "DistributedConfig", "EvalConfig", "FlowConfig", "HybridConfig", "IDLMConfig",
    "LaunchConfig", "MDLMConfig", "ModelConfig", "RegenerateConfig", "RegistryConfig", "SCDDConfig",
    "Settings", "SettingsError", "TinyModelConfig", "TokenizerConfig", "TrainConfig", "deep_merge",
    "load_settings", "load_settings_json", "load_settings_text", "read_yaml",
]
