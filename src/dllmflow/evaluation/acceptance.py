"""DFlash acceptance: speculative decoding of a trained draft against its frozen target (greedy, lossless).

Each round the draft proposes bs-1 tokens after the last committed token (the anchor) from the
target's hidden states of every committed position before it; the target verifies the whole block in
one cached forward; the longest prefix of proposals equal to the target's own argmax is accepted, and
the target's next argmax is appended as the bonus token. The output is therefore exactly the target's
greedy decoding, in fewer target forwards. Reported: mean acceptance length tau (tokens committed per
target forward in the decode phase = accepted + 1), per-position acceptance (share of rounds whose
k-th proposal was accepted), target forwards vs plain greedy (the speed-up) and whether the text is
identical to plain greedy (`lossless`).

    from dllmflow.evaluation.acceptance import evaluate_dflash
    report = evaluate_dflash("runs/tiny_dflash/checkpoints", limit=8)   # uses the checkpoint's settings.json
    report["metrics"]["tau"], report["metrics"]["speedup_target_forwards"]

The target is read from the draft config's `target_model_id` (a hub id, a local dir, or `tiny:<dir>`
written by training), or passed explicitly.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from dllmflow.diffusion.masks.dflash import dflash_dense_mask
from dllmflow.errors import UserError
from dllmflow.inference.resolved import ResolvedCheckpoint, resolve
from dllmflow.models.mask_id import find_mask_id


@dataclass
class DecodeResult:
    tokens: list[int]  # generated ids (prompt excluded), truncated at EOS (kept) or max_new_tokens
    target_forwards: int  # including the prefill
    accepted: list[int] = field(default_factory=list)  # per round: proposals accepted (0..bs-1)
    elapsed_s: float = 0.0


def _features(hidden_states, layer_ids: list[int]) -> Tensor:
    return torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1)  # [1, T, |ids|·d]


def _new_cache(target: nn.Module):
    from transformers import DynamicCache

    return DynamicCache(config=target.config)


def _crop(cache, length: int) -> None:
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)  # transformers 5: a negative count removes that many trailing positions


def _cut(
    new: list[int], produced: list[int], max_new_tokens: int, eos_id: int | None
) -> tuple[list[int], bool]:
    """Append `new` to `produced`, stopping at EOS (kept) or the budget. -> (produced, done)."""
    for t in new:
        produced.append(t)
        if (eos_id is not None and t == eos_id) or len(produced) >= max_new_tokens:
            return produced, True
    return produced, False


@torch.no_grad()
def target_greedy(
    target: nn.Module, prompt: list[int], max_new_tokens: int, eos_id: int | None = None
) -> DecodeResult:
    """Plain cached greedy decoding: one target forward per generated token (the baseline)."""
    dev = next(target.parameters()).device
    t0 = time.perf_counter()
    cache = _new_cache(target)
    out = target(input_ids=torch.tensor([prompt], device=dev), past_key_values=cache, use_cache=True)
    produced, done = _cut([int(out.logits[0, -1].argmax())], [], max_new_tokens, eos_id)
    forwards = 1
    while not done:
        pos = len(prompt) + len(produced) - 1
        out = target(
            input_ids=torch.tensor([[produced[-1]]], device=dev),
            position_ids=torch.tensor([[pos]], device=dev),
            past_key_values=cache,
            use_cache=True,
        )
        forwards += 1
        produced, done = _cut([int(out.logits[0, -1].argmax())], produced, max_new_tokens, eos_id)
    return DecodeResult(produced, forwards, elapsed_s=time.perf_counter() - t0)


@torch.no_grad()
def speculative_generate(
    draft: nn.Module,
    target: nn.Module,
    prompt: list[int],
    max_new_tokens: int,
    block_size: int,
    layer_ids: list[int],
    mask_id: int,
    eos_id: int | None = None,
) -> DecodeResult:
    """Greedy speculative decoding with the DFlash draft (batch of one prompt)."""
    dev = next(target.parameters()).device
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    own_mask = getattr(draft, "mask_embedding", None) is not None
    t0 = time.perf_counter()
    # 1) prefill: the first token and the context features of every prompt position
    cache = _new_cache(target)
    out = target(
        input_ids=torch.tensor([prompt], device=dev),
        past_key_values=cache,
        use_cache=True,
        output_hidden_states=True,
    )
    ctx = _features(out.hidden_states, layer_ids)  # [1, P, F]
    produced, done = _cut([int(out.logits[0, -1].argmax())], [], max_new_tokens, eos_id)
    forwards, accepted = 1, []
    while not done:
        # 2) draft a block: [anchor, mask x (bs-1)] at positions a..a+bs-1, context = positions < a
        a = len(prompt) + len(produced) - 1  # the anchor (last committed token) is not in the cache yet
        block = torch.full((1, block_size), mask_id, device=dev)
        block[0, 0] = produced[-1]
        noise = embed(block.clamp(max=embed.weight.shape[0] - 1))  # [1, bs, d]
        pos = torch.arange(a + block_size, device=dev)[None]  # [1, a + bs]
        anchors, keep = torch.tensor([[a]], device=dev), torch.ones(1, 1, dtype=torch.bool, device=dev)
        mask = dflash_dense_mask(anchors, keep, a, block_size, dtype=noise.dtype)
        extra = {"mask_positions": block == mask_id} if own_mask else {}
        hidden = draft(
            target_hidden=ctx, noise_embedding=noise, position_ids=pos, attention_mask=mask, **extra
        )
        hidden = hidden if isinstance(hidden, Tensor) else hidden[0]
        proposal = head(hidden[:, 1:].to(head.weight.dtype)).argmax(-1)  # [1, bs-1]
        block[0, 1:] = proposal[0]
        # 3) verify the block in one target forward; accept the matching prefix, add the bonus token
        out = target(
            input_ids=block,
            position_ids=pos[:, a:],
            past_key_values=cache,
            use_cache=True,
            output_hidden_states=True,
        )
        forwards += 1
        posterior = out.logits[0].argmax(-1).tolist()  # [bs]: the target's next token after each slot
        prop = proposal[0].tolist()
        n_acc = 0
        while n_acc < block_size - 1 and prop[n_acc] == posterior[n_acc]:
            n_acc += 1
        accepted.append(n_acc)
        _crop(cache, a + n_acc + 1)  # keep the anchor and the accepted proposals
        ctx = torch.cat([ctx, _features(out.hidden_states, layer_ids)[:, : n_acc + 1]], dim=1)
        produced, done = _cut(prop[:n_acc] + [posterior[n_acc]], produced, max_new_tokens, eos_id)
    return DecodeResult(produced, forwards, accepted, elapsed_s=time.perf_counter() - t0)


def acceptance_metrics(
    results: list[DecodeResult], greedy: list[DecodeResult], block_size: int
) -> dict[str, float]:
    """tau, per-position acceptance, forwards and the speed-up over plain greedy, losslessness."""
    rounds = [n for r in results for n in r.accepted]
    num_rounds = max(len(rounds), 1)
    spec_fw, greedy_fw = sum(r.target_forwards for r in results), sum(g.target_forwards for g in greedy)
    tokens = sum(len(r.tokens) for r in results)
    metrics = {
        "tau": sum(n + 1 for n in rounds) / num_rounds,
        "target_forwards": spec_fw / max(len(results), 1),
        "greedy_target_forwards": greedy_fw / max(len(greedy), 1),
        "speedup_target_forwards": greedy_fw / max(spec_fw, 1),
        "tokens_per_target_forward": tokens / max(spec_fw, 1),
        "speedup_wall": sum(g.elapsed_s for g in greedy) / max(sum(r.elapsed_s for r in results), 1e-9),
        "lossless": float(all(r.tokens == g.tokens for r, g in zip(results, greedy))),
    }
    for k in range(1, block_size):
        metrics[f"acceptance_k{k}"] = sum(n >= k for n in rounds) / num_rounds
    return metrics


# ---- checkpoint loading and the evaluation entry --------------------------------------------------


def load_dflash_pair(
    checkpoint: str | Path | ResolvedCheckpoint,
    target: str | None = None,
    device: str | None = None,
    trust_remote_code: bool = False,
):
    """-> (draft, target, tokenizer, training Settings or None, draft config). Both in eval mode.
    `trust_remote_code` is the caller's (its settings or the registered model's record), never the
    checkpoint's own settings.json."""
    return _load_pair(resolve(checkpoint), target, device, trust_remote_code)


