"""`idlm`: Introspective Diffusion LM decoding (spec §3.6) with the standalone block sampler.

I-DLM checkpoints are causal decoders trained with a next-token logit shift (spec §2.6), so the
canvas runs through plain causal forwards (2D all-ones mask over prompt + window) and the logit at
position p-1 fills the [MASK] at p (`logit_shift` 1). Preset: blocks (the decode stride) of 4,
steps 256 for 256 new tokens (4 steps a block), threshold 0.9 (the top-1 is always committed, the
block's last step commits the rest), per-row EOS stop. No KV cache: a shifted logit would have to
come from a position the cache already froze (spec §3.0: shift + cache is refused).

    sampler = IDLMSampler(model, tok, build_sampler_config("idlm", {"max_new_tokens": 64}, tok), mask_id=M)
    result = sampler.generate([ids_a, ids_b])     # prompts of different lengths in one batch
"""

from __future__ import annotations

from dllmflow.errors import UserError

from .base import Sampler, SamplerConfig, block_geometry, build_canvas, run_block_sampler


class IDLMSampler(Sampler):
    name = "idlm"
    supports_infill = False
    supports_kv_cache = False
    supports_batching = True

    no_kv_cache_reason = (
        "it reads the logit of the preceding position (logit shift 1), which a KV cache cannot give"
    )

    def __init__(
        self, model, tokenizer, config: SamplerConfig, mask_id: int | None = None, forward=None, **kw
    ):
        if config.logit_shift != 1:
            raise UserError(
                f"sampler idlm needs logit_shift 1 (next-token prediction), got {config.logit_shift}"
            )
        super().__init__(model, tokenizer, config, mask_id, forward, **kw)

    # model_forward: the base class's plain causal forward (2D attention mask) is what I-DLM wants.

    def _generate(self, prompt_ids: list[list[int]]) -> tuple[list[list[int]], int, list[int]]:
        cfg = self.config
        geometry = block_geometry(cfg.max_new_tokens, cfg.block_size, cfg.steps, use_kv_cache=False)
        canvas = build_canvas(prompt_ids, geometry.gen_length, self.mask_id, self.fill_id, self.device)
        x, nfe, row_nfe = run_block_sampler(
            self._forward, canvas, cfg, geometry, self.mask_id, self.fill_id, self.generator()
        )
        seqs = [x[b, len(p) : len(p) + geometry.gen_length].tolist() for b, p in enumerate(prompt_ids)]
        return seqs, nfe, row_nfe.tolist()
