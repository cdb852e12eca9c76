"""`idlm`: Introspective Diffusion LM decoding (docs/strategies.md §3.6) with the block sampler.

I-DLM checkpoints are causal decoders trained with a next-token logit shift (docs/strategies.md §2.6), so
the logit at position p-1 fills the [MASK] at p (`logit_shift` 1). Preset: blocks (the decode stride) of
4, steps 256 for 256 new tokens (4 steps a block), threshold 0.9 (the top-1 is always committed, the
block's last step commits the rest), per-row EOS stop.

With the KV cache (preset, exact): prompts are left-padded, the committed prefix but its last token is
cached, and each step forwards that last committed token and the block (its query gives the block's
first logit; `kv.CausalShiftCache`). Causal attention makes every cached key final, so the tokens are
those of the uncached path, which runs plain causal forwards over the whole canvas (`cache: none`, or a
canvas `forward` handed in).

    sampler = IDLMSampler(model, tok, IDLMConfig(max_new_tokens=64), mask_id=M)
    result = sampler.generate([ids_a, ids_b])     # prompts of different lengths in one batch
"""

from __future__ import annotations

from .base import BlockSampler
from .configs import IDLMConfig
from .kv import CausalShiftCache, check_cache_fits
from .loop import FullForward, build_canvas, build_left_padded_canvas


class IDLMSampler(BlockSampler):
    name = "idlm"
    config_cls = IDLMConfig
    supports_infill = False
    supports_batching = True
    # Checkpoints trained with the next-token shift (docs/strategies.md §2.6): position p reads the logit of p - 1.
    logit_shift = 1

    # model_forward: the base class's plain causal forward (2D attention mask) is what I-DLM wants.

    def __init__(self, model, tokenizer, config, mask_id: int | None = None, forward=None, **kw):
        super().__init__(model, tokenizer, config, mask_id, forward, **kw)
        # A canvas forward handed in cannot take a cache; the cache is exact, so its tokens are the same.
        self.cached = self.config.cache == "exact" and forward is None

    def logits_source(self, prompt_ids: list[list[int]], gen_length: int):
        if not self.cached:
            canvas = build_canvas(prompt_ids, gen_length, self.mask_id, self.fill_id, self.device)
            return canvas, FullForward(self._forward, canvas, self.logit_shift)
        # left-padded: the cached prefix is the same slice of every row
        canvas = build_left_padded_canvas(
            prompt_ids, gen_length, self.mask_id, self.fill_id, self.device, sampler=self.name
        )
        check_cache_fits(self.model, canvas.x.shape[1], self.name, "cache 'exact'")
        return canvas, CausalShiftCache(self.model, canvas)
