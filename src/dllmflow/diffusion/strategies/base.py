"""The strategy protocol every `dllm.mode` implements, and the loss container the trainer reduces.

A training step (see `dllmflow.training.trainer`) drives a strategy in three separate calls so the
loss of a given corruption can be computed and the denominators are global before any backward:

    strategy.begin_step(step)                         # 0) the optimizer step (curricula read it)
    batch.update(strategy.corrupt(batch, seeds))      # 1) noise, seeded per sample; no global RNG
    counts = strategy.token_counts(batch)             # 2) local denominators per loss term
    ...all-reduce counts over ranks and micro-batches...
    out = strategy.loss(model, batch)                 # 3) summed losses per term (graph attached)
    total = sum(out.weight(k) * out.sums[k] / max(global_counts[k], 1) for k in out.sums)

So the loss does not depend on world size or gradient accumulation (docs/strategies.md §1.3).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor, nn

from dllmflow.errors import UserError
from dllmflow.models.limits import config_vocab_size
from dllmflow.models.mask_id import find_mask_id

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from dllmflow.models.model_card import ExportFacts
    from dllmflow.settings import Settings

Batch = dict[str, Tensor]


@dataclass
class LossOutput:
    """Per-term summed losses of one micro-batch. The trainer divides each by its global count.

    sums:        term -> summed loss over this micro-batch (graph attached); keys match `token_counts`.
    weights:     term -> multiplier (float, or a detached tensor such as I-DLM's auto-balanced alpha).
    dllm_terms:  the terms logged as `dllm_loss` (the diffusion part, weights applied).
    metric_sums: additive statistics summed across ranks and micro-batches before any division,
                 e.g. DFlash `draft_correct_k{k}` / `draft_count_k{k}`; turned into metrics by
                 `Strategy.finalize_metrics`.
    """

    sums: dict[str, Tensor]
    weights: dict[str, float | Tensor] = field(default_factory=dict)
    dllm_terms: tuple[str, ...] = ("diffusion",)
    metric_sums: dict[str, Tensor] = field(default_factory=dict)

    def weight(self, term: str) -> float | Tensor:
        return self.weights.get(term, 1.0)


class Strategy(ABC):
    """One training objective: corruption, token counts and loss, plus the per-mode hooks the trainer
    calls around them (setup, metrics, export). Subclasses live one per file; a `ModeSpec` in
    `diffusion.modes` names each, and builds the model it trains (`build_mode_model`)."""

    name: ClassVar[str]
    # LoRA exports merge the adapter into the weights (`models.lora.export_with_lora`); a mode whose
    # adapter is not a weight update (uno's gated drafter) exports the base and the adapter apart.
    merge_adapters: ClassVar[bool] = True

    def __init__(self, settings: Settings):
        self.settings = settings
        self.cfg = settings.dllm
        self.mask_token_id: int | None = settings.dllm.mask_token_id
        self.step: int | None = None  # the optimizer step being corrupted (begin_step); None outside training

    @classmethod
    def training_stages(cls, settings: Settings) -> list[Settings]:
        """The fine-tunes one training request runs, in order (default: one). A curriculum strategy
        returns one Settings per stage, each with its own run_dir, stage i>0 starting from stage i-1."""
        return [settings]

    # ---- before the first step ----------------------------------------------------------------
    def setup(self, model: nn.Module, tokenizer: PreTrainedTokenizerBase, device: torch.device) -> None:
        """Validate the model/tokenizer against the settings, load auxiliary models, resolve the mask
        id (settings -> tokenizer). Raise `UserError` naming the field on a mismatch."""
        self.mask_token_id = find_mask_id(self.mask_token_id, tokenizer=tokenizer)
        if self.mask_token_id is None:
            raise UserError(
                f"dllm.mask_token_id is not set and the tokenizer has no mask token (mode {self.name}); "
                "set dllm.mask_token_id or add a mask token to the tokenizer"
            )
        vocab = config_vocab_size(model)
        if vocab is not None and not 0 <= self.mask_token_id < vocab:
            raise UserError(
                f"dllm.mask_token_id={self.mask_token_id} is outside the model vocabulary [0, {vocab})"
            )

    # ---- one micro-batch ----------------------------------------------------------------------
    def begin_step(self, step: int) -> None:
        """Called with the optimizer step's index before its micro-batches are corrupted; kept as
        `self.step` for a strategy whose training changes with the step (mdlm's attention annealing).
        A resumed run passes the same steps, so it redraws the same."""
        self.step = step

    @abstractmethod
    def corrupt(self, batch: Batch, seeds: list[int]) -> Batch:
        """Return the sidecar tensors (e.g. `noisy_input_ids`, `noise_mask`, `p_mask`) for `batch`.
        `seeds[b]` seeds sample b's own `torch.Generator`; never touch the global RNG."""

    @abstractmethod
    def token_counts(self, batch: Batch) -> dict[str, Tensor]:
        """Local denominator per loss term (e.g. {"diffusion": noise count, "ar": supervised count})."""

    @abstractmethod
    def loss(self, model: nn.Module, batch: Batch) -> LossOutput:
        """Forward the model on the corrupted batch and return summed losses per term."""

    # ---- reporting and export -----------------------------------------------------------------
    def finalize_metrics(self, metric_sums: dict[str, float]) -> dict[str, float]:
        """Turn globally summed `metric_sums` into logged metrics (default: none)."""
        return {}

    def export(self, model: nn.Module, state_dict: dict[str, Tensor], tokenizer: Any, out_dir: Path) -> None:
        """Write a consolidated Hugging Face directory from a full (unsharded, CPU) state dict. An
        override ends with `self.export_card(out_dir)` too."""
        model.save_pretrained(out_dir, state_dict=state_dict, safe_serialization=True)
        tokenizer.save_pretrained(out_dir)
        self.export_card(out_dir)

    def export_card(self, out_dir: Path, generation_config: bool = True) -> None:
        """The model card (README.md) and the `dllm` block of config.json naming the mode, the default
        sampler and the mask id (`dllmflow.models.model_card`), after the weights and configs. Also
        in generation_config.json unless `generation_config=False` (a family whose generation config
        class refuses unknown keys)."""
        from dllmflow.models.model_card import write_export_card

        write_export_card(
            out_dir, export_facts(self.settings, self.mask_token_id), generation_config=generation_config
        )


def denoiser_keys(batch: Batch) -> Tensor | None:
    """[B, L]: the keys a bidirectional denoiser attends in training, the content plus every supervised
    position past it (the block fill, and the global pad under `dllm.supervise_padding`). The sampler
    decodes those positions from [MASK]s that its whole generation window attends, so a model trained
    with them hidden never saw a masked tail as context: at 256 new tokens the tiny demo then predicted
    padding at the answer's first position. Unsupervised padding stays hidden, so a row's logits do not
    depend on how far its batch was padded. None: the batch has no attention mask (nothing padded)."""
    attention = batch.get("attention_mask")
    if attention is None:
        return None
    return attention | (batch["loss_mask"] != 0).to(attention.dtype)  # [B, L]


def export_facts(settings: Settings, mask_token_id: int | None) -> ExportFacts:
    """What the card of an export trained with `settings` says: the mode's default sampler
    (`MODES[mode].samplers[0]`) with the settings evaluation would use (its preset < the eval
    section), and the prepared data's content hash."""
    from dllmflow.data.prepared_dir import read_manifest
    from dllmflow.diffusion.modes import MODES
    from dllmflow.diffusion.samplers.configs import build_sampler_config
    from dllmflow.models.model_card import ExportFacts

    mode = settings.dllm.mode
    sampler = MODES[mode].default_sampler
    sampler_settings = {}
    if sampler is not None:
        defaults = settings.eval.model_dump(include={"max_new_tokens", "steps", "block_size", "threshold",
                                                     "temperature"})  # fmt: skip
        sampler_settings = build_sampler_config(sampler, defaults=defaults).model_dump(mode="json")
    manifest = read_manifest(settings.dataset.prepared_dir) or {}
    mixture = settings.dataset.mixture
    return ExportFacts(
        name=settings.name,
        mode=mode,
        default_sampler=sampler,
        mask_token_id=mask_token_id,
        sampler_settings=sampler_settings,
        base_model=settings.model.pretrained_model_name_or_path,
        dataset=", ".join(m.path for m in mixture) if mixture else settings.dataset.path_or_dataset_id,
        data_content_hash=manifest.get("content_hash"),
        target_model=settings.dflash.target_model_id if settings.dflash is not None else None,
    )
