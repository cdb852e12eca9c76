"""`ar`: greedy next-token decoding of a causal LM with its KV cache (docs/strategies.md §3.9): the
sampler of an `ar` export (the AR control, workflow/ar_control.py) and of the untrained AR base
(evaluation/ar_baseline.py), so both decode one way.

    cfg = build_sampler_config("ar", {"max_new_tokens": 32})
    out = SAMPLERS["ar"](model, tokenizer, cfg).generate([ids_a, ids_b])   # GenerationResult

The prompts are left-padded to a common length S (`loop.build_left_padded_canvas`): position ids
restart at each row's first real token and padded keys are blocked, so a row decodes as it would
alone (batch invariance). One forward reads the prompts, then one forward per new token reads only
that token against the cache (`cache: none`: the whole sequence again, same tokens). A row that emits a stop id leaves the batch (its cached keys dropped):
no forward is spent on a finished answer, and a row's forwards are its own answer length. The loop pauses
before each forward after the prompts' (`Sampler.stepper`), where a server streams and drops rows.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

from dllmflow.diffusion.masks.block_causal import block_causal_mask

from .base import Sampler
from .configs import ARConfig
from .kv import ModelCache
from .loop import BlockLoop, build_left_padded_canvas, drain
from .token_steps import pause_rows


class ARSampler(Sampler):
    name = "ar"
    config_cls: ClassVar[type[ARConfig]] = ARConfig
    uses_mask = False

    def _generate(self, prompt_ids: list[list[int]]) -> tuple[list[list[int]], int, list[int], list[int]]:
        return drain(self._iter_generate(prompt_ids))

    def _iter_generate(self, prompt_ids: list[list[int]]) -> BlockLoop:
        """The decoding, paused before each forward after the prompt's (a `loop.BlockLoop`: a row's
        tokens so far are final, so a server streams them and may drop rows there)."""
        G = self.config.max_new_tokens
        c = build_left_padded_canvas(
            prompt_ids, G, self.fill_id, self.fill_id, self.device, sampler=self.name
        )
        kv = ModelCache(self.model, c.x.device)
        S, B = c.prefix_len, len(prompt_ids)
        live = torch.arange(B, device=c.x.device)  # [b] original row of each live row
        out: list[list[int]] = [[] for _ in range(B)]
        row_nfe, positions = [0] * B, [0] * B  # forwards and positions computed per row
        stop = torch.tensor(sorted(self.stop_ids), dtype=torch.long, device=c.x.device)  # [n_stop]
        batch = list(range(B))  # the rows the caller holds (it may drop some between forwards), in its order
        going = torch.ones(B, dtype=torch.bool, device=c.x.device)  # [b] live rows that emitted no stop id
        for t in range(G):
            if t:  # 0) the pause: the caller sees every row's tokens and may drop rows; a row that emitted
                #    a stop id, or that the caller dropped, leaves the batch before the next forward
                batch = yield from pause_rows(batch, out, set(live[going].tolist()), row_nfe, positions)
                keep = (
                    (going & torch.isin(live, torch.tensor(batch, device=live.device))).nonzero().squeeze(1)
                )
                if not len(keep):
                    break
                if len(keep) < len(live):
                    live = live[keep]
                    c.select_rows(keep)
                    kv.select_rows(keep)
            # 1) the next token of every live row: forward what the cache lacks (the prompt, then the
            #    last token; everything again without a cache), read the last position
            lo = kv.length
            logits = self._step(kv, c, lo, S + t)  # [b, V]
            computed = c.valid[:, lo : S + t].sum(dim=1).tolist()  # [b] real positions forwarded
            if self.config.cache == "none":
                kv.truncate(0)
            token = logits.argmax(-1)  # [b]
            c.x[:, S + t] = token
            for r, tok, n in zip(live.tolist(), token.tolist(), computed):
                out[r].append(tok)
                row_nfe[r] += 1
                positions[r] += n
            going = ~torch.isin(token, stop)  # [b]
            if not bool(going.any()):
                break
        return [out[r] for r in batch], kv.calls, [row_nfe[r] for r in batch], [positions[r] for r in batch]

    def _step(self, kv: ModelCache, c, lo: int, hi: int) -> Tensor:
        """Forward canvas positions [lo, hi) against the cache; the logits of position hi-1 [b, V]."""
        mask = block_causal_mask(c.valid[:, :hi], hi, 1, True, kv.dtype, lo, hi - lo)  # [b, 1, Q, hi]
        return kv.forward(c.x[:, lo:hi], mask, c.position_ids[:, lo:hi], hi - lo - 1, hi - lo)[:, -1]
