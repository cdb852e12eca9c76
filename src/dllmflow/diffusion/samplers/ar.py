"""`ar`: greedy next-token decoding of a causal LM with its KV cache (docs/strategies.md §3.9): the
sampler of an `ar` export (the AR control, workflow/ar_control.py) and of the untrained AR base
(evaluation/ar_baseline.py), so both decode one way.

    cfg = build_sampler_config("ar", {"max_new_tokens": 32})
    out = SAMPLERS["ar"](model, tokenizer, cfg).generate([ids_a, ids_b])   # GenerationResult

The decoding is `causal_decode.iter_causal_decode`, the one causal decoder serving's `ChatEngine` uses
too: prompts left-padded to a common length S, so a row decodes as it would alone (batch invariance); one
forward reads the prompts, then one forward per new token reads only that token against the cache
(`cache: none`: the whole sequence again, same tokens). A row that emits a stop id leaves the batch (its
cached keys dropped): no forward is spent on a finished answer, and a row's forwards are its own answer
length. The loop pauses before each forward after the prompts' (`Sampler.stepper`), where a server
streams and drops rows.

    pytest tests/unit/test_ar.py tests/unit/test_causal_decode.py      # equals HF greedy `generate`
"""

from __future__ import annotations

from typing import ClassVar

from .base import Sampler
from .causal_decode import CausalDecoder, iter_causal_decode
from .configs import ARConfig
from .loop import BlockLoop, drain


class ARSampler(Sampler):
    name = "ar"
    config_cls: ClassVar[type[ARConfig]] = ARConfig
    uses_mask = False

    def _generate(self, prompt_ids: list[list[int]]) -> tuple[list[list[int]], int, list[int], list[int]]:
        return drain(self._iter_generate(prompt_ids))

    def _iter_generate(self, prompt_ids: list[list[int]]) -> BlockLoop:
        """The decoding, paused before each forward after the prompt's (a `loop.BlockLoop`: a row's
        tokens so far are final, so a server streams them and may drop rows there)."""
        decoder = CausalDecoder(
            self.model,
            prompt_ids,
            self.fill_id,
            self.stop_ids,
            [self.config.max_new_tokens] * len(prompt_ids),
            use_cache=self.config.cache != "none",
            sampler=self.name,
        )
        return (yield from iter_causal_decode(decoder))
