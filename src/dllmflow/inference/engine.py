"""The serving engine of `dllmflow serve`: a causal LM generating batches a few tokens at a time, and the
scheduler that gives every active batch a turn (round-robin), so a long request delays a short one by a
few turns instead of holding the model until it is done.

    engine = ChatEngine("runs/target")                     # model + tokenizer with a chat template
    scheduler = Scheduler(engine, max_batch_size=16, chunk_tokens=8)
    scheduler.submit(ChatRequest(prompt_ids, max_tokens=32, temperature=0.8, top_p=1.0, seed=7))
    await scheduler.run()                                   # the one worker that owns the model

`inference/serve.py` puts the HTTP API (OpenAI chat completions) in front of it.

Seeded sampling: a request with a `seed` draws its tokens from its own `torch.Generator` seeded with it,
so its tokens depend only on its prompt, settings and seed, never on what else shares its batch (its
logits do not depend on the other rows, up to float rounding of the padded batch). Requests without a
seed share the global RNG, as before.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import inspect
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dllmflow.errors import UserError
from dllmflow.runs import find_export

log = logging.getLogger("dllmflow.inference.serve")


class DecodeAborted(Exception):
    """A turn stopped between two forwards: every row of its batch is gone (timed out, client gone) or
    the server is stopping (`DllmEngine`: a dLLM block is up to --max-tokens-cap forwards)."""


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
    """A batch being generated: its live rows, their attention mask and KV cache."""

    reqs: list[ChatRequest]
    mask: Any  # [B, L] 1 = real token, 0 = left padding
    cache: Any  # transformers Cache over the same B rows


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
    `prefill(reqs)` starts a `Decode`, `step(decode, n)` adds up to n tokens per live row."""

    stopping = False  # set at the server's shutdown; a turn is only --chunk-tokens forwards: nothing waits

    def __init__(self, model_path: str | os.PathLike, dtype: str = "float32"):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from dllmflow.models.integrity import check_checkpoint_files, check_loaded_weights

        path = Path(model_path)
        if not path.is_dir():
            raise UserError(
                f"--model-path {path}: not a directory; point it at a saved HF model (config + weights)"
            )
        path = find_export(path) or path  # a run dir or checkpoint root serves its consolidated export
        header = check_checkpoint_files(path)  # a cut-short or corrupt weight file: one line, before loading
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(path)
            self.model, info = AutoModelForCausalLM.from_pretrained(
                path, dtype=getattr(torch, dtype), output_loading_info=True, ignore_mismatched_sizes=True
            )
        except (OSError, ValueError) as e:
            raise UserError(
                f"--model-path {path}: cannot load the tokenizer/model ({str(e).strip().splitlines()[0]})"
            ) from None
        self.model.eval()
        check_loaded_weights(self.model, info, header, path)  # missing/unexpected/reshaped/non-finite: named
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
        # transformers 5 renamed `past_key_values` to `cache`; remote-code models may still use the old name
        params = inspect.signature(self.model.forward).parameters
        self.cache_arg = "cache" if "cache" in params else "past_key_values"
        self.extra_args = {"logits_to_keep": 1} if "logits_to_keep" in params else {}  # last position only
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
        import torch
        from transformers import DynamicCache

        width = max(len(r.prompt_ids) for r in reqs)
        pad = self.tokenizer.pad_token_id
        input_ids = torch.tensor([[pad] * (width - len(r.prompt_ids)) + r.prompt_ids for r in reqs])  # [B, L]
        mask = torch.tensor(
            [[0] * (width - len(r.prompt_ids)) + [1] * len(r.prompt_ids) for r in reqs]
        )  # [B, L]
        decode = Decode(reqs, mask, DynamicCache())
        self._forward(decode, input_ids, (mask.cumsum(-1) - 1).clamp(min=0))
        return decode

    def step(self, decode: Decode, num_tokens: int) -> Decode:
        """Up to `num_tokens` more tokens for every live row; finished rows leave the batch as they stop."""
        import torch

        for _ in range(num_tokens):
            if not decode.reqs:
                break
            last = torch.tensor([[r.tokens[-1]] for r in decode.reqs])  # [B, 1]
            decode.mask = torch.cat([decode.mask, torch.ones_like(last)], dim=1)  # [B, L + 1]
            self._forward(decode, last, decode.mask.sum(-1, keepdim=True) - 1)  # positions skip the padding
        return decode

    def _forward(self, decode: Decode, input_ids, position_ids) -> None:
        import torch

        with torch.inference_mode():
            out = self.model(
                input_ids=input_ids,
                attention_mask=decode.mask,
                position_ids=position_ids,
                use_cache=True,
                **{self.cache_arg: decode.cache},
                **self.extra_args,
            )
            first, logits = decode.reqs[0], out.logits[:, -1]  # [B, V]
            generators = [r.generator(logits.device) for r in decode.reqs]
            next_ids = sample(logits, first.temperature, first.top_p, generators).tolist()  # [B]
        for req, tok in zip(decode.reqs, next_ids):
            req.tokens.append(tok)
            if tok in self.eos_ids:
                req.finish_reason = "stop"
            elif len(req.tokens) >= req.max_tokens:
                req.finish_reason = "length"
        self.keep(decode, [i for i, r in enumerate(decode.reqs) if r.finish_reason is None])

    def keep(self, decode: Decode, rows: list[int]) -> None:
        """Drop every other row from the batch (its cache too): finished or cancelled rows cost nothing."""
        import torch

        if len(rows) == len(decode.reqs):
            return
        decode.reqs = [decode.reqs[i] for i in rows]
        if rows:
            index = torch.tensor(rows)
            decode.mask = decode.mask[index]
            decode.cache.batch_select_indices(index)

    def text(self, req: ChatRequest) -> str:
        new = req.tokens[:-1] if req.finish_reason == "stop" else req.tokens
        return self.tokenizer.decode(new, skip_special_tokens=True)

    def result(self, req: ChatRequest) -> dict[str, Any]:
        return {
            "text": self.text(req),
            "finish_reason": req.finish_reason,
            "prompt_tokens": len(req.prompt_ids),
            "completion_tokens": len(req.tokens),  # the stop token counts, as in OpenAI usage
        }


