"""`nemotron`: Nemotron-Labs-Diffusion block decoding with a KV cache (docs/strategies.md §3.4).

A checkpoint that ships its own remote-code `generate(..., block_length, causal_context, ...)`
(returning `(ids, nfe)`) is decoded with it, one prompt at a time. Our hybrid checkpoints are plain
HF decoders (Qwen3, Llama), decoded here in a batch:

1. Canvas: prompts LEFT-padded to a common length S (position ids restart at each row's first real
   token, padded keys are blocked), then G = whole blocks of [MASK] (`block_size`, preset 32).
2. Attention is block-causal (`dllmflow.diffusion.masks.block_causal`): the prompt attends causally
   (`causal_context`, else bidirectionally within itself); each block sees the prompt, the earlier
   blocks and itself bidirectionally.
3. With `causal_context` the first token of each block is seeded from the logit of the position just
   before it (the AR seed: that query sees exactly its causal past), then the block's masks are filled
   over `steps / num_blocks` steps: the top-1 and every proposal with confidence >= `threshold`
   (preset 0.9), the block's last step commits the rest (never a stranded mask), per-row EOS stop.

With the KV cache (preset) the prompt is prefilled once, each step runs only the current block
against the cache, and a finished block is appended with one more forward (whose last logit is the
next block's seed). Without it (`--no_kv_cache`, or `use_kv_cache=False`) every forward runs over the
whole canvas with the same 4D mask, so both paths compute the same logits and greedy decoding gives
the same tokens. `--no_kv_cache` also turns `causal_context` off (docs/strategies.md §3.7); set `causal_context`
yourself to compare the two paths.

    sampler = NemotronSampler(model, tok, NemotronConfig(max_new_tokens=256))
    result = sampler.generate([ids_a, ids_b])
"""

from __future__ import annotations

import inspect
import math

import torch
from torch import Tensor

from dllmflow.diffusion.masks.block_causal import block_causal_mask

from .base import Sampler, native_generate
from .configs import NemotronConfig
from .loop import (
    BlockGeometry,
    LeftPaddedCanvas,
    block_geometry,
    build_left_padded_canvas,
    first_eos_done,
    get_num_transfer_tokens,
    get_transfer_index,
    gumbel_argmax,
)


class _BlockCausalForward:
    """Logits of the canvas under the block-causal mask, with or without a KV cache.

    `prefix()` -> [B, V] logit of the last prompt position; `block(lo, hi)` -> [B, hi-lo, V] logits of
    one block; `commit(lo, hi)` -> [B, V] logit of the block's last position once it is final (with
    the cache this also appends the block). `calls` counts model forwards."""

    def __init__(
        self, model, canvas: LeftPaddedCanvas, block_size: int, causal_prefix: bool, use_cache: bool
    ):
        from dllmflow.models.attention import mask_dtype

        self.model, self.c, self.bs, self.causal = model, canvas, block_size, causal_prefix
        self.dtype = mask_dtype(model, canvas.x.device)
        self.cache = None
        if use_cache:
            from transformers import DynamicCache

            self.cache = DynamicCache(config=model.config)
        self.keep_arg = "logits_to_keep" in inspect.signature(model.forward).parameters
        self.calls = 0

    def _mask(self, q_start: int, q_end: int) -> Tensor:
        keys = self.c.valid[:, :q_end] if self.cache is not None else self.c.valid
        return block_causal_mask(
            keys, self.c.prefix_len, self.bs, self.causal, self.dtype, q_start, q_end - q_start
        )

    def _logits(self, lo: int, hi: int, append: bool) -> Tensor:
        """Logits [B, hi-lo, V] of positions [lo, hi)."""
        self.calls += 1
        c = self.c
        if self.cache is None:  # the whole canvas, every forward
            kwargs = {"logits_to_keep": torch.arange(lo, hi, device=c.x.device)} if self.keep_arg else {}
            out = self.model(input_ids=c.x, attention_mask=self._mask(0, c.x.shape[1]), position_ids=c.position_ids,
                             use_cache=False, **kwargs)  # fmt: skip
            return out.logits if self.keep_arg else out.logits[:, lo:hi]
        out = self.model(input_ids=c.x[:, lo:hi], attention_mask=self._mask(lo, hi),
                         position_ids=c.position_ids[:, lo:hi], cache=self.cache, use_cache=True)  # fmt: skip
        if not append:  # the forward appended this block's provisional keys/values: drop them
            self.cache.crop(-(hi - lo))
        return out.logits

    def prefix(self) -> Tensor:
        S = self.c.prefix_len
        if self.cache is not None:
            return self._logits(0, S, append=True)[:, -1]
        return self._logits(S - 1, S, append=False)[:, -1]

    def block(self, lo: int, hi: int) -> Tensor:
        return self._logits(lo, hi, append=False)

    def commit(self, lo: int, hi: int) -> Tensor:
        if self.cache is not None:
            return self._logits(lo, hi, append=True)[:, -1]
        return self._logits(hi - 1, hi, append=False)[:, -1]


