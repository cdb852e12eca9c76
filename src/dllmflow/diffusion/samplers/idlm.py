"""`idlm`: Introspective Diffusion LM decoding (docs/strategies.md §3.6) with the standalone block sampler.

I-DLM checkpoints are causal decoders trained with a next-token logit shift (docs/strategies.md §2.6), so the
canvas runs through plain causal forwards (2D all-ones mask over prompt + window) and the logit at
position p-1 fills the [MASK] at p (`logit_shift` 1). Preset: blocks (the decode stride) of 4,
steps 256 for 256 new tokens (4 steps a block), threshold 0.9 (the top-1 is always committed, the
block's last step commits the rest), per-row EOS stop. No KV cache: a shifted logit would have to
come from a position the cache already froze (docs/strategies.md §3.0: shift + cache is refused, so the
config has no cache option).

    sampler = IDLMSampler(model, tok, IDLMConfig(max_new_tokens=64), mask_id=M)
    result = sampler.generate([ids_a, ids_b])     # prompts of different lengths in one batch
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, PositiveInt

from .base import Sampler
from .loop import BlockConfig, block_geometry, build_canvas, run_block_sampler


class IDLMConfig(BlockConfig):
    """Preset (docs/strategies.md §3.6): 256 new tokens in blocks of 4 (the decode stride), 4 steps a block,
    threshold 0.9, EOS stop at the tokenizer's EOS; the rest as `BlockConfig`."""

    steps: PositiveInt = 256
    max_new_tokens: PositiveInt = 256
    block_size: PositiveInt | None = 4
    threshold: float | None = Field(0.9, gt=0.0, le=1.0)
    eos_token_id: int | Literal["tokenizer"] | None = "tokenizer"


class IDLMSampler(Sampler):
    name = "idlm"
    config_cls = IDLMConfig
    supports_infill = False
    supports_kv_cache = False
    supports_batching = True
    # Checkpoints trained with the next-token shift (docs/strategies.md §2.6): position p reads the logit of p - 1.
    logit_shift = 1

    no_kv_cache_reason = (
        "it reads the logit of the preceding position (logit shift 1), which a KV cache cannot give"
    )

    # model_forward: the base class's plain causal forward (2D attention mask) is what I-DLM wants.

    def _generate(self, prompt_ids: list[list[int]]) -> tuple[list[list[int]], int, list[int]]:
        cfg = self.config
        geometry = block_geometry(cfg.max_new_tokens, cfg.block_size, cfg.steps, use_kv_cache=False)
        canvas = build_canvas(prompt_ids, geometry.gen_length, self.mask_id, self.fill_id, self.device)
        x, nfe, row_nfe = run_block_sampler(
            self._forward,
            canvas,
            cfg,
            geometry,
            self.mask_id,
            self.fill_id,
            self.generator(),
            self.logit_shift,
        )
        seqs = [x[b, len(p) : len(p) + geometry.gen_length].tolist() for b, p in enumerate(prompt_ids)]
        return seqs, nfe, row_nfe.tolist()