def _load_pair(resolved: ResolvedCheckpoint, target: str | None, device: str | None, trust: bool):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dllmflow.data.tokenizer import check_tokenizer_files, check_tokenizer_fits
    from dllmflow.inference.generate import remote_code_refusal
    from dllmflow.models.dflash_draft import load_draft
    from dllmflow.models.dflash_target import TINY_TARGET_PREFIX
    from dllmflow.models.integrity import load_checked
    from dllmflow.models.limits import vocab_rows

    ckpt, settings = resolved.path, resolved.settings
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    check_tokenizer_files(ckpt)
    # damaged weight files: one line naming the file/tensor; untrusted: weights into our class
    draft = load_checked(ckpt, lambda: (load_draft(ckpt, trust_remote_code=trust, dtype=dtype), None))
    cfg = draft.config
    target_id = target or getattr(cfg, "target_model_id", None)
    if not target_id:
        raise UserError(f"{ckpt}: the draft config names no target_model_id; pass the target explicitly")
    if target_id.startswith(TINY_TARGET_PREFIX):
        target_id = target_id[len(TINY_TARGET_PREFIX) :]
        if not (Path(target_id) / "config.json").is_file():
            raise UserError(f"tiny target {target_id} not found; run from the directory training ran in")

    def load_target():
        try:
            return AutoModelForCausalLM.from_pretrained(
                target_id, dtype=dtype, trust_remote_code=trust, output_loading_info=True,
                ignore_mismatched_sizes=True,
            )  # fmt: skip
        except ValueError as e:
            if "trust_remote_code" not in str(e):
                raise
            raise UserError(remote_code_refusal(target_id)) from None

    # a hub id has no local files to check first: its load report and weights are still checked
    tgt = load_checked(target_id if Path(target_id).is_dir() else None, load_target, target_id)
    tokenizer = AutoTokenizer.from_pretrained(resolved.tokenizer_dir)
    rows = vocab_rows(tgt)
    if rows is not None and getattr(cfg, "own_mask_embedding", False):
        rows += 1  # the draft embeds the mask itself: the one id past the target's rows (models/dflash_draft)
    check_tokenizer_fits(tokenizer, rows, ckpt)
    return draft.to(device).eval(), tgt.to(device).eval(), tokenizer, settings, cfg


