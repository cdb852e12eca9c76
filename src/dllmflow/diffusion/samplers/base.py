"""The sampler interface (docs/strategies.md §3.0): the `Sampler` base class (and `BlockSampler`, the
samplers of `loop.iter_block_loop`), mask-id resolution and response trimming. The configs and `build_sampler_config` live in the torch-free `configs.py` (imported
here too), the denoising math in `loop.py`, each sampler in its file.

    from dllmflow.diffusion.samplers import SAMPLERS
    from dllmflow.diffusion.samplers.base import build_sampler_config
    cfg = build_sampler_config("llada", {"threshold": 0.9})           # an LLaDAConfig
    out = SAMPLERS["llada"](model, tokenizer, cfg).generate([prompt_ids])   # GenerationResult

    stepper = sampler.stepper([ids_a, ids_b])     # the same decoding, one block per step()
    while (progress := stepper.step()) is not None:  # BlockProgress: each row's committed tokens
        stepper.keep([1])                            # drop row 0 before the next block
    stepper.result                                   # GenerationResult of the rows kept
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import torch
from torch import Tensor

from dllmflow.errors import UserError
from dllmflow.models.mask_id import resolve_mask_id

from .configs import SamplerConfig, SamplerSettingError, build_sampler_config  # noqa: F401  (their home)
from .loop import (
    SETTLED_LISTENER,
    BlockLoop,
    SettledListener,
    block_geometry,
    drain,
    iter_block_loop,
    window_ids,
)


def sampler_supports(name: str, feature: Literal["infill", "batching"]) -> bool:
    """The sampler class's `supports_<feature>` flag (the sampler modules import only torch)."""
    from dllmflow.diffusion.modes import check_sampler
    from dllmflow.diffusion.samplers import SAMPLERS

    check_sampler(None, name)
    return bool(getattr(SAMPLERS[name], f"supports_{feature}"))


def stop_token_ids(tokenizer: Any) -> set[int]:
    """Ids that end a response: eos, eot, pad and the usual end-of-turn specials present in the vocab."""
    ids = {getattr(tokenizer, a, None) for a in ("eos_token_id", "eot_token_id", "pad_token_id")}
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    ids |= {vocab.get(t) for t in ("<|eot_id|>", "<|end_of_text|>", "<|im_end|>", "<|endoftext|>")}
    ids.discard(None)
    mask = getattr(tokenizer, "mask_token_id", None)
    ids.discard(mask)
    return {int(i) for i in ids}


def trim_at_stop(ids: list[int], stop_ids: set[int]) -> list[int]:
    """Cut a response at its first stop id (the stop id itself is dropped)."""
    for i, t in enumerate(ids):
        if t in stop_ids:
            return ids[:i]
    return ids


def native_generate(model: Any, *names: str) -> Callable | None:
    """The checkpoint's own remote-code `generate` when its class defines one taking every keyword in
    `names` (transformers' generic `GenerationMixin.generate` never counts), else None."""
    import inspect

    from transformers import GenerationMixin

    method = getattr(type(model), "generate", None)
    if method is None or method is GenerationMixin.generate:
        return None
    try:
        params = inspect.signature(method).parameters
    except (TypeError, ValueError):
        return None
    return model.generate if all(n in params for n in names) else None


# ---- the sampler interface ----------------------------------------------------------------------


@dataclass
class GenerationResult:
    """sequences: generated ids only, cut at the first stop id (for infill: the whole filled sequence).
    nfe: model forward calls; row_nfe: forwards each row took part in (speed per sequence);
    row_positions: the positions those forwards computed for each row (its prompt, window or cached
    query span; padding excluded), empty when the sampler does not count them. answer tokens ÷ positions
    is the effective-token ratio (`effective_token_ratio`)."""

    sequences: list[list[int]]
    nfe: int
    num_generated_tokens: int
    elapsed_s: float
    row_nfe: list[int] = field(default_factory=list)
    row_positions: list[int] = field(default_factory=list)
    # Drafting samplers (selfspec): per draft offset k (index k-1), how many (row, forward) checks fed a
    # k-th draft and how many accepted it: acceptance per offset = accepted / fed (AutoModel's draft_acc_k).
    draft_fed: list[int] = field(default_factory=list)
    draft_accepted: list[int] = field(default_factory=list)


def effective_token_ratio(tokens: int, positions: int) -> float | None:
    """Answer tokens per position computed (1.0: every position computed is an answer token, as a
    KV-cached AR decoder's); None when the positions were not counted."""
    return tokens / positions if positions > 0 else None


