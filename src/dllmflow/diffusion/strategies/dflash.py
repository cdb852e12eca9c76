"""`dflash`: train a speculative block-diffusion draft on a frozen causal target (spec §2.5).

Per micro-batch the strategy samples anchor blocks (seeded per sample, never the global RNG), runs the
frozen target once under no_grad for the hidden states of the chosen layers, and trains the draft to
predict the bs-1 tokens after each anchor from (target states strictly before the anchor, the anchor
token, bs-1 mask tokens). Logits come from the frozen target head; the loss is the decay-weighted CE
of paper Eq. 4 summed here and divided by the global number of predicted tokens by the trainer.

    strategy = STRATEGIES["dflash"](settings)          # params/tiny_dflash.yaml, params/dflash_sft.yaml
    draft = strategy.build_model(tokenizer)            # the trainable draft only
    strategy.setup(draft, tokenizer, device)           # loads the frozen target once
    batch.update(strategy.corrupt(batch, seeds)); out = strategy.loss(draft, batch)

`dflash.target_model_id: "tiny:<dir>"` builds (once, seeded) a tiny random Qwen3 target from the run
tokenizer in <dir> (`build_tiny_target`), for tests and the CPU demo; anything else is a hub id or
local dir loaded with `AutoModelForCausalLM`. Deliberate differences from the reference code (spec
§7): the block mask is always built (1), the non-overlap sampler is per sample and cannot fail (3),
draft accuracy is logged for every N (7).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from dllmflow.diffusion.masks.dflash import dflash_block_mask, dflash_dense_mask
from dllmflow.diffusion.seeding import generators
from dllmflow.errors import UserError
from dllmflow.models.dflash_draft import build_draft_config, build_target_layer_ids, load_draft

from .base import Batch, LossOutput, Strategy

BACKENDS = ("sdpa", "flex_attention")
TINY_TARGET_PREFIX = "tiny:"
PAPER_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}
MASK_TOKEN = "<|MASK|>"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# ---- configuration helpers ------------------------------------------------------------------------


def resolve_gamma(gamma: float, block_size: int) -> float:
    """Paper defaults when gamma <= 0: 7/5/4 for bs 16/10/8, else max(2, bs/2)."""
    if gamma > 0:
        return float(gamma)
    return PAPER_GAMMA.get(block_size, max(2.0, block_size / 2))


def decay_weights(block_size: int, gamma: float | None) -> Tensor:
    """w_k = exp(-(k-1)/gamma) for offsets k = 1..bs-1 (all ones when gamma is None). [bs-1]"""
    k = torch.arange(1, block_size, dtype=torch.float32)
    return torch.ones_like(k) if gamma is None else torch.exp(-(k - 1) / gamma)


def resolve_block_size(configured: int, draft: nn.Module) -> int:
    """`dflash.block_size`, or (when 0) the draft's `block_size` / config; must end up >= 2."""
    bs = configured
    if bs <= 0:
        cfg = getattr(draft, "config", None)
        extra = getattr(cfg, "dflash_config", None) or {}
        bs = getattr(draft, "block_size", None) or getattr(cfg, "block_size", None) or extra.get("block_size")
    if bs is None:
        raise UserError(
            "dflash.block_size is 0 and the draft config has no block_size; set dflash.block_size >= 2"
        )
    if int(bs) < 2:
        raise UserError(f"dflash block size {bs} < 2: a block needs its anchor plus >= 1 predicted token")
    return int(bs)


def resolve_target_layer_ids(
    configured: list[int] | None, draft: nn.Module, num_target_layers: int
) -> list[int]:
    """`dflash.target_layer_ids` > the draft's own ids > evenly spaced (spec helper)."""
    cfg = getattr(draft, "config", None)
    extra = getattr(cfg, "dflash_config", None) or {}
    ids = configured or getattr(cfg, "target_layer_ids", None) or extra.get("target_layer_ids")
    if not ids:
        ids = build_target_layer_ids(num_target_layers, getattr(cfg, "num_hidden_layers", 1))
    bad = [i for i in ids if not 0 <= i < num_target_layers]
    if bad:
        raise UserError(
            f"dflash.target_layer_ids {list(ids)}: {bad} outside the target's {num_target_layers} layers"
        )
    return [int(i) for i in ids]