def evaluate_dflash(
    checkpoint: str | Path | ResolvedCheckpoint,
    settings: Any = None,
    split: str = "eval",
    limit: int | None = None,
    max_new_tokens: int | None = None,
    prepared_dir: str | Path | None = None,
    target: str | None = None,
) -> dict[str, Any]:
    """Speculative decoding on the prompts of the prepared `split` vs plain greedy decoding of the
    target. -> {"metrics", "protocol", "predictions"} (metrics as `acceptance_metrics`)."""
    from dllmflow.data.dataset import PreparedDataset
    from dllmflow.data.task import prompt_messages
    from dllmflow.evaluation.protocol import split_sha256

    trust = bool(settings and settings.model.trust_remote_code)  # the caller's settings only
    checkpoint = resolve(checkpoint)  # once: the load and the protocol's record read it
    draft, tgt, tokenizer, trained, cfg = _load_pair(checkpoint, target, None, trust)
    settings = settings or trained
    if prepared_dir is None:
        if settings is None:
            raise UserError(f"{checkpoint}: no settings.json next to the weights; pass prepared_dir")
        prepared_dir = settings.dataset.prepared_dir
    eval_cfg = getattr(settings, "eval", None)
    limit = limit if limit is not None else getattr(eval_cfg, "limit", None)
    max_new_tokens = max_new_tokens or getattr(eval_cfg, "max_new_tokens", 128)
    block_size, layer_ids = int(cfg.block_size), list(cfg.target_layer_ids)
    mask_id = find_mask_id(cfg.mask_token_id, tokenizer=tokenizer)
    eos_id = tokenizer.eos_token_id

    rows = PreparedDataset(prepared_dir, split).rows(limit)
    if not rows:
        raise UserError(f"{prepared_dir}: split {split!r} has no rows to evaluate")
    spec, greedy, predictions = [], [], []
    for r in rows:
        prompt = list(
            tokenizer.apply_chat_template(
                prompt_messages(r["messages"]), add_generation_prompt=True, return_dict=False
            )
        )
        s = speculative_generate(draft, tgt, prompt, max_new_tokens, block_size, layer_ids, mask_id, eos_id)
        g = target_greedy(tgt, prompt, max_new_tokens, eos_id)
        spec.append(s)
        greedy.append(g)
        predictions.append(
            {
                "id": r["id"],
                "tokens": len(s.tokens),
                "accepted": s.accepted,
                "identical": s.tokens == g.tokens,
            }
        )
    metrics = acceptance_metrics(spec, greedy, block_size)
    metrics["num_examples"] = len(rows)
    protocol = {
        "sampler": "acceptance",
        "decoding": "greedy speculative (DFlash draft, target verification)",
        "sampler_settings": {"block_size": block_size, "target_layer_ids": layer_ids},
        "block_size": block_size,
        "target_layer_ids": layer_ids,
        "max_new_tokens": max_new_tokens,
        "limit": limit,
        "split": split,
        "split_sha256": split_sha256(prepared_dir, split),
        **checkpoint.record,
        "target": target or cfg.target_model_id,
    }
    return {"metrics": metrics, "protocol": protocol, "predictions": predictions}
