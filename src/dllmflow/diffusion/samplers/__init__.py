"""Generation samplers (one file each) and their torch-free configs, in two explicit registries.

A setting is checked against `SAMPLER_CONFIGS` (configs.py) without importing the sampler or torch.

from dllmflow.diffusion.samplers import SAMPLER_CONFIGS, SAMPLERS
sampler = SAMPLERS["llada"](model, tokenizer, config)
SAMPLER_CONFIGS["llada"]        # = SAMPLERS["llada"].config_cls, without torch
"""

from __future__ import annotations

from dllmflow.common.lazy import LazyRegistry

_P = "dllmflow.diffusion.samplers"
SAMPLERS = LazyRegistry(
    "sampler",
    {
        "llada": f"{_P}.llada:LLaDASampler",
        "scdd": f"{_P}.scdd:SCDDSampler",
        "llada2": f"{_P}.llada2:LLaDA2Sampler",
        "nemotron": f"{_P}.nemotron:NemotronSampler",
        "gemma": f"{_P}.gemma:GemmaSampler",
        "idlm": f"{_P}.idlm:IDLMSampler",
        "ar": f"{_P}.ar:ARSampler",
        "selfspec": f"{_P}.selfspec:SelfSpecSampler",
    },
)

_C = f"{_P}.configs"
SAMPLER_CONFIGS = LazyRegistry("sampler", {name: f"{_C}:{cls}" for name, cls in {
    "llada": "LLaDAConfig",
    "scdd": "SCDDConfig",
    "llada2": "LLaDA2Config",
    "nemotron": "NemotronConfig",
    "gemma": "GemmaConfig",
    "idlm": "IDLMConfig",
    "ar": "ARConfig",
    "selfspec": "SelfSpecConfig",
}.items()})  # fmt: skip

__all__ = ["SAMPLERS", "SAMPLER_CONFIGS"]