# ---- the tiny target (tests, CPU demo) ------------------------------------------------------------


def build_tiny_target(
    out_dir: str | Path, tokenizer, hidden_size: int = 64, num_layers: int = 4, seed: int = 0
) -> Path:
    """Write a tiny random Qwen3 causal LM (vocab = len(tokenizer)) + the tokenizer to `out_dir`,
    once: an existing dir is reused. Seeded and written via a temp dir + rename, so every rank and
    every later run (training, evaluation) sees the same target."""
    from dllmflow.models.build import build_tiny_model
    from dllmflow.settings.sections import TinyModelConfig

    out = Path(out_dir)
    if (out / "config.json").is_file():
        return out
    tiny = TinyModelConfig(
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=2 * hidden_size,
        tie_word_embeddings=True,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = build_tiny_model(tiny, tokenizer)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-target-", dir=out.parent))
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    try:
        os.replace(tmp, out)
    except OSError:  # another rank won the race: its target is identical
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def resolve_target_path(target_model_id: str, tokenizer) -> str:
    if target_model_id.startswith(TINY_TARGET_PREFIX):
        return str(build_tiny_target(target_model_id[len(TINY_TARGET_PREFIX) :], tokenizer))
    looks_local = target_model_id.startswith((".", "/", "~")) or Path(target_model_id).exists()
    if looks_local and not Path(target_model_id).expanduser().is_dir():
        raise UserError(f"dflash.target_model_id={target_model_id!r}: no such directory")
    return target_model_id


def resolve_mask_token_id(configured: int | None, tokenizer, target_path: str | None = None) -> int:
    """settings > the run tokenizer's mask > the target tokenizer's mask > add `<|MASK|>` to the run
    tokenizer (Qwen3: id 151669, a row the target embedding already has)."""
    if configured is not None:
        return int(configured)
    if getattr(tokenizer, "mask_token_id", None) is not None:
        return int(tokenizer.mask_token_id)
    if target_path is not None:
        try:
            from transformers import AutoTokenizer

            target_tok = AutoTokenizer.from_pretrained(target_path)
            if target_tok.mask_token_id is not None:
                return int(target_tok.mask_token_id)
        except (OSError, ValueError):  # no tokenizer saved with the target: fall through to adding one
            pass
    tokenizer.add_special_tokens({"mask_token": MASK_TOKEN})
    return int(tokenizer.mask_token_id)


# ---- anchor sampling and block inputs (plain functions, seeded per sample) -------------------------


def sample_anchors_overlap(valid_len: int, num_blocks: int, block_size: int, gen: torch.Generator) -> Tensor:
    """N independent anchors, uniform in [1, max(valid-bs, 1)]; they may repeat, overlap, land in the
    prompt (those targets are masked out later), and N may exceed L/bs. [N] long"""
    max_anchor = max(valid_len - block_size, 1)
    return torch.randint(1, max_anchor + 1, (num_blocks,), generator=gen)


def sample_anchors_disjoint(
    valid_len: int, num_blocks: int, block_size: int, gen: torch.Generator
) -> tuple[Tensor, int]:
    """Up to N non-overlapping blocks inside [1, valid), uniform over placements (stars and bars):
    pick n distinct sorted c_i from [0, slack + n), start_i = 1 + (c_i - i) + i·bs. Unlike the legacy
    `randperm(avail)[:n]` this never comes up short (spec §7 caveat 3). Pads to N by repeating the
    last start; returns (anchors [N] long, n_valid)."""
    n_valid = min(num_blocks, max(1, (valid_len - 1) // block_size))
    slack = valid_len - 1 - n_valid * block_size
    i = torch.arange(n_valid)
    if slack < 0:  # the sample is shorter than one block: keep=False drops it anyway
        starts = 1 + i * block_size
    else:
        c = torch.randperm(slack + n_valid, generator=gen)[:n_valid].sort().values
        starts = 1 + (c - i) + i * block_size
    pad = starts[-1:].expand(num_blocks - n_valid)
    return torch.cat([starts, pad]), n_valid


def sample_anchor_blocks(
    attention_mask: Tensor, loss_mask: Tensor, block_size: int, num_blocks: int, overlap: bool, gens: list
) -> tuple[Tensor, Tensor]:
    """Anchors [B, N] long and keep [B, N] bool. keep = enough supervision (>= 2·bs tokens), a
    sequence longer than one block, and (non-overlap) a real, not padded, block."""
    effective = attention_mask * loss_mask  # [B, L]
    valid = attention_mask.sum(1).long().tolist()
    sup = effective.sum(1).tolist()
    anchors, keep = [], []
    for b, gen in enumerate(gens):
        if overlap:
            a, n_valid = sample_anchors_overlap(valid[b], num_blocks, block_size, gen), num_blocks
        else:
            a, n_valid = sample_anchors_disjoint(valid[b], num_blocks, block_size, gen)
        ok = sup[b] >= 2 * block_size and valid[b] > block_size
        anchors.append(a)
        keep.append(torch.arange(num_blocks) < (n_valid if ok else 0))
    return torch.stack(anchors).to(attention_mask.device), torch.stack(keep).to(attention_mask.device)


def build_block_inputs(
    input_ids: Tensor,
    attention_mask: Tensor,
    loss_mask: Tensor,
    anchors: Tensor,
    keep: Tensor,
    block_size: int,
    mask_id: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """Block token ids [B, N·bs] (clean anchor, then mask ids; a dropped block is all mask), targets
    x[a+k] [B, N·(bs-1)] and their mask effective[a+k]·1[a+k < valid]·keep [B, N·(bs-1)] float."""
    bsz, seq_len = input_ids.shape
    num_blocks = anchors.shape[1]
    pos = anchors[:, :, None] + torch.arange(block_size, device=anchors.device)  # [B, N, bs]
    flat = pos.clamp(max=seq_len - 1).reshape(bsz, -1)  # [B, N·bs]
    tokens = input_ids.gather(1, flat).view(bsz, num_blocks, block_size)  # [B, N, bs]
    block_ids = torch.full_like(tokens, mask_id)
    block_ids[:, :, 0] = torch.where(keep, tokens[:, :, 0], torch.full_like(tokens[:, :, 0], mask_id))
    effective = (attention_mask * loss_mask).float().gather(1, flat).view(bsz, num_blocks, block_size)
    valid = attention_mask.sum(1)[:, None, None]  # [B, 1, 1]
    tmask = effective[:, :, 1:] * (pos[:, :, 1:] < valid).float() * keep[:, :, None].float()  # [B, N, bs-1]
    return block_ids.view(bsz, -1), tokens[:, :, 1:].reshape(bsz, -1), tmask.reshape(bsz, -1)


def block_position_ids(anchors: Tensor, ctx_len: int, block_size: int) -> Tensor:
    """[0..S-1] ++ [a_n + 0..bs-1 for each n]: [B, S + N·bs]."""
    bsz = anchors.shape[0]
    ctx = torch.arange(ctx_len, device=anchors.device).expand(bsz, ctx_len)
    blocks = (anchors[:, :, None] + torch.arange(block_size, device=anchors.device)).reshape(bsz, -1)
    return torch.cat([ctx, blocks], dim=1)


# ---- decay-weighted CE with draft accuracy --------------------------------------------------------


def decay_ce_dense(
    hidden: Tensor, head: nn.Module, targets: Tensor, mask: Tensor, weights: Tensor
) -> tuple[Tensor, Tensor]:
    """Σ w·mask·CE over all positions, and `correct` = (argmax == target)·mask. hidden [B, P, d],
    targets/mask/weights [B, P] (weights broadcastable). Returns (loss_sum, correct [B, P] float)."""
    logits = head(hidden.to(_head_dtype(head))).float()  # [B, P, V]
    ce = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none")  # [B, P]
    correct = (logits.argmax(-1) == targets).float() * mask
    return (weights * mask * ce).sum(), correct


def _chunk_ce(h: Tensor, weight: Tensor, bias: Tensor | None, t: Tensor) -> tuple[Tensor, Tensor]:
    logits = F.linear(h.to(weight.dtype), weight, bias).float()  # [c, V]
    return F.cross_entropy(logits, t, reduction="none"), logits.argmax(-1)


def decay_ce_fused(
    hidden: Tensor, head: nn.Module, targets: Tensor, mask: Tensor, weights: Tensor, chunk_size: int
) -> tuple[Tensor, Tensor]:
    """Same result as `decay_ce_dense`, never holding more than `chunk_size` rows of logits: only
    supervised positions are scored, chunk by chunk under activation checkpointing (the [c, V]
    logits are recomputed in backward instead of stored)."""
    bsz, p, d = hidden.shape
    w_full = torch.broadcast_to(weights, mask.shape).reshape(-1)
    sel = mask.reshape(-1).nonzero().squeeze(1)  # [M]
    h, t = hidden.reshape(-1, d)[sel], targets.reshape(-1)[sel]  # [M, d], [M]
    wm = (w_full * mask.reshape(-1))[sel]  # [M]
    loss_sum = hidden.new_zeros((), dtype=torch.float32)
    hit = torch.zeros(sel.shape[0], device=hidden.device)
    for s in range(0, sel.shape[0], chunk_size):
        ce, pred = checkpoint(
            _chunk_ce,
            h[s : s + chunk_size],
            head.weight,
            head.bias,
            t[s : s + chunk_size],
            use_reentrant=False,
        )
        loss_sum = loss_sum + (wm[s : s + chunk_size] * ce).sum()
        hit[s : s + chunk_size] = (pred == t[s : s + chunk_size]).float()
    correct = torch.zeros(bsz * p, device=hidden.device).index_put((sel,), hit * mask.reshape(-1)[sel])
    return loss_sum, correct.view(bsz, p)


def _head_dtype(head: nn.Module) -> torch.dtype:
    return head.weight.dtype


def accuracy_sums(correct: Tensor, mask: Tensor, block_size: int) -> dict[str, Tensor]:
    """Per-offset `draft_correct_k{k}` / `draft_count_k{k}` (k = 1..bs-1), summed over batch and blocks."""
    c = correct.detach().reshape(correct.shape[0], -1, block_size - 1).sum((0, 1))  # [bs-1]
    n = mask.detach().reshape(mask.shape[0], -1, block_size - 1).sum((0, 1))  # [bs-1]
    out = {}
    for k in range(1, block_size):
        out[f"draft_correct_k{k}"] = c[k - 1].float()
        out[f"draft_count_k{k}"] = n[k - 1].float()
    return out


def draft_accuracy(metric_sums: dict[str, float]) -> dict[str, float]:
    """From GLOBAL sums: draft_acc = Σcorrect/Σcount, draft_acc_k{k} = correct_k / max(count_k, 1)."""
    ks = sorted(int(key[len("draft_count_k") :]) for key in metric_sums if key.startswith("draft_count_k"))
    if not ks:
        return {}
    correct = {k: float(metric_sums.get(f"draft_correct_k{k}", 0.0)) for k in ks}
    count = {k: float(metric_sums[f"draft_count_k{k}"]) for k in ks}
    out = {"draft_acc": sum(correct.values()) / max(sum(count.values()), 1.0)}
    out.update({f"draft_acc_k{k}": correct[k] / max(count[k], 1.0) for k in ks})
    return out


# ---- the strategy ---------------------------------------------------------------------------------


def _unwrap(model: nn.Module) -> nn.Module:
    return getattr(model, "module", model)  # DDP; FSDP2 modules are not wrapped


class DFlashStrategy(Strategy):
    name = "dflash"

    def __init__(self, settings):
        super().__init__(settings)
        self.dcfg = settings.dflash
        if self.dcfg is None or not getattr(self.dcfg, "target_model_id", None):
            raise UserError(
                "dllm.mode dflash needs a dflash: section with dflash.target_model_id (the frozen target)"
            )
        if self.dcfg.attention_backend not in BACKENDS:
            raise UserError(
                f"dflash.attention_backend={self.dcfg.attention_backend!r}: choose one of {', '.join(BACKENDS)}"
            )
        self.num_blocks = self.dcfg.num_blocks_per_sample
        self.fixed_ctx_len = settings.dataset.seq_length
        self.block_size: int | None = None
        self.gamma: float | None = None
        self.layer_ids: list[int] | None = None
        self.target: nn.Module | None = None
        self._target_path: str | None = None
        self._own_mask_embedding = False

    # ---- model ------------------------------------------------------------------------------------
    def target_path(self, tokenizer) -> str:
        if self._target_path is None:
            self._target_path = resolve_target_path(self.dcfg.target_model_id, tokenizer)
        return self._target_path

    def _resolve_mask(self, tokenizer) -> int:
        if self.mask_token_id is None:
            self.mask_token_id = resolve_mask_token_id(None, tokenizer, self.target_path(tokenizer))
        return self.mask_token_id

    def build_model(self, tokenizer) -> nn.Module:
        """The trainable draft: a draft checkpoint (`model.pretrained_model_name_or_path`) or a fresh
        draft of ours shaped like the target with `dflash.num_draft_layers` layers."""
        from transformers import AutoConfig

        path = self.target_path(tokenizer)
        mask_id = self._resolve_mask(tokenizer)
        mcfg = self.settings.model
        if mcfg.pretrained_model_name_or_path:
            return load_draft(
                mcfg.pretrained_model_name_or_path, mcfg.trust_remote_code, _DTYPES[mcfg.torch_dtype]
            )
        if self.dcfg.block_size <= 0:
            raise UserError(
                "dflash.block_size is 0 (read from the draft config) but there is no draft checkpoint "
                "(model.pretrained_model_name_or_path); set dflash.block_size >= 2"
            )
        tcfg = AutoConfig.from_pretrained(path, trust_remote_code=mcfg.trust_remote_code)
        vocab = (tcfg.get_text_config() if hasattr(tcfg, "get_text_config") else tcfg).vocab_size
        cfg = build_draft_config(
            tcfg,
            num_draft_layers=self.dcfg.num_draft_layers,
            block_size=self.dcfg.block_size,
            target_layer_ids=self.dcfg.target_layer_ids,
            mask_token_id=mask_id,
            target_model_id=self.dcfg.target_model_id,
            own_mask_embedding=mask_id >= vocab,
        )
        from dllmflow.models.dflash_draft import DFlashDraftModel

        return DFlashDraftModel(cfg).to(_DTYPES[mcfg.torch_dtype])

    def load_target(self, path: str, device: torch.device) -> nn.Module:
        from transformers import AutoModelForCausalLM

        target = AutoModelForCausalLM.from_pretrained(
            path,
            dtype=_DTYPES[self.dcfg.target_torch_dtype],
            trust_remote_code=self.settings.model.trust_remote_code,
        )
        target.eval().requires_grad_(False)
        return target.to(device)

    def setup(self, model: nn.Module, tokenizer, device: torch.device) -> None:
        """Load the frozen target once and resolve block size, gamma, layer ids and the mask id."""
        draft = _unwrap(model)
        mask_id = self._resolve_mask(tokenizer)
        if self.dcfg.attention_backend == "flex_attention":
            if torch.device(device).type != "cuda":
                raise UserError(
                    "dflash.attention_backend=flex_attention needs a CUDA device (no CPU backward); use sdpa"
                )
            draft.config._attn_implementation = "flex_attention"
        self.target = self.load_target(self.target_path(tokenizer), torch.device(device))
        embed = self.target.get_input_embeddings() or getattr(
            getattr(self.target, "model", None), "embed_tokens", None
        )
        head = self.target.get_output_embeddings() or getattr(self.target, "lm_head", None)
        if embed is None or head is None:
            raise UserError(
                f"dflash target {self.dcfg.target_model_id}: needs an input embedding and an LM head"
            )
        self.target_embed, self.target_head = embed, head
        tcfg = self.target.config.get_text_config()
        self.block_size = resolve_block_size(self.dcfg.block_size, draft)
        self.gamma = resolve_gamma(self.dcfg.loss_decay_gamma, self.block_size)
        self.layer_ids = resolve_target_layer_ids(self.dcfg.target_layer_ids, draft, tcfg.num_hidden_layers)
        fc = getattr(draft, "fc", None)
        if fc is not None and fc.in_features != len(self.layer_ids) * tcfg.hidden_size:
            raise UserError(
                f"draft fc takes {fc.in_features} features but {len(self.layer_ids)} target layers x hidden "
                f"{tcfg.hidden_size} = {len(self.layer_ids) * tcfg.hidden_size}; fix dflash.target_layer_ids"
            )
        vocab = embed.weight.shape[0]
        self._own_mask_embedding = mask_id >= vocab
        if self._own_mask_embedding and getattr(draft, "mask_embedding", None) is None:
            raise UserError(
                f"mask id {mask_id} has no row in the target embedding ({vocab} rows) and the draft has no own "
                "mask embedding; set dllm.mask_token_id to a reserved id < the target vocabulary"
            )

    # ---- one micro-batch --------------------------------------------------------------------------
    def corrupt(self, batch: Batch, seeds: list[int]) -> Batch:
        ids, loss_mask = batch["input_ids"], batch["loss_mask"]
        attn = batch.get("attention_mask")
        attn = torch.ones_like(ids) if attn is None else attn
        bs = self._require_setup()
        anchors, keep = sample_anchor_blocks(
            attn, loss_mask, bs, self.num_blocks, self.dcfg.overlap_anchors, generators(seeds)
        )
        block_ids, targets, tmask = build_block_inputs(
            ids, attn, loss_mask, anchors, keep, bs, self.mask_token_id
        )
        return {
            "dflash_anchors": anchors,  # [B, N]
            "dflash_keep": keep,  # [B, N]
            "dflash_block_ids": block_ids,  # [B, N·bs]
            "dflash_targets": targets,  # [B, N·(bs-1)]
            "dflash_target_mask": tmask,  # [B, N·(bs-1)]
        }

    def token_counts(self, batch: Batch) -> dict[str, Tensor]:
        return {"diffusion": batch["dflash_target_mask"].sum()}

    @torch.no_grad()
    def target_features(self, batch: Batch) -> Tensor:
        """Frozen target over the full batch length: concat of hidden_states[l+1] for l in the layer
        ids (index 0 is the embedding output). [B, L, |ids|·d]"""
        out = self.target.base_model(
            input_ids=batch["input_ids"],
            attention_mask=batch.get("attention_mask"),
            output_hidden_states=True,
            use_cache=False,
        )
        return torch.cat([out.hidden_states[i + 1] for i in self.layer_ids], dim=-1)

    def loss(self, model: nn.Module, batch: Batch) -> LossOutput:
        return self.draft_loss(model, batch, self.target_features(batch))

    def draft_loss(self, model: nn.Module, batch: Batch, target_hidden: Tensor) -> LossOutput:
        """The draft step given the target's features (split out so benchmarks can time each half)."""
        bs = self._require_setup()
        anchors, keep = batch["dflash_anchors"], batch["dflash_keep"]
        bsz, seq_len = batch["input_ids"].shape
        flex = self.dcfg.attention_backend == "flex_attention"
        # 1) context: pad to the fixed length under flex so the compiled BlockMask keeps static shapes
        ctx_len = max(self.fixed_ctx_len, seq_len) if flex else seq_len
        h = F.pad(target_hidden, (0, 0, 0, ctx_len - seq_len))  # [B, S, |ids|·d]
        # 2) block inputs through the frozen target embedding (a mask id beyond it -> the draft's own)
        block_ids = batch["dflash_block_ids"]
        with torch.no_grad():
            noise = self.target_embed(
                block_ids.clamp(max=self.target_embed.weight.shape[0] - 1)
            )  # [B, N·bs, d]
        extra = {"mask_positions": block_ids == self.mask_token_id} if self._own_mask_embedding else {}
        # 3) positions and the block mask: always built (spec §7 caveat 1)
        pos = block_position_ids(anchors, ctx_len, bs)  # [B, S + N·bs]
        if flex:
            attn = dflash_block_mask(anchors, keep, ctx_len, bs)
        else:
            attn = dflash_dense_mask(anchors, keep, ctx_len, bs, dtype=noise.dtype)  # [B, 1, N·bs, S + N·bs]
        out = model(
            target_hidden=h,
            noise_embedding=noise,
            position_ids=pos,
            attention_mask=attn,
            use_cache=False,
            is_causal=False,
            **extra,
        )
        hidden = out if isinstance(out, Tensor) else getattr(out, "last_hidden_state", None)
        hidden = out[0] if hidden is None else hidden  # a tuple-returning remote draft
        # 4) predict offsets 1..bs-1 of every block (the anchor slot is given, not predicted)
        d = hidden.shape[-1]
        pred = hidden.view(bsz, -1, bs, d)[:, :, 1:].reshape(bsz, -1, d)  # [B, N·(bs-1), d]
        targets, tmask = batch["dflash_targets"], batch["dflash_target_mask"]
        weights = (
            decay_weights(bs, self.gamma).to(pred.device).repeat(anchors.shape[1])
        )  # [N·(bs-1)], reset per block
        if self.dcfg.use_fused_linear_ce:
            loss_sum, correct = decay_ce_fused(
                pred, self.target_head, targets, tmask, weights, self.dcfg.ce_chunk_size
            )
        else:
            loss_sum, correct = decay_ce_dense(pred, self.target_head, targets, tmask, weights)
        return LossOutput(sums={"diffusion": loss_sum}, metric_sums=accuracy_sums(correct, tmask, bs))

    def _require_setup(self) -> int:
        if self.block_size is None:
            raise RuntimeError("DFlashStrategy.setup() must run before corrupt()/loss()")
        return self.block_size

    # ---- reporting and export ---------------------------------------------------------------------
    def finalize_metrics(self, metric_sums: dict[str, float]) -> dict[str, float]:
        return draft_accuracy(metric_sums)

    def export(self, model: nn.Module, state_dict: dict[str, Tensor], tokenizer: Any, out_dir: Path) -> None:
        """Only the draft (the target stays where `target_model_id` points), with the DFlash fields
        in its config so it decodes and loads back on its own."""
        draft = _unwrap(model)
        cfg = draft.config
        fields = {
            "block_size": self.block_size,
            "target_layer_ids": self.layer_ids,
            "mask_token_id": self.mask_token_id,
        }
        for key, value in fields.items():
            setattr(cfg, key, value)
        if isinstance(getattr(cfg, "dflash_config", None), dict):  # the published drafts' layout
            cfg.dflash_config.update({k: v for k, v in fields.items() if k != "block_size"})
        cfg.target_model_id = self.dcfg.target_model_id
        draft.save_pretrained(out_dir, state_dict=state_dict, safe_serialization=True)
        tokenizer.save_pretrained(out_dir)


__all__ = [
    "DFlashStrategy",
    "accuracy_sums",
    "build_block_inputs",
    "build_target_layer_ids",
    "build_tiny_target",
    "decay_ce_dense",
    "decay_ce_fused",
    "decay_weights",
    "draft_accuracy",
    "resolve_gamma",
    "sample_anchor_blocks",
    "sample_anchors_disjoint",
    "sample_anchors_overlap",
]
