"""The causal serving engine of `dllmflow serve`: a causal LM generating batches a few tokens at a time,
driven by `inference/scheduler.py`'s round-robin `Scheduler` (a long request delays a short one by a few
turns instead of holding the model until it is done).

    engine = ChatEngine("runs/target")                     # model + tokenizer with a chat template
    scheduler = Scheduler(engine, max_batch_size=16, chunk_tokens=8)      # inference/scheduler.py
    scheduler.submit(ChatRequest(prompt_ids, max_tokens=32, temperature=0.8, top_p=1.0, seed=7))

`inference/serve.py` puts the HTTP API (OpenAI chat and text completions) in front of it. The decoding
loop is `diffusion/samplers/causal_decode.py`'s, the one the `ar` sampler runs too (left-padded rows, a
KV cache, a row leaving the batch as it stops); the engine brings its own token draw (`sample`) and runs
the loop a few forwards per turn.

Seeded sampling: a request with a `seed` draws its tokens from its own `torch.Generator` seeded with it,
so its tokens depend only on its prompt, settings and seed, never on what else shares its batch (its
logits do not depend on the other rows, up to float rounding of the padded batch). Requests without a
seed share the global RNG, as before.
"""

from __future__ import annotations

import asyncio
import inspect
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dllmflow.errors import UserError


@dataclass(eq=False)
class ChatRequest:
    """One accepted request as the scheduler sees it; `events` carries ("tokens" | "done" | "error", x)."""

    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    stream: bool = False
    seed: int | None = None  # the request's own generator draws its samples (None: the global RNG)
    tokens: list[int] = field(default_factory=list)  # new tokens, the stop token included
    finish_reason: str | None = None  # "stop" | "length" once finished
    cancelled: bool = False  # timed out or disconnected: dropped at the next turn
    events: asyncio.Queue = field(default_factory=asyncio.Queue, repr=False)
    _generator: Any = field(default=None, repr=False)

    def generator(self, device) -> Any:
        """This request's `torch.Generator` (created on first use, seeded with `seed`); None unseeded."""
        import torch

        if self.seed is not None and self._generator is None:
            self._generator = torch.Generator(device=device).manual_seed(self.seed)
        return self._generator

    def batch_key(self) -> tuple:
        """Rows of one batch sample the same way (max_tokens may differ: rows finish on their own)."""
        return (self.temperature, self.top_p)


@dataclass(eq=False)
class Decode:
    """A batch being generated: its live rows and the causal decoding loop they run in."""

    reqs: list[ChatRequest]
    loop: Any  # causal_decode.iter_causal_decode, paused before its next forward
    held: list[ChatRequest]  # the loop's rows in its order: `reqs` once dropped rows are sent to it


def sample(logits, temperature: float, top_p: float, generators=None):
    """Next token per row from `logits` [B, V]: argmax at temperature 0, else temperature + nucleus.
    `generators` (one per row, None for a row without its own) makes a row's draw depend only on its
    generator: each seeded row is drawn alone, the unseeded rows together from the global RNG."""
    import torch

    if temperature == 0:
        return logits.argmax(-1)  # [B]
    probs = torch.softmax(logits.float() / temperature, dim=-1)  # [B, V]
    order = None
    if top_p < 1:
        probs, order = probs.sort(dim=-1, descending=True, stable=True)  # [B, V]
        # keep the smallest prefix whose mass reaches top_p (the token that crosses it stays)
        probs[(probs.cumsum(-1) - probs) > top_p] = 0
    picks = _draw(probs, generators)  # [B] indices into probs' columns
    return picks if order is None else order.gather(-1, picks[:, None]).squeeze(-1)  # [B]


def _draw(probs, generators):
    """One multinomial draw per row of `probs` [B, V]; rows with a generator use it alone."""
    import torch

    if generators is None or all(g is None for g in generators):
        return torch.multinomial(probs, 1).squeeze(-1)  # [B]
    picks = torch.empty(probs.shape[0], dtype=torch.long, device=probs.device)  # [B]
    if free := [i for i, g in enumerate(generators) if g is None]:
        picks[free] = torch.multinomial(probs[free], 1).squeeze(-1)
    for i, g in enumerate(generators):
        if g is not None:  # a [1, V] draw: the same random numbers whatever the batch holds
            picks[i] = torch.multinomial(probs[i : i + 1], 1, generator=g)[0, 0]
    return picks


