"""`idlm`: Introspective Diffusion LM decoding (docs/strategies.md §3.6) with the block sampler.

I-DLM checkpoints are causal decoders trained with a next-token logit shift (docs/strategies.md §2.6), so
the logit at position p-1 fills the [MASK] at p (`logit_shift` 1). Preset: blocks (the decode stride) of
4, steps 256 for 256 new tokens (4 steps a block), threshold 0.9 (the top-1 is always committed, the
block's last step commits the rest), per-row EOS stop.

With the KV cache (preset, exact): prompts are left-padded, the committed prefix but its last token is
cached, and each step forwards that last committed token and the block (its query gives the block's
first logit; `kv.CausalShiftCache`). Causal attention makes every cached key final, so the tokens are
those of the uncached path, which runs plain causal forwards over the whole canvas (`cache: none`,
`--no-kv-cache`, or a canvas `forward` handed in).

    sampler = IDLMSampler(model, tok, IDLMConfig(max_new_tokens=64), mask_id=M)
    result = sampler.generate([ids_a, ids_b])     # prompts of different lengths in one batch
"""

from __future__ import annotations

from .base import Sampler
from .configs import IDLMConfig
from .kv import CausalShiftCache, check_cache_fits, iter_cached_block_sampler
from .loop import (
    BlockGeometry,
    BlockLoop,
    block_geometry,
    build_canvas,
    build_left_padded_canvas,
    drain,
    iter_block_sampler,
)


class IDLMSampler(Sampler):
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

    def _generate(self, prompt_ids: list[list[int]]) -> tuple[list[list[int]], int, list[int]]:
        return drain(self._iter_generate(prompt_ids))

    def _iter_generate(self, prompt_ids: list[list[int]]) -> BlockLoop:
        cfg = self.config
        geometry = block_geometry(cfg.max_new_tokens, cfg.block_size, cfg.steps, whole_blocks=False)
        if self.cached:
            return (yield from self._iter_cached(prompt_ids, geometry))
        canvas = build_canvas(prompt_ids, geometry.gen_length, self.mask_id, self.fill_id, self.device)
        x, nfe, row_nfe, positions = yield from iter_block_sampler(
            self._forward,
            canvas,
            cfg,
            geometry,
            self.mask_id,
            self.fill_id,
            self.generator(),
            self.logit_shift,
        )
        G = geometry.gen_length
        seqs = [x[b, int(s) : int(s) + G].tolist() for b, s in enumerate(canvas.gen_start)]  # kept rows
        return seqs, nfe, row_nfe.tolist(), positions.tolist()

    def _iter_cached(self, prompt_ids, geometry: BlockGeometry) -> BlockLoop:
        canvas = build_left_padded_canvas(
            prompt_ids, geometry.gen_length, self.mask_id, self.fill_id, self.device, sampler=self.name
        )
        check_cache_fits(self.model, canvas.x.shape[1], self.name, "cache 'exact'")
        source = CausalShiftCache(self.model, canvas)
        nfe, row_nfe, positions = yield from iter_cached_block_sampler(
            source, canvas, self.config, geometry, self.mask_id, self.fill_id, self.generator()
        )
        return canvas.x[:, canvas.prefix_len :].tolist(), nfe, row_nfe.tolist(), positions.tolist()