def _decoded(out: tuple) -> tuple[list[list[int]], int, list[int], list[int]]:
    """A `_generate` tuple with its row positions ([] where the sampler returns three fields)."""
    return (*out, []) if len(out) == 3 else out


class Sampler(ABC):
    """One generation algorithm. Subclasses set `config_cls` and the `supports_*` flags (read before a
    model loads) and implement `_generate`."""

    name: ClassVar[str] = "base"
    config_cls: ClassVar[type[SamplerConfig]] = SamplerConfig
    supports_infill: ClassVar[bool] = False
    supports_batching: ClassVar[bool] = True
    # Why a sampler without a `cache` option has no KV-cache path (said when a cache is asked for); the
    # cache modes a sampler takes are its config's `cache_modes`.
    no_cache_reason: ClassVar[str] = "it has no KV-cache path"
    # Whether it fills [MASK] positions (every diffusion sampler); a causal decoder resolves no mask id.
    uses_mask: ClassVar[bool] = True
    # The grad mode `generate` runs in. GRPO's rollouts under FSDP2 set `torch.no_grad`: FSDP2 reuses
    # its all-gather buffers, and ones made in inference mode cannot be written in the training step.
    grad_mode: Callable[[], Any] = torch.inference_mode

    def __init__(
        self,
        model,
        tokenizer,
        config: SamplerConfig,
        mask_id: int | None = None,
        forward=None,
        *,
        training_settings: Any = None,
    ):
        if not isinstance(config, self.config_cls):
            raise UserError(
                f"sampler {self.name} takes a {self.config_cls.__name__}, got {type(config).__name__}; "
                f"build it with build_sampler_config({self.name!r}, ...)"
            )
        if getattr(config, "eos_token_id", None) == "tokenizer":  # the preset's "use the tokenizer's EOS"
            config = config.model_copy(update={"eos_token_id": getattr(tokenizer, "eos_token_id", None)})
        self.model, self.tokenizer, self.config = model, tokenizer, config
        # The checkpoint's training Settings (its settings.json, what `load_for_generation` returns) or
        # None: the values a sampler must match (scdd's schedule) are read from them.
        self.training_settings = training_settings
        self.mask_id = resolve_mask_id(mask_id, tokenizer, model) if self.uses_mask else None
        fill = getattr(tokenizer, "eos_token_id", None)
        self.fill_id = int(fill if fill is not None else getattr(tokenizer, "pad_token_id", 0) or 0)
        self.stop_ids = stop_token_ids(tokenizer)
        self._forward = forward or self.model_forward

    @property
    def device(self) -> torch.device:
        try:
            return next(self.model.parameters()).device
        except (StopIteration, AttributeError):
            return torch.device("cpu")

    def model_forward(self, input_ids: Tensor, attention_mask: Tensor, logits_to_keep: int = 0) -> Tensor:
        """Logits [B, T, V] of the canvas ([B, n, V] of its last n positions with `logits_to_keep` = n).
        Default: a causal HF forward; masked-diffusion samplers override this with the bidirectional one."""
        from dllmflow.models.attention import model_logits

        return model_logits(self.model, logits_to_keep, input_ids=input_ids, attention_mask=attention_mask)

    def generator(self) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(self.config.seed)

    def generate(self, prompt_ids: list[list[int]]) -> GenerationResult:
        if not prompt_ids:
            return GenerationResult([], 0, 0, 0.0)
        t0 = time.perf_counter()
        with self.grad_mode():
            if self.supports_batching:
                seqs, nfe, row_nfe, positions = _decoded(self._generate(prompt_ids))
            else:  # one prompt at a time
                seqs, nfe, row_nfe, positions = [], 0, [], []
                for p in prompt_ids:
                    s, n, r, q = _decoded(self._generate([p]))
                    seqs, nfe, row_nfe, positions = seqs + s, nfe + n, row_nfe + r, positions + q
        trimmed = [trim_at_stop(s, self.stop_ids) for s in seqs]
        elapsed = time.perf_counter() - t0
        positions = positions if len(positions) == len(trimmed) else []
        fed, accepted = getattr(self, "draft_counts", ([], []))
        return GenerationResult(
            trimmed, nfe, sum(map(len, trimmed)), elapsed, row_nfe, positions, list(fed), list(accepted)
        )

    @abstractmethod
    def _generate(self, prompt_ids: list[list[int]]) -> tuple:
        """-> (generated ids per row, untrimmed; forward calls; forwards per row[; positions computed
        per row]): the fourth field is optional (no effective-token ratio without it)."""

    def _iter_generate(self, prompt_ids: list[list[int]]) -> Generator[Any, list[int] | None, tuple]:
        """`_generate` block by block (a `loop.BlockLoop`: yields a `loop.BlockProgress` between blocks,
        may be sent the rows to keep, returns `_generate`'s tuple for the rows kept). Samplers whose loop
        steps override it; this default decodes the whole batch in one piece."""
        return self._generate(prompt_ids)
        yield  # makes this a generator

    def stepper(self, prompt_ids: list[list[int]]) -> BlockStepper:
        """Decode `prompt_ids` one block per `step()` (same tokens as `generate`)."""
        if not self.supports_batching and len(prompt_ids) > 1:
            raise UserError(f"sampler {self.name} decodes one prompt at a time; step one prompt per stepper")
        return BlockStepper(self, prompt_ids)

    def infill(self, seqs: list[list[int]]) -> GenerationResult:
        raise UserError(f"sampler {self.name} does not support infill; use --sampler llada")


