"""lm-evaluation-harness adapter: the `dllmflow` LM (a checkpoint + one diffusion sampler) and the
local `dllmflow_gsm8k` task (the prepared data's held-out split, scored like `dllmflow evaluate`).

    dllmflow evaluate --checkpoint runs/tiny_mdlm/checkpoints --harness gsm8k --limit 8 --output h.json

    import lm_eval, dllmflow.evaluation.harness as h         # importing registers model "dllmflow"
    lm = h.DLLMFlowLM("runs/tiny_mdlm/checkpoints", sampler="llada", n_mc=32, threshold=0.9)
    lm_eval.simple_evaluate(model=lm, tasks=["arc_easy"])   # any lm-eval task: generation or likelihood

`generate_until` runs the sampler (prompts shortest first, `eval.batch_size` a batch, as `evaluate`),
cuts the text at the first `until` string and takes `max_gen_toks` as max_new_tokens. `loglikelihood`
is LLaDA's Monte-Carlo ELBO (docs/lm_eval.md): n_mc draws of l ~ U{1..L} masked continuation tokens,
sum of their CE weighted by L/l, averaged. See docs/lm_eval.md for the estimator and its cost.
"""

from __future__ import annotations

import json
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from torch import Tensor

from dllmflow.data.task import gold_answer, gsm8k_extract_flexible, gsm8k_extract_strict, task_chats
from dllmflow.errors import UserError
from dllmflow.inference.resolved import ResolvedCheckpoint

from .protocol import build_eval_runner, checkpoint_record, resolve_prepared_dir, template_hash

TASKS_DIR = Path(__file__).parent / "tasks"
INVALID = "[invalid]"  # a filtered answer no gold equals (lm-eval's convention for "nothing extracted")


# ---- the Monte-Carlo ELBO -----------------------------------------------------------------------


def draw_continuation_masks(length: int, n_mc: int, generator: torch.Generator) -> Tensor:
    """n_mc masks over a continuation of `length` tokens: draw l ~ U{1..length}, then mask l
    positions chosen uniformly. -> [n_mc, length] bool, row s has l_s True."""
    num_masked = torch.randint(1, length + 1, (n_mc,), generator=generator)  # [n_mc]
    rank = torch.rand(n_mc, length, generator=generator).argsort(dim=1).argsort(dim=1)  # [n_mc, L]
    return rank < num_masked[:, None]


def elbo_loglikelihood(
    forward, context: list[int], continuation: list[int], mask_id: int, masks: Tensor, batch_size: int = 32
) -> float:
    """LLaDA's lower bound on log p(continuation | context):
    -(1/n) Σ_s (L / l_s) Σ_{i masked in s} CE(logits_i, x_i), one forward of [context + masked
    continuation] per draw. forward(ids [B, T], attention_mask [B, T]) -> logits [B, T, V] with the
    logit at i predicting token i (masked diffusion: no shift)."""
    length, start = len(continuation), len(context)
    device = masks.device
    ids = torch.tensor(context + continuation, device=device)  # [T]
    target = ids[start:]  # [L]
    total = 0.0
    for chunk in masks.split(batch_size):
        x = ids.repeat(len(chunk), 1)  # [b, T]
        x[:, start:] = torch.where(chunk, mask_id, target)
        logits = forward(x, torch.ones_like(x))[:, start:].float()  # [b, L, V]
        logp = logits.log_softmax(-1).gather(-1, target.expand(len(chunk), -1)[..., None])[..., 0]  # [b, L]
        total += ((logp * chunk).sum(1) * length / chunk.sum(1)).sum().item()
    return total / len(masks)


def greedy_matches(forward, context: list[int], continuation: list[int], mask_id: int, device) -> bool:
    """One forward with the whole continuation masked: does its argmax at every position give the
    continuation? (LLaDA decodes step by step; this one-step check is cheaper and stricter.)"""
    x = torch.tensor([context + [mask_id] * len(continuation)], device=device)  # [1, T]
    logits = forward(x, torch.ones_like(x))[0, len(context) :]  # [L, V]
    return logits.argmax(-1).tolist() == list(continuation)


def truncate_at_stops(text: str, until: list[str]) -> str:
    """The text before the first occurrence of any stop string."""
    cut = min((i for i in (text.find(s) for s in until if s) if i >= 0), default=len(text))
    return text[:cut]


# ---- the lm-eval model --------------------------------------------------------------------------