class ChatEngine:
    """A causal LM + tokenizer with a chat template, generating a batch a few tokens at a time:
    `prefill(reqs)` starts a `Decode`, `step(decode, n)` adds up to n tokens per live row. `model_path`:
    a saved HF dir (`serve_cli` resolves a run dir to its export first: `dllm_engine.resolve_served`)."""

    stopping = False  # set at the server's shutdown; a turn is only --chunk-tokens forwards: nothing waits

    def __init__(self, model_path: str | os.PathLike, dtype: str = "float32"):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from dllmflow.models.integrity import load_checked

        path = Path(model_path)
        if not path.is_dir():
            raise UserError(
                f"--model-path {path}: not a directory; point it at a saved HF model (config + weights)"
            )

        def load():
            try:
                self.tokenizer = AutoTokenizer.from_pretrained(path)
                return AutoModelForCausalLM.from_pretrained(
                    path, dtype=getattr(torch, dtype), output_loading_info=True, ignore_mismatched_sizes=True
                )
            except (OSError, ValueError) as e:
                raise UserError(
                    f"--model-path {path}: cannot load the tokenizer/model ({str(e).strip().splitlines()[0]})"
                ) from None

        # corrupt files, then missing/unexpected/reshaped/non-finite tensors: one line naming them
        self.model = load_checked(path, load).eval()
        if self.tokenizer.eos_token_id is None:  # a causal LM needs only an end of answer
            raise UserError(f"--model-path {path}: the tokenizer has no eos_token; answers would never end")
        if not self.tokenizer.chat_template:
            raise UserError(
                f"--model-path {path}: the tokenizer has no chat_template; save one with the tokenizer"
            )
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.max_length = int(getattr(self.model.config, "max_position_embeddings", 0) or 1 << 30)
        self.eos_ids = self._eos_ids()
        # chat_template_kwargs are template variables (enable_thinking, ...), never apply_chat_template's own
        # options: a client must not swap the template (`chat_template`) or change tokenization.
        self.reserved_template_args = set(inspect.signature(self.tokenizer.apply_chat_template).parameters)

    def _eos_ids(self) -> list[int]:
        ids = self.model.generation_config.eos_token_id
        ids = [ids] if isinstance(ids, int) else list(ids or [])
        if self.tokenizer.eos_token_id is not None and self.tokenizer.eos_token_id not in ids:
            ids.append(self.tokenizer.eos_token_id)
        return ids

    def encode(self, messages: list[dict[str, Any]], template_kwargs: dict[str, Any]) -> list[int]:
        out = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, **template_kwargs
        )
        return list(out["input_ids"] if hasattr(out, "keys") else out)

    def prefill(self, reqs: list[ChatRequest]) -> Decode:
        """Run the left-padded prompts of requests sharing a batch key; sample each row's first token."""
        from dllmflow.diffusion.samplers.causal_decode import CausalDecoder, iter_causal_decode

        first = reqs[0]  # the rows of a batch sample alike (`batch_key`)

        def pick(logits, rows: list[int]):  # logits [b, V] of the original rows `rows`
            generators = [reqs[r].generator(logits.device) for r in rows]
            return sample(logits, first.temperature, first.top_p, generators)  # [b]

        decoder = CausalDecoder(
            self.model, [r.prompt_ids for r in reqs], self.tokenizer.pad_token_id, set(self.eos_ids),
            [r.max_tokens for r in reqs], pick=pick, out=[r.tokens for r in reqs], sampler="serve",
        )  # fmt: skip
        decode = Decode(list(reqs), iter_causal_decode(decoder), list(reqs))
        self._advance(decode, None)
        return decode

    def step(self, decode: Decode, num_tokens: int) -> Decode:
        """Up to `num_tokens` more tokens for every live row; finished rows leave the batch as they stop."""
        for _ in range(num_tokens):
            if not decode.reqs:
                break
            # the loop drops, before its forward, the rows no longer live (finished or cancelled)
            kept = [i for i, r in enumerate(decode.held) if r in decode.reqs]
            decode.held = [decode.held[i] for i in kept]
            self._advance(decode, kept)
        return decode

    def _advance(self, decode: Decode, kept: list[int] | None) -> None:
        """One forward of the loop (to its next pause, or its end); then rows that stopped finish."""
        import torch

        try:
            with torch.inference_mode():
                decode.loop.send(kept)
        except StopIteration:
            pass  # every row held stopped: each has its finish reason below
        for req in decode.reqs:
            if req.tokens and req.tokens[-1] in self.eos_ids:
                req.finish_reason = "stop"
            elif len(req.tokens) >= req.max_tokens:
                req.finish_reason = "length"
        decode.reqs = [r for r in decode.reqs if r.finish_reason is None]

    def keep(self, decode: Decode, rows: list[int]) -> None:
        """Drop every other row from the batch: the loop drops it (its cached keys too) before its next
        forward, so finished or cancelled rows cost nothing."""
        decode.reqs = [decode.reqs[i] for i in rows]

    def text(self, req: ChatRequest) -> str:
        new = req.tokens[:-1] if req.finish_reason == "stop" else req.tokens
        return self.tokenizer.decode(new, skip_special_tokens=True)

    def partial_text(self, tokens: list[int]) -> str:
        """The text of an unfinished row's tokens so far (a streamed turn)."""
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def result(self, req: ChatRequest) -> dict[str, Any]:
        return {
            "text": self.text(req),
            "finish_reason": req.finish_reason,
            "prompt_tokens": len(req.prompt_ids),
            "completion_tokens": len(req.tokens),  # the stop token counts, as in OpenAI usage
        }
