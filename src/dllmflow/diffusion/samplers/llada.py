"""`llada`: LLaDA's standalone masked-diffusion sampler (docs/strategies.md §3.1), optionally with
Fast-dLLM's approximate KV cache.

Semi-autoregressive blocks over each row's own generation window, a transfer schedule per block,
low-confidence or random remasking, Gumbel sampling with temperature, an optional confidence
threshold (top-1 always committed, the block's last step commits the rest), per-row EOS stop when
`eos_token_id` is set, and infill of [MASK] spans. The model attends bidirectionally: a plain HF
decoder is run through `dllmflow.models.attention.forward_bidirectional`.

`cache` (Fast-dLLM, Wu et al. 2025; `kv.FastDLLMCache`): 'prefix' reuses the keys of the prompt and
the committed blocks within a block, 'dual' also those of the still-masked suffix; both are refreshed
by a full forward at each block boundary (which is the block's first step). The prompts are then
left-padded, so every row's block is the same slice. Approximate: the tokens may differ from 'none'.

    sampler = LLaDASampler(model, tokenizer, LLaDAConfig(threshold=0.9))  # = build_sampler_config("llada", ..)
    result = sampler.generate([ids_a, ids_b])     # prompts of different lengths in one batch
"""

from __future__ import annotations

import time

import torch
from torch import Tensor

from dllmflow.errors import UserError

from .base import BlockSampler, GenerationResult
from .configs import LLaDAConfig
from .kv import FastDLLMCache, fast_dllm_canvas
from .loop import FullForward, build_canvas, run_infill


class LLaDASampler(BlockSampler):
    name = "llada"
    config_cls = LLaDAConfig
    supports_infill = True
    supports_batching = True

    def __init__(self, model, tokenizer, config, mask_id: int | None = None, forward=None, **kw):
        super().__init__(model, tokenizer, config, mask_id, forward, **kw)
        eos = getattr(tokenizer, "eos_token_id", None)
        if self.config.eos_truncate and self.config.eos_token_id is None:  # truncation needs an EOS
            if eos is None:
                raise UserError("sampler llada with eos_truncate needs eos_token_id or a tokenizer EOS")
            self.config = self.config.model_copy(update={"eos_token_id": int(eos)})

    def model_forward(self, input_ids: Tensor, attention_mask: Tensor, logits_to_keep: int = 0) -> Tensor:
        from dllmflow.models.attention import forward_bidirectional

        return forward_bidirectional(self.model, input_ids, attention_mask, logits_to_keep)  # [B, T|n, V]

    def logits_source(self, prompt_ids: list[list[int]], gen_length: int):
        if self.config.cache == "none":
            canvas = build_canvas(prompt_ids, gen_length, self.mask_id, self.fill_id, self.device)
            return canvas, FullForward(self._forward, canvas)
        # Fast-dLLM's prefix or dual cache, on a left-padded canvas
        canvas = fast_dllm_canvas(self, prompt_ids, gen_length, self.config.cache)
        return canvas, FastDLLMCache(self.model, canvas, self.config.cache)

    def infill(self, seqs: list[list[int]]) -> GenerationResult:
        """Fill the [MASK] positions of whole sequences; returns the full filled sequences (untrimmed)."""
        if self.config.cache != "none":
            raise UserError(
                f"sampler llada does not infill with cache {self.config.cache!r}; set cache 'none'"
            )
        t0 = time.perf_counter()
        with torch.inference_mode():
            x, lengths, nfe = run_infill(
                self._forward, seqs, self.config, self.mask_id, self.fill_id, self.device, self.generator()
            )
        out = [x[b, : int(n)].tolist() for b, n in enumerate(lengths)]
        filled = sum(s.count(self.mask_id) for s in seqs)
        # every forward runs over each whole sequence (the masks may sit anywhere: no EOS stop applies)
        positions = [nfe * len(q) for q in seqs]
        return GenerationResult(out, nfe, filled, time.perf_counter() - t0, [nfe] * len(seqs), positions)