@register_model("dllmflow")
class DLLMFlowLM(LM):
    """A dllmflow checkpoint under lm-eval. checkpoint: as `dllmflow evaluate --checkpoint`; sampler:
    a SAMPLERS name; settings: Settings or a recipe YAML path (None = the checkpoint's settings.json;
    its eval section gives sampler defaults and the batch size); sampler_options: overrides (steps=64,
    threshold=0.9, mask_id=..); n_mc draws per loglikelihood, mc_batch_size draws per forward, seed of
    the mask draws. From the lm-eval CLI: `--model dllmflow --model_args checkpoint=CKPT,steps=64`."""

    def __init__(
        self,
        checkpoint: str | ResolvedCheckpoint,
        sampler: str = "llada",
        settings: Any = None,
        n_mc: int = 32,
        mc_batch_size: int = 32,
        seed: int = 0,
        batch_size: int | str | None = None,
        max_batch_size: int | None = None,  # lm-eval passes it; a fixed batch size is used
        device: str | None = None,
        **sampler_options: Any,
    ):
        super().__init__()
        if isinstance(settings, str | Path):
            from dllmflow.settings import load_settings

            settings = load_settings(settings)
        if int(n_mc) < 1 or int(mc_batch_size) < 1:
            raise UserError(f"n_mc and mc_batch_size must be >= 1, got {n_mc} and {mc_batch_size}")
        if str(device).startswith("cuda") and not torch.cuda.is_available():
            device = None  # the lm-eval CLI asks for cuda by default; None = cuda if available, else cpu
        self.checkpoint = str(checkpoint)
        self.loaded = build_eval_runner(checkpoint, settings, sampler, sampler_options, device=device)
        self.model, self.tokenizer, self.runner = self.loaded.model, self.loaded.tokenizer, self.loaded.runner
        self.settings = self.loaded.settings
        self.mask_id = self.runner.mask_id
        self.n_mc, self.mc_batch_size, self.seed = int(n_mc), int(mc_batch_size), int(seed)
        default_batch = getattr(self.loaded.eval_cfg, "batch_size", 8)
        self.batch_size = int(batch_size) if str(batch_size).isdigit() else default_batch  # "auto" -> default
        self._device = self.runner.device
        self._runners = {self.runner.config.max_new_tokens: self.runner}

    # -- text <-> ids

    def tok_encode(self, text: str) -> list[int]:
        """Plain encoding, no special tokens added (chat prompts already hold theirs)."""
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """lm-eval's convention: trailing spaces of the context go to the continuation, and the
        continuation is what encoding the whole adds to the context."""
        n_spaces = len(context) - len(context.rstrip())
        if n_spaces:
            context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
        whole, ctx = self.tok_encode(context + continuation), self.tok_encode(context)
        return ctx, whole[len(ctx) :]

    @property
    def max_length(self) -> int:
        from dllmflow.models.limits import max_positions

        return max_positions(self.model) or 4096

    def _forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        from dllmflow.models.attention import forward_bidirectional

        return forward_bidirectional(self.model, input_ids, attention_mask)  # [B, T, V]

    # -- generation

    def _runner_for(self, max_new_tokens: int):
        """The configured sampler with another max_new_tokens (lm-eval's max_gen_toks)."""
        if max_new_tokens not in self._runners:
            from dllmflow.diffusion.samplers import SAMPLERS

            config = self.runner.config.model_copy(update={"max_new_tokens": max_new_tokens})
            self._runners[max_new_tokens] = SAMPLERS[self.loaded.sampler](
                self.model,
                self.tokenizer,
                config,
                mask_id=self.mask_id,
                training_settings=self.loaded.trained,
            )
        return self._runners[max_new_tokens]

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        from dllmflow.inference.generate import decode_response
        from dllmflow.models.limits import check_generation_fits

        # 1) group by generation length; other gen_kwargs (do_sample, temperature) are the sampler's
        default_len = self.runner.config.max_new_tokens
        groups: dict[int, list[int]] = defaultdict(list)
        for i, req in enumerate(requests):
            groups[int(req.args[1].get("max_gen_toks") or default_len)].append(i)
        prompts = [self.tok_encode(req.args[0]) for req in requests]
        out: list[str] = [""] * len(requests)
        for max_new_tokens, idx in groups.items():
            runner = self._runner_for(max_new_tokens)
            # 2) shortest prompts first, as `evaluate` batches them
            idx = sorted(idx, key=lambda i: len(prompts[i]))
            check_generation_fits(self.model, len(prompts[idx[-1]]), max_new_tokens, self.mask_id)
            for start in range(0, len(idx), self.batch_size):
                batch = idx[start : start + self.batch_size]
                result = runner.generate([prompts[i] for i in batch])
                for i, seq in zip(batch, result.sequences):
                    context, gen_kwargs = requests[i].args
                    until = gen_kwargs.get("until") or []
                    until = [until] if isinstance(until, str) else list(until)
                    out[i] = truncate_at_stops(decode_response(self.tokenizer, seq), until)
                    self.cache_hook.add_partial("generate_until", (context, gen_kwargs), out[i])
        return out

    # -- likelihoods

    def _score(self, context: list[int], continuation: list[int], with_greedy: bool) -> tuple[float, bool]:
        if not continuation:
            return 0.0, True
        keep = max(self.max_length - len(continuation), 0)  # drop the oldest context that does not fit
        context = context[len(context) - keep :] if keep else []
        # The same seed for every request: answer choices of equal length see the same masks
        # (common random numbers), so their difference has less variance than their values.
        generator = torch.Generator().manual_seed(self.seed)
        masks = draw_continuation_masks(len(continuation), self.n_mc, generator).to(self._device)
        with torch.inference_mode():
            ll = elbo_loglikelihood(
                self._forward, context, continuation, self.mask_id, masks, self.mc_batch_size
            )
            greedy = with_greedy and greedy_matches(
                self._forward, context, continuation, self.mask_id, self._device
            )
        return ll, greedy

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        out = []
        for req in requests:
            context, continuation = req.args
            ctx, cont = (
                self._encode_pair(context, continuation) if context else ([], self.tok_encode(continuation))
            )
            out.append(self._score(ctx, cont, with_greedy=True))
            self.cache_hook.add_partial("loglikelihood", req.args, out[-1])
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """ELBO of the whole text, in disjoint windows of max_length tokens each scored with no
        context (a lower bound of each window's log-likelihood)."""
        out = []
        for req in requests:
            ids = self.tok_encode(req.args[0])
            windows = [ids[i : i + self.max_length] for i in range(0, len(ids), self.max_length)]
            out.append(sum(self._score([], w, with_greedy=False)[0] for w in windows))
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, out[-1])
        return out

    # -- chat templates (lm-eval's --apply_chat_template)

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.tokenizer, "name_or_path", "dllmflow")).replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return getattr(self.tokenizer, "chat_template", None)

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt=True) -> str:
        return self.tokenizer.apply_chat_template(
            chat_history, tokenize=False, add_generation_prompt=add_generation_prompt
        )


