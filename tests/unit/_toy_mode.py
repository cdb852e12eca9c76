"""A seventh `dllm.mode`, "toy", defined only in the test tree: the worked example of docs/adding_a_mode.md.

Masked diffusion with a weight on the diffusion term, built from the shared math (`corrupt_uniform`,
`mdlm_loss_sum`) and registered with `register_mode`, without any edit under src/. A run selects it with

    plugins: [_toy_mode]        # importable in every process: tests/unit on PYTHONPATH
    dllm: {mode: toy, loss_weight: 0.5}
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from torch import Tensor, nn

from dllmflow.diffusion.corruption import corrupt_uniform, per_sample
from dllmflow.diffusion.losses import mdlm_loss_sum
from dllmflow.diffusion.modes import ModeSpec, register_mode
from dllmflow.diffusion.strategies import Batch, LossOutput, Strategy
from dllmflow.models.attention import forward_bidirectional
from dllmflow.settings import DLLMBaseConfig


class ToyConfig(DLLMBaseConfig):
    """The `dllm:` section of the toy mode."""

    mode: Literal["toy"]
    loss_weight: float = Field(1.0, gt=0.0, description="Multiplier of the diffusion loss.")


class ToyStrategy(Strategy):
    """MDLM corruption and loss; the trainer applies `loss_weight` through `LossOutput.weights`."""

    name = "toy"

    def corrupt(self, batch: Batch, seeds: list[int]) -> Batch:
        z, noise, p = per_sample(
            corrupt_uniform,
            seeds,
            batch["input_ids"],
            batch["loss_mask"],
            draw_length=self.settings.dataset.seq_length,
            mask_token_id=self.mask_token_id,
            eps=self.cfg.eps,
        )
        return {"noisy_input_ids": z, "noise_mask": noise, "p_mask": p}

    def token_counts(self, batch: Batch) -> dict[str, Tensor]:
        return {"diffusion": (batch["loss_mask"] != 0).sum()}

    def loss(self, model: nn.Module, batch: Batch) -> LossOutput:
        logits = forward_bidirectional(
            model, batch["noisy_input_ids"], batch.get("attention_mask")
        )  # [B, L, V]
        total = mdlm_loss_sum(
            logits, batch["input_ids"], batch["noise_mask"], batch["loss_mask"], batch["p_mask"]
        )
        return LossOutput(sums={"diffusion": total}, weights={"diffusion": self.cfg.loss_weight})


SPEC = register_mode(
    ModeSpec(
        name="toy",
        config=ToyConfig,
        strategy=f"{__name__}:ToyStrategy",
        samplers=("llada",),  # a masked-diffusion checkpoint: LLaDA's sampler decodes it
    )
)
