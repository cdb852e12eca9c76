"""Training strategies, one file per `dllm.mode`, in an explicit registry.

from dllmflow.diffusion.strategies import STRATEGIES, build_strategy
strategy = build_strategy(settings)          # STRATEGIES[settings.dllm.mode](settings)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dllmflow.diffusion.registry import LazyRegistry

from .base import Batch, LossOutput, Strategy

if TYPE_CHECKING:
    from dllmflow.settings import Settings

_P = "dllmflow.diffusion.strategies"
STRATEGIES = LazyRegistry(
    "dllm.mode",
    {
        "mdlm": f"{_P}.mdlm:MDLMStrategy",
        "scdd": f"{_P}.scdd:SCDDStrategy",
        "hybrid": f"{_P}.hybrid:HybridStrategy",
        "block_diffusion": f"{_P}.block_diffusion:BlockDiffusionStrategy",
        "dflash": f"{_P}.dflash:DFlashStrategy",
        "idlm": f"{_P}.idlm:IDLMStrategy",
    },
)


def build_strategy(settings: Settings) -> Strategy:
    return STRATEGIES[settings.dllm.mode](settings)


__all__ = ["STRATEGIES", "Batch", "LossOutput", "Strategy", "build_strategy"]
