"""Training strategies, one file per `dllm.mode`; which class serves which mode is declared in
`dllmflow.diffusion.modes` (its `ModeSpec.strategy`), and `STRATEGIES` is a view of that registry.

from dllmflow.diffusion.strategies import STRATEGIES, build_strategy
strategy = build_strategy(settings)          # STRATEGIES[settings.dllm.mode](settings)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dllmflow.diffusion.modes import MODES

from .base import Batch, LossOutput, Strategy

if TYPE_CHECKING:
    from dllmflow.settings import Settings

# mode -> Strategy class, imported on first use; an unknown mode raises a KeyError listing the choices.
STRATEGIES = MODES.derive(lambda spec: spec.strategy_class())


def build_strategy(settings: Settings) -> Strategy:
    return STRATEGIES[settings.dllm.mode](settings)


__all__ = ["STRATEGIES", "Batch", "LossOutput", "Strategy", "build_strategy"]