def decode_block_causal(
    model,
    canvas: LeftPaddedCanvas,
    cfg: NemotronConfig,
    geometry: BlockGeometry,
    mask_id: int,
    fill_id: int,
    generator: torch.Generator | None = None,
) -> tuple[int, Tensor]:
    """Fill `canvas.x` in place, block by block (module docstring). -> (nfe, row_nfe [B])."""
    x, S, bs = canvas.x, canvas.prefix_len, geometry.block_size
    G = geometry.gen_length
    source = _BlockCausalForward(model, canvas, bs, cfg.causal_context, cfg.use_kv_cache)
    start = torch.full((x.shape[0],), S, device=x.device)  # [B]
    done = torch.zeros(x.shape[0], dtype=torch.bool, device=x.device)  # [B]
    row_nfe = torch.zeros_like(start)

    def forward(fn, *args):
        nonlocal row_nfe
        row_nfe = row_nfe + (~done).long()  # forwards a row took part in while unfinished
        logits = fn(*args).float()
        logits[..., mask_id] = -math.inf  # a committed position must never hold [MASK]
        return logits

    def check_eos():
        nonlocal done
        if cfg.eos_token_id is not None:
            done = done | first_eos_done(x, start, G, cfg.eos_token_id, mask_id)

    # the prompt pass: fills the cache, and gives block 0's AR seed
    seed_logits = forward(source.prefix) if (cfg.use_kv_cache or cfg.causal_context) else None  # [B, V]
    for j in range(geometry.num_blocks):
        lo, hi = S + j * bs, S + (j + 1) * bs
        block = x[:, lo:hi]  # [B, bs] a view: writes land in x
        if cfg.causal_context:  # AR seed: the causal logit of the position before the block
            seed = gumbel_argmax(seed_logits, cfg.temperature, generator=generator)  # [B]
            put = ~done & (block[:, 0] == mask_id)
            block[put, 0] = seed[put].to(x.dtype)
            check_eos()
        schedule = get_num_transfer_tokens(block == mask_id, geometry.steps_per_block)  # [B, spb]
        for i in range(geometry.steps_per_block):
            candidates = (block == mask_id) & ~done[:, None]  # [B, bs]
            if not candidates.any():
                break
            logits = forward(source.block, lo, hi)  # [B, bs, V]
            last = i == geometry.steps_per_block - 1  # commit the rest: never strand a mask
            k = candidates.sum(dim=1) if last else schedule[:, i]
            threshold = None if last else cfg.threshold
            x0, transfer = get_transfer_index(
                logits, cfg.temperature, cfg.remasking, candidates, block, k, threshold, generator
            )
            block[transfer] = x0[transfer]
            check_eos()
        if bool(done.all()) or j == geometry.num_blocks - 1:
            break
        if cfg.use_kv_cache or cfg.causal_context:
            seed_logits = forward(source.commit, lo, hi)
    # rows that stopped at an EOS keep masks after it: filler (trimmed away with the EOS)
    x[:, S:][x[:, S:] == mask_id] = fill_id
    return source.calls, row_nfe


class NemotronSampler(Sampler):
    name = "nemotron"
    config_cls = NemotronConfig
    supports_infill = False
    supports_kv_cache = True
    supports_batching = True

    def _generate(self, prompt_ids: list[list[int]]) -> tuple[list[list[int]], int, list[int]]:
        cfg = self.config
        geometry = block_geometry(cfg.max_new_tokens, cfg.block_size, cfg.steps, use_kv_cache=True)
        native = native_generate(self.model, "block_length", "causal_context")
        if native is not None:
            return self._generate_native(native, prompt_ids, geometry)
        canvas = build_left_padded_canvas(
            prompt_ids, geometry.gen_length, self.mask_id, self.fill_id, self.device, sampler=self.name
        )
        nfe, row_nfe = decode_block_causal(
            self.model, canvas, cfg, geometry, self.mask_id, self.fill_id, self.generator()
        )
        S = canvas.prefix_len
        return canvas.x[:, S:].tolist(), nfe, row_nfe.tolist()

    def _generate_native(self, native, prompt_ids, geometry: BlockGeometry):
        """The checkpoint's own generate, one prompt at a time (it takes a [1, P] prompt)."""
        cfg, seqs, nfes = self.config, [], []
        for p in prompt_ids:
            ids = torch.tensor([p], dtype=torch.long, device=self.device)
            torch.manual_seed(cfg.seed)
            out, nfe = native(
                ids, max_new_tokens=geometry.gen_length, block_length=geometry.block_size, threshold=cfg.threshold,
                temperature=cfg.temperature, causal_context=cfg.causal_context, eos_token_id=cfg.eos_token_id,
            )  # fmt: skip
            gen = out[0].tolist()
            seqs.append(gen[len(p) :] if gen[: len(p)] == p else gen)  # with or without the prompt
            nfes.append(int(nfe))
        return seqs, sum(nfes), nfes