# ---- the GSM8K task -----------------------------------------------------------------------------


def strict_answers(resps: list[list[str]], docs) -> list[list[str]]:
    """lm-eval filter (tasks/gsm8k.yaml): each response -> `gsm8k_extract_strict`, as `evaluate`."""
    return [[gsm8k_extract_strict(r) or INVALID for r in rs] for rs in resps]


def flexible_answers(resps: list[list[str]], docs) -> list[list[str]]:
    """lm-eval filter: each response -> `gsm8k_extract_flexible` (the last number), as `evaluate`."""
    return [[gsm8k_extract_flexible(r) or INVALID for r in rs] for rs in resps]


def write_gsm8k_task(out_dir: Path, lm: DLLMFlowLM, prepared_dir: Path, split: str) -> str:
    """The rows `evaluate` scores (split of the prepared data, prompts rendered with the checkpoint's
    chat template and eval.n_shot exemplars) as JSONL, and a task YAML that includes tasks/gsm8k.yaml
    and points at it. -> the task name."""
    from dllmflow.data.dataset import PreparedDataset

    rows = PreparedDataset(prepared_dir, split).rows()
    if not rows:
        raise UserError(f"{prepared_dir}: split {split!r} has no rows to evaluate")
    n_shot = getattr(lm.loaded.eval_cfg, "n_shot", 0)
    data = out_dir / "gsm8k.jsonl"
    with data.open("w", encoding="utf-8") as f:
        for r, chat in zip(rows, task_chats(prepared_dir, rows, n_shot)):
            prompt = lm.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
            doc = {"id": r["id"], "question": chat[-1]["content"], "prompt": prompt,
                   "reference": r["answer"], "answer": gold_answer(r["answer"]) or ""}  # fmt: skip
            f.write(json.dumps(doc, ensure_ascii=False) + "\n")
    task = {"include": str(TASKS_DIR / "gsm8k.yaml"), "task": "dllmflow_gsm8k",
            "dataset_kwargs": {"data_files": {"test": str(data)}}}  # fmt: skip
    (out_dir / "dllmflow_gsm8k.yaml").write_text(json.dumps(task, indent=2) + "\n")  # JSON is YAML
    return "dllmflow_gsm8k"


