"""`idlm`: Introspective Diffusion LM, converting an AR LM into a dLLM (docs/strategies.md §2.6).

Every supervised position of x is masked (z); the model reads `[z | x]` (length 2L, position ids
`[0..L-1, 0..L-1]`) under the block-diffusion mask of `dllmflow.diffusion.masks.idlm`. With the
Dream-style next-token shift, logit i predicts token i+1 in both copies:

    sup_i    = m_sup[i+1] and valid[i+1]                  (i = 0..L-2)
    noisy    = sum_i CE(logits[:, i],     x[i+1]) sup_i   -> / N_sup   (the dLLM term)
    clean    = sum_i CE(logits[:, L + i], x[i+1]) sup_i   -> / N_sup, weighted by alpha
    alpha    = clean_loss_weight, or stopgrad(noisy / clean) with auto_balance_clean_loss
    N_sup    = global count of loss_mask != 0, UNSHIFTED and not gated by valid (docs/strategies.md §1.2, §2.6)

so N_sup counts one more token than sum_i sup_i when position 0 is supervised, and every supervised
pad (`supervise_padding`) although no pad is scored; that is the documented denominator (docs/strategies.md §2.6).

Attention backend (`idlm_attention_backend`, chosen in `setup`): flex_attention with a BlockMask on
GPU; on CPU (flex has no backward there) the split sdpa of `dllmflow.models.split_attention`: the
clean half causal, the noisy half one causal call over the clean copy shifted by block_length plus
block_length window scores per query (`dllmflow.models.shifted_attention`), ~L^2 of causal-kernel work
instead of the dense mask's 4L^2 (right-padded batches, i.e. every collated one, else the dense mask);
eager keeps the dense 2L x 2L additive mask. All compute the same loss and gradients. A CPU train step
is 1.6x (L=128) to 2.15x (L=2048) a plain AR step on the same backbone (`bench/train_step.py --sweep`).

The `block_length` curriculum (1 -> 2 -> 3) runs as successive fine-tunes: `curriculum_stages`
turns one settings object with a list into one per stage, each starting from the previous stage's
consolidated checkpoint. Run: `dllmflow train --params params/tiny_idlm.yaml`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from dllmflow.diffusion.corruption import corrupt_all_masked, per_sample
from dllmflow.diffusion.losses import per_token_ce, shifted_supervision
from dllmflow.diffusion.masks.idlm import idlm_block_mask, idlm_dense_mask, idlm_split_attention, right_padded
from dllmflow.errors import UserError
from dllmflow.models.attention import mask_dtype
from dllmflow.models.limits import config_vocab_size
from dllmflow.models.split_attention import SPLIT_ATTENTION, use_split_attention
from dllmflow.models.wrappers import unwrap

from .base import Batch, LossOutput, Strategy

if TYPE_CHECKING:
    from dllmflow.settings import Settings

# Devices where flex_attention has a backward (compiled Triton kernels).
FLEX_DEVICES = frozenset({"cuda"})


def idlm_attention_backend(device: torch.device | str, requested: str | None) -> str:
    """Which I-DLM attention path a model with `attn_implementation=requested` runs on `device`.

    "flex"  - flex_attention + BlockMask: sdpa or flex_attention requested, where flex runs (GPU)
    "split" - split sdpa (causal clean half, block-shifted noisy half): sdpa or flex_attention elsewhere
    "dense" - the 2L x 2L additive mask: eager and any other implementation
    flash_attention_2 cannot take the mask at all: UserError.
    """
    if requested == "flash_attention_2":
        raise UserError(
            "dllm.mode=idlm: flash_attention_2 ignores the 2L block-diffusion mask; "
            "set model.attn_implementation to sdpa, eager or flex_attention"
        )
    if requested in ("sdpa", "flex_attention", SPLIT_ATTENTION):
        return "flex" if torch.device(device).type in FLEX_DEVICES else "split"
    return "dense"


class IDLMStrategy(Strategy):
    name = "idlm"

    def __init__(self, settings: Settings):
        super().__init__(settings)
        self.block_length = resolve_block_length(settings)

    @classmethod
    def training_stages(cls, settings: Settings) -> list[Settings]:
        """The block_length curriculum (e.g. [1, 2, 3]) as successive fine-tunes."""
        return curriculum_stages(settings)

    def setup(self, model: nn.Module, tokenizer, device: torch.device) -> None:
        config = getattr(unwrap(model), "config", None)
        attn = getattr(config, "_attn_implementation", None)
        idlm_attention_backend(device, self.settings.model.attn_implementation)  # refuses flash_attention_2
        backend = idlm_attention_backend(device, attn)
        if backend == "split" and attn != SPLIT_ATTENTION:
            use_split_attention(model)
        elif backend == "flex" and attn != "flex_attention":
            config._attn_implementation = "flex_attention"
        if self.mask_token_id is None:
            raise UserError("dllm.mode=idlm needs an explicit dllm.mask_token_id (I-DLM does not infer one)")
        vocab = config_vocab_size(model)
        if vocab is not None and not 0 <= self.mask_token_id < vocab:
            raise UserError(
                f"dllm.mask_token_id={self.mask_token_id} is outside the model vocabulary [0, {vocab}); "
                "pick a token id the model has (e.g. a reserved special token)"
            )

    def corrupt(self, batch: Batch, seeds: list[int]) -> Batch:
        z, noise, p = per_sample(
            corrupt_all_masked,
            seeds,
            batch["input_ids"],
            batch["loss_mask"],
            mask_token_id=self.mask_token_id,
        )
        return {"noisy_input_ids": z, "noise_mask": noise, "p_mask": p}

    def token_counts(self, batch: Batch) -> dict[str, Tensor]:
        # N_sup is the recipe's "supervised" count, Σ loss_mask over the unshifted mask (docs/strategies.md §2.6),
        # not Σ sup_i of the shifted numerator.
        n = (batch["loss_mask"] != 0).sum()
        return {"noisy": n, "clean": n}

    def loss(self, model: nn.Module, batch: Batch) -> LossOutput:
        x, z = batch["input_ids"], batch["noisy_input_ids"]  # [B, L]
        B, L = x.shape
        attention_mask = batch.get("attention_mask")
        if attention_mask is None:
            attention_mask = torch.ones_like(x)

        # 1) [x_t | x_0], positions restart for the clean copy, block-diffusion mask
        inputs = torch.cat([z, x], dim=1)  # [B, 2L]
        pos = torch.arange(L, device=x.device).repeat(2)[None].expand(B, 2 * L)  # [B, 2L]
        attn = self._attention_inputs(model, attention_mask)
        logits = model(input_ids=inputs, position_ids=pos, use_cache=False, **attn).logits  # [B,2L,V]

        # 2) next-token shift in both copies: logit i predicts x[i+1]. One CE over all 2L rows: slicing
        #    the logits per copy would cost each slice a zero-filled [B, 2L, V] gradient. The last row of
        #    each copy has no target (a dummy 0, never summed).
        sup = shifted_supervision(batch["loss_mask"], attention_mask).float()  # [B, L-1]
        target = F.pad(x[:, 1:], (0, 1)).repeat(1, 2)  # [B, 2L]
        ce = per_token_ce(logits, target)  # [B, 2L]
        noisy = (ce[:, : L - 1] * sup).sum()
        clean = (ce[:, L : 2 * L - 1] * sup).sum()
        return LossOutput(
            sums={"noisy": noisy, "clean": clean},
            weights={"noisy": 1.0, "clean": self._alpha(noisy, clean)},
            dllm_terms=("noisy",),
        )

    def _alpha(self, noisy: Tensor, clean: Tensor) -> float | Tensor:
        if not self.cfg.auto_balance_clean_loss:
            return self.cfg.clean_loss_weight
        # Both terms share the denominator, so CE_noisy / CE_clean is the ratio of the sums.
        return (noisy / clean.clamp_min(1e-6)).detach()

    def _attention_inputs(self, model: nn.Module, attention_mask: Tensor) -> dict:
        """The forward kwargs carrying the mask, for the implementation the model runs (set in `setup`)."""
        attn = getattr(getattr(unwrap(model), "config", None), "_attn_implementation", None)
        if attn == "flex_attention":
            return {"attention_mask": idlm_block_mask(attention_mask, self.block_length)}
        dtype = mask_dtype(model, attention_mask.device)
        if attn == SPLIT_ATTENTION and right_padded(attention_mask):  # else: dense, through plain sdpa
            return {"split_attention": idlm_split_attention(attention_mask, self.block_length, dtype)}
        return {"attention_mask": idlm_dense_mask(attention_mask, self.block_length, dtype=dtype)}


def resolve_block_length(settings: Settings) -> int:
    """`dllm.block_length` as an int. A curriculum list reaches a strategy only in a run that was not
    split into stages (`curriculum_stages`: the fine-tune flow splits it; each stage's settings hold
    one int): that run trains the first stage."""
    value = settings.dllm.block_length
    return value if isinstance(value, int) else value[0]


def curriculum_stages(settings: Settings) -> list[Settings]:
    """One settings object per `block_length` stage (a single-item list for an int).

    Stage i trains `block_length[i]` in `<run_dir>/stage_<i>`; stage i > 0 starts from stage i-1's
    latest consolidated export (`RunLayout.latest_export`). Each stage holds new values: validated.
    """
    from dllmflow.runs import RunLayout
    from dllmflow.settings import Settings, deep_merge

    lengths = settings.dllm.block_length
    if isinstance(lengths, int):
        return [settings]
    run = RunLayout(settings.resolved_run_dir)
    stages: list[Settings] = []
    for i, b in enumerate(lengths):
        update: dict = {"run_dir": str(run.stage(i).root), "dllm": {"block_length": b}}
        if i > 0:
            prev = run.stage(i - 1).latest_export
            update["model"] = {"pretrained_model_name_or_path": str(prev), "tiny": None, "gguf_file": None}
        stages.append(Settings.model_validate(deep_merge(settings.to_dict(), update)))
    return stages
