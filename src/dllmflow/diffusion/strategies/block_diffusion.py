"""`block_diffusion`: DiffusionGemma SFT (docs/strategies.md §2.4) on transformers' DiffusionGemmaForBlockDiffusion.

Per micro-batch (the trainer calls these three in order, see `strategies/base.py`):

    corrupt(batch, seeds)  single-turn guard; uniform random-token corruption of the supervised
                           positions (one t per example, p_mask ≡ 1); the response window (canvas from
                           the first supervised position, absolute positions); one canvas block per
                           example; one self-conditioning coin per example -> sidecars
    token_counts(batch)    diffusion: Σ selected-block supervised canvas positions;
                           encoder_ar: Σ attn[:, :-1] ∧ attn[:, 1:]
    loss(model, batch)     leak-free decoder masks; encoder + two-pass decoder in one forward;
                           flat CE over the selected block (no 1/t, not noise-gated) + encoder AR CE

Block choice and coins come from per-sample generators derived from the trainer's per-sample seeds
(other streams of `dllmflow.diffusion.seeding.sample_seed`), so resume, world size and how a step is
cut into micro-batches do not change them; they are drawn once in `corrupt` and stored, so the
denominators and the forward use the same selection. Corruption draws over each row's own length
(not the padded batch length) for the same reason. The encoder AR term is a training-only loss
(absent in eval mode); the self-conditioning coins apply in both.

    dllmflow train --params params/tiny_block_diffusion.yaml
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dllmflow.diffusion.corruption import corrupt_uniform_random
from dllmflow.diffusion.masks.block_diffusion import (
    build_decoder_masks,
    build_encoder_masks,
    split_prompt_response,
)
from dllmflow.diffusion.seeding import restream
from dllmflow.errors import UserError
from dllmflow.models.limits import config_vocab_size
from dllmflow.models.mask_id import find_mask_id
from dllmflow.models.wrappers import unwrap

from .base import Batch, LossOutput, Strategy

if TYPE_CHECKING:
    from pathlib import Path

    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

SELECTION_STREAM = 2**42  # per-sample stream of the canvas-block choice (docs/strategies.md §1.3's +2^42)
SELF_COND_STREAM = 2**41  # per-sample stream of the self-conditioning coin


def uniform_per_sample(seeds: list[int], stream: int) -> Tensor:
    """One U[0,1) draw per sample from its own CPU generator on `stream` -> [B] float64."""
    draws = []
    for seed in seeds:
        gen = torch.Generator(device="cpu")
        gen.manual_seed(restream(seed, stream))
        draws.append(torch.rand(1, generator=gen, dtype=torch.float64))
    return torch.cat(draws) if draws else torch.zeros(0, dtype=torch.float64)


def check_single_turn(loss_mask: Tensor) -> None:
    """Raise if a row has more than one supervised run (multi-turn supervision, docs/strategies.md §1.3 guard)."""
    sup = loss_mask != 0  # [B, L]
    runs = sup[:, 0].long() + (sup[:, 1:] & ~sup[:, :-1]).sum(dim=1)  # [B]
    bad = torch.nonzero(runs > 1).flatten().tolist()
    if bad:
        raise UserError(
            f"block_diffusion supports single-turn supervision only, but batch rows {bad[:5]} have "
            f"{int(runs.max())} supervised runs; set dataset.mask_history: true (supervise only the final "
            "assistant turn) and re-run `dllmflow prepare`"
        )


def corrupt_rows(
    input_ids: Tensor,
    loss_mask: Tensor,
    attention_mask: Tensor,
    seeds: list[int],
    vocab_size: int,
    eps: float,
) -> tuple[Tensor, Tensor]:
    """`corrupt_uniform_random` on each row over its own length (its attended extent, which the collator
    fixes per sample), not the padded batch length: the kernel's token draws follow `rand(1, L)` in the
    generator's stream, so drawing over the padded L would make a sample's noise depend on the longest
    row it was batched with (i.e. on the world size and the micro-batch split)."""
    noisy, noise = input_ids.clone(), torch.zeros_like(input_ids, dtype=torch.bool)  # [B, L]
    lengths = attention_mask.long().sum(dim=1).clamp(min=1).tolist()
    for b, (seed, n) in enumerate(zip(seeds, lengths, strict=True)):
        gen = torch.Generator(device=input_ids.device)
        gen.manual_seed(int(seed))
        z, m, _ = corrupt_uniform_random(
            input_ids[b : b + 1, :n], loss_mask[b : b + 1, :n], vocab_size, eps=eps, generator=gen
        )
        noisy[b, :n], noise[b, :n] = z[0], m[0]
    return noisy, noise


def build_response_window(
    input_ids: Tensor,
    noisy_ids: Tensor,
    noise_mask: Tensor,
    loss_mask: Tensor,
    attention_mask: Tensor,
    block_size: int,
    selection_u: Tensor,
    pad_token_id: int = 0,
) -> dict[str, Tensor]:
    """docs/strategies.md §2.4 steps 2-5: the canvas = the response window, one selected block per example.

    Canvas position j of row b is absolute position prefix_b + j; valid iff j < R_b, where
    R_b = Σ attention_mask - prefix_b. `selection_u` [B] in [0, 1) picks block floor(u · nvb_b).
    """
    B, S = input_ids.shape
    dev = input_ids.device
    prefix, _ = split_prompt_response(loss_mask)  # [B]
    eff_len = attention_mask.long().sum(dim=1)  # [B] content + attended block fill
    resp = (eff_len - prefix).clamp(min=0)  # [B] R_b
    R = max(int(resp.max()) if B else 0, 1)
    j = torch.arange(R, device=dev)
    pos = prefix[:, None] + j[None, :]  # [B, R] absolute positions
    valid = (j[None, :] < resp[:, None]) & (pos < eff_len[:, None])  # [B, R]
    idx = pos.clamp(max=S - 1)

    # One canvas block per example: nvb_b = number of blocks of R_b (at least 1)
    nvb = torch.div((resp - 1).clamp(min=0), block_size, rounding_mode="floor") + 1  # [B]
    sel = torch.floor(selection_u.to(dev) * nvb).long().clamp(max=nvb - 1)  # [B]
    in_sel = (j[None, :] // block_size) == sel[:, None]  # [B, R]

    supervised = (loss_mask.gather(1, idx) != 0) & valid
    canvas_ids = torch.where(valid, noisy_ids.gather(1, idx), torch.full_like(idx, pad_token_id))
    return {
        "canvas_ids": canvas_ids,  # [B, R] noisy canvas
        "canvas_targets": input_ids.gather(1, idx),  # [B, R] clean tokens
        "canvas_position_ids": idx,  # [B, R] = min(prefix + j, S - 1)
        "canvas_valid": valid,  # [B, R]
        "canvas_noise_mask": noise_mask.gather(1, idx) & valid,  # [B, R] (not used by the loss)
        "canvas_loss_mask": (supervised & in_sel).float(),  # [B, R]
        "prefix_lengths": prefix,  # [B]
        "response_lengths": resp,  # [B]
        "selected_block": sel,  # [B]
    }


class BlockDiffusionStrategy(Strategy):
    name = "block_diffusion"

    def __init__(self, settings):
        super().__init__(settings)
        self.block_size = int(self.cfg.block_size)
        self.pad_token_id = 0
        self.sliding_window: int | None = None

    # ---- model --------------------------------------------------------------------------------
    def setup(self, model: nn.Module, tokenizer: PreTrainedTokenizerBase, device: torch.device) -> None:
        from dllmflow.models.diffusion_gemma import sliding_window_of

        inner = unwrap(model)
        if not hasattr(getattr(inner, "model", None), "decoder") or not hasattr(inner.model, "encoder"):
            raise UserError(
                f"dllm.mode=block_diffusion needs a DiffusionGemma model (encoder + decoder), got "
                f"{type(inner).__name__}; set model.pretrained_model_name_or_path to a DiffusionGemma checkpoint"
            )
        vocab = config_vocab_size(inner)
        if vocab != self.cfg.vocab_size:
            raise UserError(
                f"dllm.vocab_size={self.cfg.vocab_size} does not match the model vocabulary ({vocab}); "
                f"set dllm.vocab_size: {vocab}"
            )
        # No [MASK] in this mode (random-token corruption): keep any id given, else a harmless 0.
        found = find_mask_id(self.cfg.mask_token_id, tokenizer=tokenizer)
        self.mask_token_id = 0 if found is None else found
        self.pad_token_id = next(
            (t for t in (tokenizer.pad_token_id, tokenizer.eos_token_id) if t is not None), 0
        )
        self.sliding_window = sliding_window_of(inner)
        canvas = getattr(inner.config, "canvas_length", None)
        if canvas is not None and canvas != self.block_size:
            log.warning(
                "dllm.block_size=%d differs from the model's canvas_length=%d: generation denoises "
                "canvas_length blocks; set model.canvas_length to match",
                self.block_size,
                canvas,
            )

    # ---- one micro-batch ----------------------------------------------------------------------
    def corrupt(self, batch: Batch, seeds: list[int]) -> Batch:
        input_ids, loss_mask = batch["input_ids"], batch["loss_mask"]
        attention_mask = batch.get("attention_mask")
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        check_single_turn(loss_mask)
        # 1) uniform random tokens over the full vocabulary, one t per example, p_mask ≡ 1
        noisy, noise = corrupt_rows(
            input_ids, loss_mask, attention_mask, seeds, self.cfg.vocab_size, self.cfg.eps
        )
        # 2) the response window with one selected block per example
        window = build_response_window(
            input_ids,
            noisy,
            noise,
            loss_mask,
            attention_mask,
            self.block_size,
            uniform_per_sample(seeds, SELECTION_STREAM),
            self.pad_token_id,
        )
        # 3) per-example self-conditioning coins (all off when model.self_conditioning is false)
        p = self.cfg.self_conditioning_p if self.settings.model.self_conditioning else 0.0
        coins = uniform_per_sample(seeds, SELF_COND_STREAM) < p  # [B]
        return {
            "noisy_input_ids": noisy,
            "noise_mask": noise,
            **window,
            "self_conditioning_mask": coins.to(input_ids.device),
        }

    def token_counts(self, batch: Batch) -> dict[str, Tensor]:
        return {
            "diffusion": batch["canvas_loss_mask"].sum(),
            "encoder_ar": _ar_pairs(batch).sum(),
        }

    def loss(self, model: nn.Module, batch: Batch) -> LossOutput:
        input_ids = batch["input_ids"]
        B, S = input_ids.shape
        attention_mask = batch.get("attention_mask")
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        dtype = _mask_dtype(model, input_ids.device)
        sw = self.sliding_window
        dec_masks = build_decoder_masks(
            batch["prefix_lengths"],
            batch["response_lengths"],
            attention_mask,
            batch["canvas_ids"].shape[1],
            self.block_size,
            sw,
            dtype,
        )
        with_ar = model.training and self.cfg.encoder_loss_weight > 0
        pairs = _ar_pairs(batch)  # [B, S-1]: position i predicts i+1
        enc_positions = F.pad(pairs, (0, 1)) if with_ar else None  # [B, S]
        coins = batch["self_conditioning_mask"].to(input_ids.device)
        out = model(
            block_diffusion_training=True,
            input_ids=input_ids,
            attention_mask=build_encoder_masks(attention_mask, sw, dtype),
            position_ids=torch.arange(S, device=input_ids.device)[None].expand(B, S),
            decoder_input_ids=batch["canvas_ids"],
            decoder_attention_mask=dec_masks,
            decoder_position_ids=batch["canvas_position_ids"],
            self_conditioning_mask=coins if self.settings.model.self_conditioning else None,
            encoder_logits_mask=enc_positions,
        )
        # Flat CE over the selected block's supervised canvas positions: no 1/t, not noise-gated.
        logits = out.logits.float()  # [B, R, V]
        ce = F.cross_entropy(logits.flatten(0, 1), batch["canvas_targets"].flatten(), reduction="none")
        sums = {"diffusion": (ce * batch["canvas_loss_mask"].flatten()).sum()}
        if with_ar:
            targets = input_ids[:, 1:][pairs]  # [N] next tokens, same order as the selected logits
            sums["encoder_ar"] = F.cross_entropy(out.encoder_logits.float(), targets, reduction="sum")
        return LossOutput(
            sums=sums,
            weights={"diffusion": 1.0, "encoder_ar": self.cfg.encoder_loss_weight},
            dllm_terms=("diffusion",),
        )

    # ---- export -------------------------------------------------------------------------------
    def export(self, model: nn.Module, state_dict: dict[str, Tensor], tokenizer: Any, out_dir: Path) -> None:
        """Decoder tensors over the base when training from a checkpoint; the full model when tiny."""
        from dllmflow.models.diffusion_gemma import export_diffusion_gemma

        inner = unwrap(model)
        export_diffusion_gemma(
            inner, state_dict, tokenizer, out_dir, self.settings.model.pretrained_model_name_or_path
        )
        # DiffusionGemmaGenerationConfig raises on unknown keys: the dllm block goes in config.json only
        self.export_card(out_dir, generation_config=False)


def _ar_pairs(batch: Batch) -> Tensor:
    """[B, S-1] bool: positions i with attn_i ∧ attn_{i+1} (the encoder AR targets)."""
    attn = batch.get("attention_mask")
    if attn is None:
        attn = torch.ones_like(batch["input_ids"])
    attn = attn != 0
    return attn[:, :-1] & attn[:, 1:]


def _mask_dtype(model: nn.Module, device: torch.device) -> torch.dtype:
    """Additive masks must match the attention dtype: the autocast dtype if active, else the weights'."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return next(p.dtype for p in model.parameters() if p.is_floating_point())