# Name for `--harness` -> writer of its task files (out_dir, lm, prepared_dir, split) -> task name.
HARNESS_TASKS = {"gsm8k": write_gsm8k_task}


def check_harness_task(name: str) -> None:
    if name not in HARNESS_TASKS:
        raise UserError(f"unknown --harness task {name!r}; available: {', '.join(HARNESS_TASKS)}")


def run_harness(
    checkpoint: str | Path | ResolvedCheckpoint,
    settings: Any = None,
    *,
    task: str = "gsm8k",
    split: str = "eval",
    prepared_dir: str | Path | None = None,
    limit: int | None = None,
    lm: DLLMFlowLM | None = None,
    sampler: str = "llada",
    overrides: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """`lm_eval.simple_evaluate` of `checkpoint` on the local `task` (a HARNESS_TASKS name); the same
    arguments and result shape as `evaluate` ({"metrics", "protocol", "predictions"}) plus the
    harness's own results under `lm_eval`. lm: an already loaded DLLMFlowLM (then checkpoint, settings,
    sampler and overrides are its own)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    # 1) the model (one load) and what to score
    check_harness_task(task)
    lm = lm or DLLMFlowLM(checkpoint, sampler=sampler, settings=settings, **(overrides or {}))
    checkpoint = lm.loaded.checkpoint or checkpoint  # resolved once, by the load
    prepared_dir = resolve_prepared_dir(str(checkpoint), lm.settings, prepared_dir)
    limit = limit if limit is not None else getattr(lm.loaded.eval_cfg, "limit", None)

    # 2) task files in a temporary dir, then the harness
    with tempfile.TemporaryDirectory(prefix="dllmflow-harness-") as tmp:
        name = HARNESS_TASKS[task](Path(tmp), lm, prepared_dir, split)
        manager = TaskManager(include_path=tmp, include_defaults=False)
        res = lm_eval.simple_evaluate(model=lm, tasks=[name], task_manager=manager, limit=limit,
                                      log_samples=True, bootstrap_iters=0)  # fmt: skip

    # 3) the same metrics / protocol / predictions as `evaluate`
    scores, samples = res["results"][name], res["samples"][name]
    by_doc: dict[int, dict] = {}
    for s in samples:  # one entry per (doc, filter)
        p = by_doc.setdefault(s["doc_id"], {"id": s["doc"]["id"], "prediction": s["resps"][0][0],
                                            "answer": s["doc"]["answer"] or None})  # fmt: skip
        kind = "strict" if s["filter"] == "strict-match" else "flexible"
        extracted = s["filtered_resps"][0]
        p[f"pred_{kind}"] = None if extracted == INVALID else extracted
        p[f"correct_{kind}"] = bool(s["exact_match"])
    predictions = [by_doc[k] for k in sorted(by_doc)]
    config = lm.runner.config
    metrics = {
        "exact_match_strict": float(scores["exact_match,strict-match"]),
        "exact_match_flexible": float(scores["exact_match,flexible-extract"]),
        "num_examples": len(predictions),
    }
    protocol = {
        "harness": f"lm-eval {lm_eval.__version__}", "task": name, "sampler": lm.loaded.sampler,
        "sampler_settings": config.model_dump(mode="json"), "max_new_tokens": config.max_new_tokens,
        "n_shot": getattr(lm.loaded.eval_cfg, "n_shot", 0), "chat_template_sha256": template_hash(lm.tokenizer),
        "limit": limit, "split": split, "seed": config.seed, "batch_size": lm.batch_size, "mask_id": lm.mask_id,
        **checkpoint_record(checkpoint), "prepared_dir": str(prepared_dir),
    }  # fmt: skip
    lm_eval_results = json.loads(json.dumps(res["results"], default=str))  # numpy floats -> float
    return {"metrics": metrics, "protocol": protocol, "predictions": predictions, "lm_eval": lm_eval_results}
