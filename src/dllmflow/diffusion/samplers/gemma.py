"""`gemma`: DiffusionGemma's own `generate` (docs/strategies.md §3.5): entropy-bounded denoising of random-token
canvases, one `canvas_length` block after another, with adaptive stopping (all upstream defaults).

Only `--steps` (as `max_denoising_steps`, preset 48) and `--max_new_tokens` (preset 256) are
forwarded; prompts run one at a time; infill and a KV-cache switch do not apply. The model is a
`DiffusionGemmaForBlockDiffusion` loaded with `dllmflow.models.diffusion_gemma.load_diffusion_gemma`
(a full export, or the base with the trained decoder tensors overlaid).

    model = load_diffusion_gemma("runs/x/checkpoints/LATEST/model/consolidated")
    result = GemmaSampler(model, tokenizer, GemmaConfig()).generate([prompt_ids])
"""

from __future__ import annotations

import torch

from dllmflow.errors import UserError

from .base import Sampler
from .configs import GemmaConfig


class GemmaSampler(Sampler):
    name = "gemma"
    config_cls = GemmaConfig
    supports_infill = False
    supports_batching = False
    no_cache_reason = "it runs DiffusionGemma's own generate, whose caching is upstream's"

    def __init__(self, model, tokenizer, config, mask_id: int | None = None, forward=None, **kw):
        if not hasattr(model, "generate") or not hasattr(getattr(model, "model", None), "decoder"):
            raise UserError(
                f"sampler gemma needs a DiffusionGemmaForBlockDiffusion checkpoint, got {type(model).__name__}"
            )
        # Block diffusion has no [MASK]; the base class still wants an id, any in-vocabulary one does.
        fallback = getattr(tokenizer, "mask_token_id", None)
        super().__init__(
            model, tokenizer, config, mask_id if mask_id is not None else (fallback or 0), forward, **kw
        )
        eos = getattr(tokenizer, "eos_token_id", None)
        if eos is None:
            raise UserError("sampler gemma needs an EOS token (tokenizer.eos_token_id) to stop generation")
        self.eos_id = int(eos)
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad_id = int(pad if pad is not None else eos)

    def _generate(self, prompt_ids: list[list[int]]) -> tuple[list[list[int]], int, list[int]]:
        (prompt,) = prompt_ids  # supports_batching = False: the base class feeds one prompt at a time
        input_ids = torch.tensor([prompt], dtype=torch.long, device=self.device)  # [1, P]
        calls = [0]
        hook = self.model.model.decoder.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
        # The canvas is drawn from the global RNG inside `generate`: seed a forked RNG, leave the caller's alone.
        devices = [self.device] if self.device.type == "cuda" else []
        try:
            with torch.random.fork_rng(devices=devices):
                torch.manual_seed(self.config.seed)
                out = self.model.generate(
                    input_ids,
                    max_new_tokens=self.config.max_new_tokens,
                    max_denoising_steps=self.config.steps,
                    eos_token_id=self.eos_id,
                    pad_token_id=self.pad_id,
                )
        finally:
            hook.remove()
        sequences = out.sequences if hasattr(out, "sequences") else out  # [1, P + n_canvases * canvas]
        tail = sequences[0, len(prompt) :][: self.config.max_new_tokens].tolist()
        return [tail], calls[0], [calls[0]]
