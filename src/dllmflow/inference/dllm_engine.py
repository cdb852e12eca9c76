"""The dLLM side of `dllmflow serve`: a diffusion LM decoding batches block by block with the recorded
sampler, driven by the same round-robin `scheduler.Scheduler` as the causal engine.

    served = served_from_path("runs/tiny_addition")        # the sampler + settings recorded with it
    engine = DllmEngine(served)                             # model, tokenizer, sampler preset
    scheduler = Scheduler(engine, max_batch_size=16)        # inference/scheduler.py
    scheduler.submit(engine.request(prompt_ids, {"threshold": 0.9}, max_tokens=16, stream=True))

What is served: `ServedModel` (a local checkpoint dir, its sampler and recorded settings, lineage for
`/v1/models`). `resolve_served` finds the HF dir a `--model-path` stands for, once per start, and whether
it is a dLLM, and reads its records once (`inference/resolved.py`, kept as `ServedModel.resolved` for
the engine's load); `served_from_path` reads what to serve from a run or export dir: the sampler the run was
evaluated and gated with (`eval/<sampler>.json`, the sweep's chosen setting included), else the
export's own (`config.json` `dllm` block). A registered model (`models:/<name>@<alias>`) is resolved
in `inference/registered.py` to the same `ServedModel`.

Batching: requests whose sampler and settings are the same decode together (`request().batch_key()`);
the samplers decode a row in a batch as alone (tests/unit/test_sampler_caches.py), so a client's answer
does not depend on who else was served with it. A sampled request (temperature > 0 or random
remasking) draws from a generator shared by its batch, so it decodes alone. A turn decodes ONE block of
a batch (`Sampler.stepper`): a long request delays a short one by a block per turn, and a new request
waits at most one block before its first block decodes (a token-by-token sampler, `ar` or `selfspec`,
pauses before each forward: its turn is one forward). Within a turn, a streamed row whose block is
final before the batch's (with a threshold rows need different numbers of forwards for a block) is
sent at once (`publish`, `loop.SettledRows`), not after the batch's slowest row. Rows leave a batch
between blocks: once their answer is final (a stop token in a committed block, which never changes
again) or when cancelled (client gone, timeout), so they cost nothing from the next block on.

`max_tokens` is the sampler's `max_new_tokens`; when a request changes it without giving `steps`, the
steps of samplers whose `steps` is a total (llada, idlm, ...) scale with it, keeping the recorded
steps per token (llada2's steps are per block already).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dllmflow.errors import UserError
from dllmflow.inference.engine import ChatRequest
from dllmflow.inference.requests import RequestError
from dllmflow.inference.resolved import ResolvedCheckpoint, of_export, resolve
from dllmflow.inference.scheduler import DecodeAborted
from dllmflow.runs import HF_CONFIG, find_export

EVAL_DIR = "eval"  # runs.RunLayout.eval_dir: eval/<sampler>.json, what the register step gates with


@dataclass(frozen=True)
class ServedModel:
    """A dLLM to serve: its local HF dir, the sampler and settings recorded at training/gating time,
    and its lineage (registered name, version, alias, run id, sweep setting, source) for `/v1/models`."""

    checkpoint: Path
    sampler: str | None = None  # None: the export's default (`generate.resolve_default_sampler`)
    sampler_settings: dict[str, Any] = field(default_factory=dict)
    mode: str | None = None
    lineage: dict[str, Any] = field(default_factory=dict)
    trust_remote_code: bool = False
    # `checkpoint` as resolved with its records (None: read from `checkpoint` at the load)
    resolved: ResolvedCheckpoint | None = field(default=None, compare=False, repr=False)


def resolve_served(path: str | os.PathLike) -> tuple[Path | None, ServedModel | None]:
    """The one resolution of what `dllmflow serve --model-path` serves: (the HF dir `path` stands for,
    `runs.find_export`, None when it holds none; the dLLM to serve when that dir is a dllmflow export, a
    `dllm` block in config.json or training settings.json next to it, else None: a causal LM)."""
    ckpt = find_export(path) if Path(path).is_dir() else None
    if ckpt is None:
        return None, None
    try:
        config = json.loads((ckpt / HF_CONFIG).read_text())
    except (OSError, ValueError):
        return ckpt, None
    is_dllm = "dllm" in config or (ckpt / "settings.json").is_file()
    return ckpt, served_from_path(path, ckpt) if is_dllm else None


def served_from_path(path: str | os.PathLike, ckpt: Path | ResolvedCheckpoint | None = None) -> ServedModel:
    """A run/export dir -> what to serve: the sampler and settings it was gated with when a run dir
    holds `eval/<sampler>.json` (the sweep's chosen point), else the export's `dllm` block. `ckpt`: the
    HF dir `path` resolves to, when the caller resolved it already."""
    resolved = of_export(ckpt, given=path) if ckpt is not None else resolve(path)
    ckpt, block = resolved.path, resolved.dllm
    sampler = resolved.default_sampler
    mode = block.get("mode") or resolved.mode
    sampler_settings = dict(block.get("sampler_settings") or {})
    lineage: dict[str, Any] = {"source": str(Path(path).resolve())}
    evaluation = _gating_eval(Path(path), ckpt, sampler)
    if evaluation is not None:
        protocol = evaluation.get("protocol", {})
        sampler_settings = dict(protocol.get("sampler_settings") or sampler_settings)
        sweep = evaluation.get("sweep")
        if sweep:
            lineage["setting"] = sweep["points"][sweep["chosen"]]["setting"]
    return ServedModel(ckpt, sampler, sampler_settings, mode, lineage, resolved=resolved)


def with_server_settings(recorded: dict[str, Any], settings: dict[str, Any]) -> dict[str, Any]:
    """The recorded sampler settings with a server's `--sampler-setting`s applied: a value replaces the
    recorded one, None drops it (back to the sampler's preset)."""
    out = {k: v for k, v in recorded.items() if k not in settings}
    out.update({k: v for k, v in settings.items() if v is not None})
    return out


def _gating_eval(root: Path, ckpt: Path, sampler: str) -> dict[str, Any] | None:
    """The evaluation a run was gated with: `eval/<sampler>.json` in the nearest dir from the export
    up to `root` (a run dir, or the recipe dir above its flow runs)."""
    root, ckpt = root.absolute(), ckpt.absolute()  # not resolved: a linked export sits in its run
    for parent in [ckpt, *ckpt.parents]:
        found = parent / EVAL_DIR / f"{sampler}.json"
        if found.is_file():
            return json.loads(found.read_text())
        if parent == root:
            return None
    return None


@dataclass(eq=False)
class DllmRequest(ChatRequest):
    """A dLLM request: its sampler and full config (the batch key); `tokens` = its final tokens so far."""

    sampler: str = "llada"
    config: Any = None  # the sampler's SamplerConfig
    nfe: int = 0  # forwards its row took part in
    positions: int = 0  # the positions those forwards computed for its row (0: not counted)
    alone: bool = False  # decoded in a batch of its own (module docstring)

    def batch_key(self) -> tuple:
        if self.alone:
            return ("alone", id(self))
        return (self.sampler, self.config.model_dump_json(exclude={"seed"}))  # greedy: the seed draws nothing


@dataclass(eq=False)
class DllmDecode:
    """A batch decoding block by block: its live requests and the sampler's stepper over their rows."""

    reqs: list[DllmRequest]
    stepper: Any  # diffusion.samplers.base.BlockStepper


class DllmEngine:
    """A dLLM + tokenizer + recorded sampler settings, decoding batches one block per `step`; the
    interface `scheduler.Scheduler` drives (prefill / step / keep / result)."""

    def __init__(
        self, served: ServedModel, dtype: str = "float32", settings: dict[str, Any] | None = None,
        max_tokens_cap: int | None = None,
    ):  # fmt: skip
        """`settings`: what the server decodes with instead of the recorded settings (`--sampler-setting`),
        validated for the served sampler like a request's overrides, under the server's `max_tokens_cap`
        (a UserError naming the key); requests override either."""
        import inspect

        import torch

        from dllmflow.diffusion.modes import SamplerMisfitError, check_sampler
        from dllmflow.diffusion.samplers import SAMPLER_CONFIGS, SAMPLERS
        from dllmflow.diffusion.samplers.asked import AskLimits, build_asked_config
        from dllmflow.diffusion.samplers.base import stop_token_ids
        from dllmflow.diffusion.samplers.configs import SamplerSettingError, build_sampler_config
        from dllmflow.inference.generate import load_export
        from dllmflow.models.limits import max_positions

        self.served = served
        checkpoint = served.resolved or of_export(served.checkpoint)  # a registered model's: read here
        self.sampler = served.sampler or checkpoint.default_sampler
        try:
            check_sampler(served.mode, self.sampler)
        except SamplerMisfitError as e:
            raise UserError(str(e)) from None
        # The server's own settings replace the recorded ones (None: back to the sampler's preset), checked
        # before any weight is read.
        self.settings = dict(settings or {})
        recorded = with_server_settings(served.sampler_settings, self.settings)
        try:
            unset = [
                k
                for k, v in self.settings.items()
                if v is None and k not in SAMPLER_CONFIGS[self.sampler].model_fields
            ]
            if unset:
                raise SamplerSettingError(f"sampler {self.sampler} does not take {unset[0]}", unset[0])
            build_asked_config(
                self.sampler, self.settings, None, defaults=recorded, limits=AskLimits(max_tokens_cap)
            )
        except SamplerSettingError as e:
            named = e.field is None or str(e).startswith(f"{e.field}:")  # asked.py's messages lead with it
            raise UserError(
                f"--sampler-setting {e}" if named else f"--sampler-setting {e.field}: {e}"
            ) from None
        served = self.served = dataclasses.replace(served, sampler_settings=recorded)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        self.model, self.tokenizer, self.trained = load_export(
            checkpoint, device=device, dtype=getattr(torch, dtype),
            trust_remote_code=served.trust_remote_code,
        )  # fmt: skip
        if not getattr(self.tokenizer, "chat_template", None):
            raise UserError(f"{served.checkpoint}: the tokenizer has no chat_template; save one with it")
        self.recorded = dict(served.sampler_settings)
        self.preset = build_sampler_config(self.sampler, None, self.tokenizer, defaults=self.recorded)
        self.sampler_cls = SAMPLERS[self.sampler]
        self.stop_ids = stop_token_ids(self.tokenizer)
        self.max_length = int(max_positions(self.model) or 1 << 30)
        # Checked before every forward (`_abort_check`): the rows of the block decoding now, and whether the
        # server is stopping (set at its shutdown).
        self.rows: list[DllmRequest] = []
        self.stopping = False
        self.model.register_forward_pre_hook(self._abort_check)
        self.reserved_template_args = set(inspect.signature(self.tokenizer.apply_chat_template).parameters)
        # Set by the server (`Scheduler.publish`): queues an event for a request from the worker thread
        # mid-turn. None (in-process use): blocks are reported at the turn's end only.
        self.publish: Callable[[DllmRequest, tuple], None] | None = None

    # ---- requests --------------------------------------------------------------------------------

    def encode(self, messages: list[dict[str, Any]], template_kwargs: dict[str, Any]) -> list[int]:
        out = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False, **template_kwargs
        )
        return list(out)

    def request(
        self, prompt_ids: list[int], overrides: dict[str, Any], max_tokens: int | None, *, stream: bool,
        steps_cap: int,
    ) -> DllmRequest:  # fmt: skip
        """A request's sampler and config from the recorded settings and its overrides (`sampler`,
        `steps`, `threshold`, `cache`, ...): the rules of `build_sampler_config` (the pyfunc's), refused
        as RequestError naming `dllmflow.<field>`."""
        from dllmflow.diffusion.modes import SamplerMisfitError
        from dllmflow.diffusion.samplers import SAMPLER_CONFIGS, SAMPLERS
        from dllmflow.diffusion.samplers.asked import AskLimits, build_asked_config
        from dllmflow.diffusion.samplers.configs import SamplerSettingError

        overrides = dict(overrides)
        sampler = overrides.pop("sampler", None) or self.sampler
        try:
            if not isinstance(sampler, str):
                raise SamplerMisfitError(f"'sampler' must be a sampler name, got {sampler!r}")
            preset = self._preset(sampler)
        except (SamplerMisfitError, UserError) as e:
            raise RequestError(str(e), "dllmflow.sampler") from None
        if max_tokens is not None:
            overrides["max_new_tokens"] = max_tokens
            if "steps" not in overrides and not SAMPLER_CONFIGS[sampler].steps_per_block:
                scaled = math.ceil(preset.steps * max_tokens / preset.max_new_tokens)
                overrides["steps"] = min(max_tokens, max(1, scaled))
        try:  # strict, then capped: a forward per step, bounded like max_tokens
            limits = AskLimits(steps_cap)
            config = build_asked_config(
                sampler, overrides, self.tokenizer, defaults=self.recorded, limits=limits
            )
        except SamplerSettingError as e:
            param = e.field if e.field in ("temperature", "seed") else f"dllmflow.{e.field}"
            raise RequestError(str(e), param if e.field else "dllmflow") from None
        temperature = float(getattr(config, "temperature", 0.0))
        # A sampled request draws from a generator its batch shares (the draws depend on the batch); a
        # sampler without batching decodes one prompt at a time: either decodes alone.
        sampled = temperature > 0 or getattr(config, "remasking", None) == "random"
        return DllmRequest(prompt_ids, config.max_new_tokens, temperature, 1.0, stream=stream, seed=config.seed,
                           sampler=sampler, config=config,
                           alone=sampled or not SAMPLERS[sampler].supports_batching)  # fmt: skip

    @functools.cache  # noqa: B019 (one engine per server; a handful of samplers)
    def _preset(self, sampler: str) -> Any:
        """`sampler`'s config under the recorded settings; UserError if it does not decode this mode."""
        from dllmflow.diffusion.modes import check_sampler
        from dllmflow.diffusion.samplers.configs import build_sampler_config

        check_sampler(self.served.mode, sampler)
        return build_sampler_config(sampler, None, self.tokenizer, defaults=self.recorded)

    # ---- decoding (the Scheduler's interface) ---------------------------------------------------

    def prefill(self, reqs: list[DllmRequest]) -> DllmDecode:
        """Start a batch of requests sharing a batch key and decode its first block."""
        from dllmflow.diffusion.samplers import SAMPLERS

        first = reqs[0]
        runner = SAMPLERS[first.sampler](
            self.model, self.tokenizer, first.config, mask_id=self.model.config.mask_token_id,
            training_settings=self.trained,
        )  # fmt: skip
        decode = DllmDecode(list(reqs), runner.stepper([r.prompt_ids for r in reqs]))
        return self.step(decode, 1)

    def _abort_check(self, module: Any, args: Any) -> None:
        """Before each forward: a block whose rows are all gone, or on a stopping server, ends now rather
        than after its last step, so a request never holds the model past its timeout and SIGTERM stops
        the server mid-block (the Scheduler drops the batch)."""
        if self.stopping:
            raise DecodeAborted("the server is stopping: the batch decoding now is dropped")
        if self.rows and all(r.cancelled for r in self.rows):
            raise DecodeAborted(f"a batch of {len(self.rows)} stopped mid-block: its requests are gone")

    def step(self, decode: DllmDecode, num_blocks: int = 1) -> DllmDecode:
        """Decode the batch's next block; rows whose answer became final finish and leave it."""
        from dllmflow.diffusion.samplers.base import trim_at_stop

        self.rows = decode.reqs
        try:
            progress = decode.stepper.step(on_settled=self._settled_listener(decode))
        finally:
            self.rows = []
        if progress is None:  # the last block: the sampler's own trimmed result
            result = decode.stepper.result
            positions = result.row_positions or [0] * len(decode.reqs)
            for req, seq, nfe, pos in zip(decode.reqs, result.sequences, result.row_nfe, positions):
                req.tokens, req.nfe, req.positions = list(seq), int(nfe), int(pos)
                req.finish_reason = "length" if len(seq) >= req.config.max_new_tokens else "stop"
            decode.reqs = []
            return decode
        positions = progress.row_positions or [0] * len(decode.reqs)
        for req, toks, done, nfe, pos in zip(
            decode.reqs, progress.tokens, progress.done, progress.row_nfe, positions
        ):
            req.tokens, req.nfe, req.positions = trim_at_stop(toks, self.stop_ids), int(nfe), int(pos)
            if done or len(req.tokens) < len(toks):  # a stop in a committed block: the answer is final
                req.finish_reason = "stop"
        self.keep(decode, [i for i, r in enumerate(decode.reqs) if r.finish_reason is None])
        return decode

    def _settled_listener(self, decode: DllmDecode) -> Callable[[list[int], list[list[int]]], None] | None:
        """What streams a row's block as soon as it is final, from inside the turn (its text is final)."""
        from dllmflow.diffusion.samplers.base import trim_at_stop

        if self.publish is None or not any(r.stream for r in decode.reqs):
            return None
        reqs = list(decode.reqs)  # the stepper's rows, in order (rows leave only between blocks)

        def settled(rows: list[int], ids: list[list[int]]) -> None:
            for row, toks in zip(rows, ids):
                if reqs[row].stream and not reqs[row].cancelled:
                    self.publish(reqs[row], ("tokens", trim_at_stop(toks, self.stop_ids)))

        return settled

    def keep(self, decode: DllmDecode, rows: list[int]) -> None:
        """Drop every other row (between blocks): it costs nothing from the next block on."""
        if len(rows) == len(decode.reqs):
            return
        decode.reqs = [decode.reqs[i] for i in rows]
        if rows:
            decode.stepper.keep(rows)

    def text(self, req: DllmRequest) -> str:
        return self.partial_text(req.tokens)

    def partial_text(self, tokens: list[int]) -> str:
        """The answer of these (final) tokens, as `dllmflow generate` and the pyfunc print it."""
        from dllmflow.inference.generate import decode_response

        return decode_response(self.tokenizer, tokens)

    def result(self, req: DllmRequest) -> dict[str, Any]:
        completion = len(req.tokens)
        return {
            "text": self.text(req),
            "finish_reason": req.finish_reason,
            "prompt_tokens": len(req.prompt_ids),
            "completion_tokens": completion,
            "dllmflow": {
                "sampler": req.sampler,
                "nfe": req.nfe,
                "tokens_per_forward": round(completion / req.nfe, 4) if req.nfe else 0.0,
                "positions": req.positions,
                "effective_token_ratio": round(completion / req.positions, 4) if req.positions else None,
                **self._decoding(req.sampler),
            },
        }

    def _decoding(self, sampler: str) -> dict[str, str]:
        """{"decoding": "lossy"|"lossless"} for a model whose answers must be a causal LM's (uno)."""
        from dllmflow.diffusion.modes import decoding_of

        label = decoding_of(self.served.mode, sampler)
        return {"decoding": label} if label else {}