class Scheduler:
    """One worker owns the model: it batches queued requests and gives every active batch a turn of
    `chunk_tokens` tokens in round-robin, so no request waits for another to finish."""

    def __init__(
        self,
        engine: ChatEngine,
        max_batch_size: int,
        chunk_tokens: int = 8,
        *,
        batch_wait_s: float = 0.005,
        incoming: Callable[[], int] | None = None,
        settle_s: float = 0.05,
    ):
        self.engine = engine
        self.max_batch_size = max_batch_size
        self.chunk_tokens = chunk_tokens
        self.batch_wait_s = batch_wait_s
        # Requests the server is still reading and validating: a batch being formed waits for them (at
        # most `settle_s`), so clients that send together share a batch. None: only the queue counts.
        self.incoming = incoming or (lambda: 0)
        self.settle_s = settle_s
        self.queue: asyncio.Queue[ChatRequest] = asyncio.Queue()
        self.full = asyncio.Event()  # set by `submit` when the batch being formed has no room left
        self.room = 0  # rows that batch can still take (0: none is being formed)
        self.active: collections.deque[Decode] = collections.deque()
        self.running: list[ChatRequest] = []  # rows of the batch taking its turn now
        self.counters = {"batches": 0, "max_batch_size_seen": 0, "turns": 0, "dropped": 0, "early_events": 0}
        self.loop: asyncio.AbstractEventLoop | None = None  # the server's, once `run` started

    def submit(self, req: ChatRequest) -> None:
        self.queue.put_nowait(req)
        if self.room:  # a batch is being formed
            self.room -= 1
            if not self.room:
                self.full.set()

    def stats(self) -> dict[str, int]:
        return {
            **self.counters,
            "active_rows": len(self.running) + sum(len(d.reqs) for d in self.active),
            "queued": self.queue.qsize(),
        }

    def publish(self, req: ChatRequest, event: tuple) -> None:
        """Queue `event` for `req` from the worker thread during a turn (a dLLM row's block that is final
        before its batch's: `DllmEngine`), in order before what the turn's end queues."""
        self.counters["early_events"] += 1
        self.loop.call_soon_threadsafe(req.events.put_nowait, event)

    async def run(self) -> None:
        self.loop = asyncio.get_running_loop()
        while True:
            await self._admit(wait=not self.active)
            if self.active:
                decode = self.active.popleft()
                live = [i for i, r in enumerate(decode.reqs) if not r.cancelled]
                self.counters["dropped"] += len(decode.reqs) - len(live)
                self.engine.keep(decode, live)
                if decode.reqs:
                    await self._turn(
                        decode.reqs, functools.partial(self.engine.step, decode, self.chunk_tokens)
                    )

    async def _admit(self, wait: bool) -> None:
        """Start a batch per sampling setting from what is queued; when idle, wait for requests first."""
        pending = []
        if wait:
            pending.append(await self.queue.get())
            await self._gather(pending)
        while not self.queue.empty():
            pending.append(self.queue.get_nowait())
        groups: dict[tuple, list[ChatRequest]] = {}
        for req in pending:
            groups.setdefault(req.batch_key(), []).append(req)
        for group in groups.values():
            for start in range(0, len(group), self.max_batch_size):
                batch = [r for r in group[start : start + self.max_batch_size] if not r.cancelled]
                self.counters["dropped"] += min(self.max_batch_size, len(group) - start) - len(batch)
                if batch:
                    self.counters["batches"] += 1
                    self.counters["max_batch_size_seen"] = max(
                        self.counters["max_batch_size_seen"], len(batch)
                    )
                    await self._turn(batch, functools.partial(self.engine.prefill, batch))

    async def _gather(self, pending: list[ChatRequest]) -> None:
        """Collect the requests sent together with `pending[0]`: they arrive a few ms apart. Windows of
        `batch_wait_s` while requests keep arriving or are being read (the latter for at most
        `settle_s`), but not once the batch is full: waiting longer cannot grow it."""
        loop = asyncio.get_running_loop()
        settle = loop.time() + self.settle_s
        try:
            while True:
                while not self.queue.empty() and len(pending) < self.max_batch_size:
                    pending.append(self.queue.get_nowait())
                if len(pending) >= self.max_batch_size:
                    return
                # `submit` wakes this wait only when the batch fills, not per arrival: a wake costs the
                # loop time the next arrivals' reading needs.
                self.room = self.max_batch_size - len(pending)  # the queue is drained: not full
                self.full.clear()
                try:
                    async with asyncio.timeout(self.batch_wait_s):
                        await self.full.wait()
                except TimeoutError:
                    if self.queue.empty() and not (self.incoming() and loop.time() < settle):
                        return
        finally:
            self.room = 0

    async def _turn(self, reqs: list[ChatRequest], work) -> None:
        """Run one turn (`work` returns the batch's Decode) in a thread, answer the rows it finished and
        requeue the batch while rows are live."""
        self.counters["turns"] += 1
        self.running = reqs
        try:
            decode = await asyncio.to_thread(work)
        except DecodeAborted as e:  # nobody waits for these rows any more: drop the batch
            log.info("%s", e)
            self.counters["dropped"] += len(reqs)
            for req in reqs:
                req.events.put_nowait(("error", e))
            return
        except Exception as e:  # answer every waiter; the server keeps running
            log.exception("generation failed")
            for req in reqs:
                req.events.put_nowait(("error", e))
            return
        finally:
            self.running = []
        for req in reqs:
            if req.finish_reason is not None:
                req.events.put_nowait(("done", self.engine.result(req)))
            elif req.stream:
                req.events.put_nowait(("tokens", list(req.tokens)))
        # Let the streams send what this turn committed before the next turn's thread competes with
        # them for the GIL: a few loop iterations (each stream takes its event and writes it in one).
        for _ in range(8):
            if all(r.events.empty() for r in reqs):
                break
            await asyncio.sleep(0)
        if decode.reqs:
            self.active.append(decode)


def build_tiny_chat_lm(
    out: str | os.PathLike, hidden_size: int = 32, max_positions: int = 512, never_stop: bool = False
) -> Path:
    """Write a tiny random Llama chat LM (~40k parameters at hidden 32, BPE tokenizer of 300 tokens with
    the default chat template) to `out`, seeded: something to serve offline (tests, benchmarks, trying
    `dllmflow serve`). The head is untied: a tied tiny head just repeats the last token. `never_stop`
    zeroes the stop token's output row, so among ~300 random logits one always beats it and greedy
    decoding runs to max_tokens (a long request really is long)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from dllmflow.data.tokenizer import train_bpe_tokenizer

    out = Path(out)
    tok = train_bpe_tokenizer(
        ["Natalia sold 48 clips to her friends in April and May."] * 8, 300, "<mask>", "<pad>", "<eos>"
    )
    tok.save_pretrained(out)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
        tie_word_embeddings=False, initializer_range=0.5, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, bos_token_id=None,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    if never_stop:
        with torch.no_grad():
            model.lm_head.weight[tok.eos_token_id] = 0
    model.save_pretrained(out)
    return out
