"""`dflash`: train a speculative block-diffusion draft on a frozen causal target (docs/strategies.md §2.5).

Per micro-batch the strategy samples anchor blocks (seeded per sample, never the global RNG), runs the
frozen target once under no_grad for the hidden states of the chosen layers, and trains the draft to
predict the bs-1 tokens after each anchor from (target states strictly before the anchor, the anchor
token, bs-1 mask tokens). Logits come from the frozen target head; the loss is the decay-weighted CE
of paper Eq. 4 summed here and divided by the global number of predicted tokens by the trainer.

    strategy = STRATEGIES["dflash"](settings)          # params/tiny_dflash.yaml, params/dflash_sft.yaml
    draft = build_mode_model(settings, tokenizer)      # the trainable draft only (models.dflash_target)
    strategy.setup(draft, tokenizer, device)           # loads the frozen target once
    batch.update(strategy.corrupt(batch, seeds)); out = strategy.loss(draft, batch)

The math lives in plain-function modules: anchors and block inputs in `diffusion/dflash_blocks.py`,
the decay CE and draft accuracy in `diffusion/dflash_loss.py`, the target (`tiny:<dir>`, hub id or
local dir), the resolved settings and the draft builder in `models/dflash_target.py`. Deliberate differences from the
reference code (docs/strategies.md §7): the block mask is always built (1), the non-overlap sampler is per sample
and cannot fail (3), draft accuracy is logged for every N (7).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dllmflow.diffusion.dflash_blocks import block_position_ids, build_block_inputs, sample_anchor_blocks
from dllmflow.diffusion.dflash_loss import (
    accuracy_sums,
    decay_ce_dense,
    decay_ce_fused,
    decay_weights,
    draft_accuracy,
    resolve_gamma,
)
from dllmflow.diffusion.masks.dflash import dflash_block_mask, dflash_dense_mask
from dllmflow.diffusion.seeding import generators
from dllmflow.errors import UserError
from dllmflow.models.dflash_target import (
    resolve_block_size,
    resolve_mask_token_id,
    resolve_target_layer_ids,
    resolve_target_path,
)
from dllmflow.models.wrappers import unwrap

from .base import Batch, LossOutput, Strategy

BACKENDS = ("sdpa", "flex_attention")
_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}


class DFlashStrategy(Strategy):
    name = "dflash"

    def __init__(self, settings):
        super().__init__(settings)
        self.dcfg = settings.dflash
        if self.dcfg is None or not getattr(self.dcfg, "target_model_id", None):
            raise UserError(
                "dllm.mode dflash needs a dflash: section with dflash.target_model_id (the frozen target)"
            )
        if self.dcfg.attention_backend not in BACKENDS:
            raise UserError(
                f"dflash.attention_backend={self.dcfg.attention_backend!r}: choose one of {', '.join(BACKENDS)}"
            )
        self.num_blocks = self.dcfg.num_blocks_per_sample
        self.fixed_ctx_len = settings.dataset.seq_length
        self.block_size: int | None = None
        self.gamma: float | None = None
        self.layer_ids: list[int] | None = None
        self.target: nn.Module | None = None
        self._target_path: str | None = None
        self._own_mask_embedding = False

    # ---- model ------------------------------------------------------------------------------------
    def target_path(self, tokenizer) -> str:
        if self._target_path is None:
            self._target_path = resolve_target_path(self.dcfg.target_model_id, tokenizer)
        return self._target_path

    def _resolve_mask(self, tokenizer) -> int:
        if self.mask_token_id is None:
            self.mask_token_id = resolve_mask_token_id(None, tokenizer, self.target_path(tokenizer))
        return self.mask_token_id

    def load_target(self, path: str, device: torch.device) -> nn.Module:
        """The frozen target in `dflash.target_torch_dtype`, replicated, no grads, never in the optimizer:
        under a process group rank 0 reads it and broadcasts into the others' meta-built skeletons."""
        from transformers import AutoModelForCausalLM

        from dllmflow.models.meta import load_frozen, pretrained_kwargs

        def load() -> nn.Module:
            return AutoModelForCausalLM.from_pretrained(
                path,
                dtype=_DTYPES[self.dcfg.target_torch_dtype],
                trust_remote_code=self.settings.model.trust_remote_code,
                **pretrained_kwargs(),
            )

        return load_frozen(load, device)

    def setup(self, model: nn.Module, tokenizer, device: torch.device) -> None:
        """Load the frozen target once and resolve block size, gamma, layer ids and the mask id."""
        draft = unwrap(model)
        mask_id = self._resolve_mask(tokenizer)
        if self.dcfg.attention_backend == "flex_attention":
            if torch.device(device).type != "cuda":
                raise UserError(
                    "dflash.attention_backend=flex_attention needs a CUDA device (no CPU backward); use sdpa"
                )
            draft.config._attn_implementation = "flex_attention"
        self.target = self.load_target(self.target_path(tokenizer), torch.device(device))
        embed = self.target.get_input_embeddings() or getattr(
            getattr(self.target, "model", None), "embed_tokens", None
        )
        head = self.target.get_output_embeddings() or getattr(self.target, "lm_head", None)
        if embed is None or head is None:
            raise UserError(
                f"dflash target {self.dcfg.target_model_id}: needs an input embedding and an LM head"
            )
        self.target_embed, self.target_head = embed, head
        tcfg = self.target.config.get_text_config()
        self.block_size = resolve_block_size(self.dcfg.block_size, draft)
        self.gamma = resolve_gamma(self.dcfg.loss_decay_gamma, self.block_size)
        self.layer_ids = resolve_target_layer_ids(self.dcfg.target_layer_ids, draft, tcfg.num_hidden_layers)
        fc = getattr(draft, "fc", None)
        if fc is not None and fc.in_features != len(self.layer_ids) * tcfg.hidden_size:
            raise UserError(
                f"draft fc takes {fc.in_features} features but {len(self.layer_ids)} target layers x hidden "
                f"{tcfg.hidden_size} = {len(self.layer_ids) * tcfg.hidden_size}; fix dflash.target_layer_ids"
            )
        vocab = embed.weight.shape[0]
        self._own_mask_embedding = mask_id >= vocab
        if self._own_mask_embedding and getattr(draft, "mask_embedding", None) is None:
            raise UserError(
                f"mask id {mask_id} has no row in the target embedding ({vocab} rows) and the draft has no own "
                "mask embedding; set dllm.mask_token_id to a reserved id < the target vocabulary"
            )

    # ---- one micro-batch --------------------------------------------------------------------------
    def corrupt(self, batch: Batch, seeds: list[int]) -> Batch:
        ids, loss_mask = batch["input_ids"], batch["loss_mask"]
        attn = batch.get("attention_mask")
        attn = torch.ones_like(ids) if attn is None else attn
        bs = self._require_setup()
        anchors, keep = sample_anchor_blocks(
            attn, loss_mask, bs, self.num_blocks, self.dcfg.overlap_anchors, generators(seeds)
        )
        block_ids, targets, tmask = build_block_inputs(
            ids, attn, loss_mask, anchors, keep, bs, self.mask_token_id
        )
        return {
            "dflash_anchors": anchors,  # [B, N]
            "dflash_keep": keep,  # [B, N]
            "dflash_block_ids": block_ids,  # [B, N·bs]
            "dflash_targets": targets,  # [B, N·(bs-1)]
            "dflash_target_mask": tmask,  # [B, N·(bs-1)]
        }

    def token_counts(self, batch: Batch) -> dict[str, Tensor]:
        return {"diffusion": batch["dflash_target_mask"].sum()}

    @torch.no_grad()
    def target_features(self, batch: Batch) -> Tensor:
        """Frozen target over the full batch length: concat of hidden_states[l+1] for l in the layer
        ids (index 0 is the embedding output). [B, L, |ids|·d]"""
        out = self.target.base_model(
            input_ids=batch["input_ids"],
            attention_mask=batch.get("attention_mask"),
            output_hidden_states=True,
            use_cache=False,
        )
        return torch.cat([out.hidden_states[i + 1] for i in self.layer_ids], dim=-1)

    def loss(self, model: nn.Module, batch: Batch) -> LossOutput:
        return self.draft_loss(model, batch, self.target_features(batch))

    def draft_loss(self, model: nn.Module, batch: Batch, target_hidden: Tensor) -> LossOutput:
        """The draft step given the target's features (split out so benchmarks can time each half)."""
        bs = self._require_setup()
        anchors, keep = batch["dflash_anchors"], batch["dflash_keep"]
        bsz, seq_len = batch["input_ids"].shape
        flex = self.dcfg.attention_backend == "flex_attention"
        # 1) context: pad to the fixed length under flex so the compiled BlockMask keeps static shapes
        ctx_len = max(self.fixed_ctx_len, seq_len) if flex else seq_len
        h = F.pad(target_hidden, (0, 0, 0, ctx_len - seq_len))  # [B, S, |ids|·d]
        # 2) block inputs through the frozen target embedding (a mask id beyond it -> the draft's own)
        block_ids = batch["dflash_block_ids"]
        with torch.no_grad():
            noise = self.target_embed(
                block_ids.clamp(max=self.target_embed.weight.shape[0] - 1)
            )  # [B, N·bs, d]
        extra = {"mask_positions": block_ids == self.mask_token_id} if self._own_mask_embedding else {}
        # 3) positions and the block mask: always built (docs/strategies.md §7 caveat 1)
        pos = block_position_ids(anchors, ctx_len, bs)  # [B, S + N·bs]
        if flex:
            attn = dflash_block_mask(anchors, keep, ctx_len, bs)
        else:
            attn = dflash_dense_mask(anchors, keep, ctx_len, bs, dtype=noise.dtype)  # [B, 1, N·bs, S + N·bs]
        out = model(
            target_hidden=h,
            noise_embedding=noise,
            position_ids=pos,
            attention_mask=attn,
            use_cache=False,
            is_causal=False,
            **extra,
        )
        hidden = out if isinstance(out, Tensor) else getattr(out, "last_hidden_state", None)
        hidden = out[0] if hidden is None else hidden  # a tuple-returning remote draft
        # 4) predict offsets 1..bs-1 of every block (the anchor slot is given, not predicted)
        d = hidden.shape[-1]
        pred = hidden.view(bsz, -1, bs, d)[:, :, 1:].reshape(bsz, -1, d)  # [B, N·(bs-1), d]
        targets, tmask = batch["dflash_targets"], batch["dflash_target_mask"]
        weights = (
            decay_weights(bs, self.gamma).to(pred.device).repeat(anchors.shape[1])
        )  # [N·(bs-1)], reset per block
        if self.dcfg.use_fused_linear_ce:
            loss_sum, correct = decay_ce_fused(
                pred, self.target_head, targets, tmask, weights, self.dcfg.ce_chunk_size
            )
        else:
            loss_sum, correct = decay_ce_dense(pred, self.target_head, targets, tmask, weights)
        return LossOutput(sums={"diffusion": loss_sum}, metric_sums=accuracy_sums(correct, tmask, bs))

    def _require_setup(self) -> int:
        if self.block_size is None:
            raise RuntimeError("DFlashStrategy.setup() must run before corrupt()/loss()")
        return self.block_size

    # ---- reporting and export ---------------------------------------------------------------------
    def finalize_metrics(self, metric_sums: dict[str, float]) -> dict[str, float]:
        return draft_accuracy(metric_sums)

    def export(self, model: nn.Module, state_dict: dict[str, Tensor], tokenizer: Any, out_dir: Path) -> None:
        """Only the draft (the target stays where `target_model_id` points), with the DFlash fields
        in its config so it decodes and loads back on its own."""
        draft = unwrap(model)
        cfg = draft.config
        fields = {
            "block_size": self.block_size,
            "target_layer_ids": self.layer_ids,
            "mask_token_id": self.mask_token_id,
        }
        for key, value in fields.items():
            setattr(cfg, key, value)
        if isinstance(getattr(cfg, "dflash_config", None), dict):  # the published drafts' layout
            cfg.dflash_config.update({k: v for k, v in fields.items() if k != "block_size"})
        cfg.target_model_id = self.dcfg.target_model_id
        draft.save_pretrained(out_dir, state_dict=state_dict, safe_serialization=True)
        tokenizer.save_pretrained(out_dir)
        self.export_card(out_dir)


__all__ = ["DFlashStrategy"]
