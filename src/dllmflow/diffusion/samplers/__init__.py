"""Generation samplers, one file per sampler, in an explicit registry.

from dllmflow.diffusion.samplers import SAMPLERS
sampler = SAMPLERS["llada"](model, tokenizer, config)
"""

from __future__ import annotations

from dllmflow.diffusion.registry import LazyRegistry

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

# Which samplers decode a checkpoint trained with each mode (evaluation matrix, sampler checks).
SAMPLERS_FOR_MODE: dict[str, tuple[str, ...]] = {
    "mdlm": ("llada", "llada2"),
    "scdd": ("scdd", "llada"),
    "hybrid": ("nemotron", "llada"),
    "block_diffusion": ("gemma",),
    "idlm": ("idlm",),
    "dflash": (),
}

__all__ = ["SAMPLERS", "SAMPLERS_FOR_MODE"]
