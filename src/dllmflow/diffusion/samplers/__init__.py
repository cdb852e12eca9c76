"""Generation samplers, one file per sampler, in an explicit registry.

from dllmflow.diffusion.samplers import SAMPLERS
sampler = SAMPLERS["llada"](model, tokenizer, config)
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
    },
)

__all__ = ["SAMPLERS"]