class BlockSampler(Sampler):
    """A sampler decoded by `loop.iter_block_loop` (llada, idlm): what tells them apart is the canvas
    and the logits source they decode it with (`logits_source`: uncached, an exact or a Fast-dLLM cache)."""

    @abstractmethod
    def logits_source(self, prompt_ids: list[list[int]], gen_length: int) -> tuple[Any, Any]:
        """(canvas, source) for `gen_length` new tokens of each prompt."""

    def _generate(self, prompt_ids: list[list[int]]) -> tuple[list[list[int]], int, list[int], list[int]]:
        return drain(self._iter_generate(prompt_ids))

    def _iter_generate(self, prompt_ids: list[list[int]]) -> BlockLoop:
        cfg = self.config
        geometry = block_geometry(cfg.max_new_tokens, cfg.block_size, cfg.steps, whole_blocks=False)
        canvas, source = self.logits_source(prompt_ids, geometry.gen_length)
        nfe, row_nfe, positions = yield from iter_block_loop(
            source, canvas, cfg, geometry, self.mask_id, self.fill_id, self.generator()
        )
        seqs = window_ids(canvas.x, canvas.gen_start, geometry.gen_length)  # the kept rows'
        return seqs, nfe, row_nfe.tolist(), positions.tolist()


class BlockStepper:
    """A batch decoded one block per `step()`, so a caller (the server's scheduler) can give several
    batches turns block by block and drop rows between blocks (`keep`). The tokens are `generate`'s: the
    same loop runs, paused between blocks."""

    def __init__(self, sampler: Sampler, prompt_ids: list[list[int]]):
        self.sampler, self.rows = sampler, len(prompt_ids)
        self.loop = sampler._iter_generate(prompt_ids)
        self.result: GenerationResult | None = None
        self.elapsed_s = 0.0
        self._keep: list[int] | None = None
        self._started = False

    def keep(self, rows: list[int]) -> None:
        """Keep only the rows `rows` (indices into the rows live now, at least one) from the next block on
        (rows can leave only between blocks: after the first `step`)."""
        if not self._started or not rows:
            raise ValueError("keep() takes at least one row, after the first step()")
        self._keep = [self._keep[r] for r in rows] if self._keep is not None else list(rows)
        self.rows = len(rows)

    def step(self, on_settled: SettledListener | None = None) -> Any:
        """Decode the next block: a `loop.BlockProgress` of the live rows, or None once the batch is
        decoded (then `result` holds the GenerationResult of the rows kept, trimmed at stop ids).
        `on_settled(rows, ids)` is called, from inside the block, for rows whose block became final
        while others still decode it (`loop.SettledRows`; untrimmed ids through that block)."""
        t0 = time.perf_counter()
        keep, self._keep, self._started = self._keep, None, True
        listening = SETTLED_LISTENER.set(on_settled)
        try:
            with torch.inference_mode():
                return self.loop.send(keep)
        except StopIteration as stop:
            seqs, nfe, row_nfe, positions = _decoded(stop.value)
            trimmed = [trim_at_stop(s, self.sampler.stop_ids) for s in seqs]
            self.result = GenerationResult(
                trimmed, nfe, sum(map(len, trimmed)), self.elapsed_s, row_nfe, positions
            )
            return None
        finally:
            SETTLED_LISTENER.reset(listening)
            self.elapsed_s += time.perf_counter() - t0
            if self.result is not None:
                self.result.elapsed_s = self.elapsed_s
