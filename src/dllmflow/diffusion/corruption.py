"""Corruption kernels: clean ids + loss mask -> (noisy ids, noise mask, p_mask), docs/strategies.md §2.

Every kernel draws only from the `generator` it is given (never the global RNG), in the order the
spec lists, and corrupts only supervised positions (`loss_mask != 0`). The trainer seeds one
generator per sample (`dllmflow.diffusion.seeding`) and runs a kernel one row at a time through
`per_sample`, so a sample's noise does not depend on which batch it landed in:

    from dllmflow.diffusion.corruption import corrupt_uniform, per_sample
    z, noise, p = per_sample(corrupt_uniform, seeds, input_ids, loss_mask, mask_token_id=M, eps=1e-3)
    z, noise, p = corrupt_batch(corrupt_uniform, seeds, batch, draw_length=L, mask_token_id=M)  # packed too

Kernels (all tensors `[B, L]`; `noisy_ids` keeps the dtype of `input_ids`, `noise_mask` is bool,
`p_mask` float32):
  corrupt_uniform         mdlm: one t per row, mask each supervised position with p = eps + (1-eps) t
  corrupt_blockwise       hybrid: exactly k = round(m len) positions per block, biased to later ones
  corrupt_mix             scdd: absorbing [MASK] channel + uniform-replacement channel
  corrupt_scdd            scdd: t on the discrete grid, channel masses from the SCDD schedule
  corrupt_uniform_random  block diffusion: random replacement tokens over the full vocabulary
  corrupt_all_masked      idlm: every supervised position becomes [MASK] (deterministic)
  corrupt_one_block       block_causal, causal_blocks: one block of the response per row, masked as
                          mdlm's kernel or as a suffix
                          (two more outputs: the block's positions [B, L] and the prompt length [B])
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from dllmflow.diffusion.schedules import scdd_schedule

Corruption = tuple[Tensor, Tensor, Tensor]


def per_sample(
    kernel: Callable[..., tuple[Tensor, ...]],
    seeds: Sequence[int],
    input_ids: Tensor,
    loss_mask: Tensor,
    *,
    draw_length: int | None = None,
    **kw: Any,
) -> tuple[Tensor, ...]:
    """Run `kernel` on each row with its own `torch.Generator(seed)` and concatenate the outputs.

    One generator per row makes a sample's noise a function of its seed alone (not of the batch size
    or of its neighbours), which is what makes corruption topology-independent (docs/strategies.md §1.3). The
    kernels draw `[1, L]` tensors, so the padded batch length L would still shift the stream; with
    `draw_length` (the run's fixed `dataset.seq_length`) each row is drawn at that length (extra
    positions unsupervised, hence never corrupted) and cut back, so the noise no longer depends on
    how the micro-batch was padded.
    """
    if len(seeds) != input_ids.shape[0]:
        raise ValueError(f"per_sample: got {len(seeds)} seeds for a batch of {input_ids.shape[0]} rows")
    length = input_ids.shape[1]
    extra = max((draw_length or length) - length, 0)
    if extra:
        input_ids = torch.nn.functional.pad(input_ids, (0, extra))
        loss_mask = torch.nn.functional.pad(loss_mask, (0, extra))
    outs = []
    for b, seed in enumerate(seeds):
        gen = torch.Generator(device=input_ids.device)
        gen.manual_seed(int(seed))
        outs.append(kernel(input_ids[b : b + 1], loss_mask[b : b + 1], generator=gen, **kw))
    return tuple(
        torch.cat(parts, dim=0)[:, :length] if parts[0].dim() > 1 else torch.cat(parts, dim=0)
        for parts in zip(*outs)
    )


def per_document(
    kernel: Callable[..., tuple[Tensor, ...]],
    seeds: Sequence[int],
    input_ids: Tensor,
    loss_mask: Tensor,
    document_ids: Tensor,
    position_ids: Tensor,
    *,
    draw_length: int,
    **kw: Any,
) -> tuple[Tensor, ...]:
    """`per_sample` for a packed batch (docs/strategies.md §1.8): each document drawn as its own row.

    `document_ids` [R, T] (n = document n, -1 = padding) and `position_ids` [R, T] (offset inside the
    document) say where each document lies; `seeds[n]` is document n's seed. Every document is cut out
    into a row of its own, `per_sample` draws it at `draw_length` exactly as it would an unpacked row
    holding that document, and the outputs go back to the packed positions. Padding positions take
    document 0's values at offset 0 (never read: unsupervised), except bool outputs (False: no noise)
    and id outputs (the padding's own ids).
    """
    R, T = input_ids.shape
    N = len(seeds)
    real = document_ids >= 0  # [R, T]
    doc, pos = document_ids[real], position_ids[real]  # [P], the packed positions of all documents
    if N == 0:  # every document of the batch was dropped: all padding, unsupervised, so never noised
        return per_sample(kernel, [0] * R, input_ids, loss_mask, draw_length=draw_length, **kw)
    # 1) the documents as rows [N, W] (content at offsets 0..len-1, zeros after: unsupervised)
    W = int(pos.max()) + 1
    rows_ids = input_ids.new_zeros(N, W)
    rows_mask = loss_mask.new_zeros(N, W)
    rows_ids[doc, pos] = input_ids[real]
    rows_mask[doc, pos] = loss_mask[real]
    # 2) draw each as `per_sample` draws an unpacked row
    outs = per_sample(kernel, seeds, rows_ids, rows_mask, draw_length=draw_length, **kw)
    # 3) back to the packed layout
    src_doc = torch.where(real, document_ids, 0)  # [R, T]
    src_pos = torch.where(real, position_ids, 0)  # [R, T]
    packed = []
    for o in outs:
        gathered = o[src_doc, src_pos]  # [R, T]
        packed.append(torch.where(real, gathered, _packed_default(gathered, input_ids)))
    return tuple(packed)


def _packed_default(values: Tensor, input_ids: Tensor) -> Tensor:
    """What a padding position of a packed batch holds for one kernel output: no noise, its own id."""
    if values.dtype == torch.bool:
        return torch.zeros_like(values)
    if values.dtype == input_ids.dtype:
        return input_ids
    return values


def corrupt_batch(
    kernel: Callable[..., tuple[Tensor, ...]], seeds: Sequence[int], batch: dict[str, Tensor], **kw: Any
) -> tuple[Tensor, ...]:
    """`kernel` over a collated batch, one generator per sample: `per_document` when the batch is
    packed (it carries `document_ids`), else `per_sample` over its rows."""
    if "document_ids" in batch:
        return per_document(
            kernel, seeds, batch["input_ids"], batch["loss_mask"], batch["document_ids"],
            batch["position_ids"], **kw,
        )  # fmt: skip
    return per_sample(kernel, seeds, batch["input_ids"], batch["loss_mask"], **kw)


def corrupt_uniform(
    input_ids: Tensor,
    loss_mask: Tensor,
    mask_token_id: int,
    *,
    eps: float = 1e-3,
    generator: torch.Generator | None = None,
) -> Corruption:
    """LLaDA/MDLM masking (docs/strategies.md §2.1): t ~ U[0,1) per row, p = (1-eps) t + eps, mask where u < p."""
    B, L = input_ids.shape
    dev = input_ids.device
    sup = loss_mask != 0  # [B, L]
    t = torch.rand(B, device=dev, generator=generator)  # [B]
    p = (1.0 - eps) * t + eps  # [B]
    u = torch.rand(B, L, device=dev, generator=generator)  # [B, L]
    noise = (u < p[:, None]) & sup  # [B, L]
    noisy = torch.where(noise, torch.full_like(input_ids, mask_token_id), input_ids)
    return noisy, noise, p[:, None].expand(B, L).to(torch.float32).contiguous()


def gumbel_topk(log_weights: Tensor, k: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """Select exactly `k[i]` entries of row i, without replacement, with probabilities ∝ exp(log_weights).

    log_weights [N, n] (-inf = never selected), k [N] long with k <= #finite entries -> bool [N, n].
    Gumbel-top-k: the k largest of log w + Gumbel noise are a weighted sample without replacement.
    """
    u = torch.rand(log_weights.shape, device=log_weights.device, generator=generator)  # [N, n]
    gumbel = -torch.log(-torch.log(u + 1e-9) + 1e-9)
    order = torch.argsort(log_weights + gumbel, dim=-1, descending=True)  # [N, n]
    rank = torch.argsort(order, dim=-1)  # rank of each entry in the sorted order
    return rank < k[:, None]


def corrupt_blockwise(
    input_ids: Tensor,
    loss_mask: Tensor,
    mask_token_id: int,
    *,
    block_size: int | None,
    eps: float = 1e-3,
    half_life_ratio: float | None = 0.25,
    generator: torch.Generator | None = None,
) -> Corruption:
    """Nemotron-Labs-Diffusion blockwise masking (docs/strategies.md §2.3).

    Per block of `block_size` (the last may be short): m = eps + (1-eps) U, k = round(m len) positions
    chosen by Gumbel-top-k with log w_j = λ (1-m) j, λ = ln 2 / (h bs), so small m biases masking to
    later positions. `block_size=None`: one block per row, λ = ln2/(h L), k clamped to [1, L].
    Unsupervised positions are dropped after selection; p_mask = the block's m.
    """
    B, L = input_ids.shape
    dev = input_ids.device
    h = 0.25 if half_life_ratio is None else half_life_ratio
    per_sequence = block_size is None
    bs = L if per_sequence else int(block_size)
    if bs < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    nb = math.ceil(L / bs)
    block_len = torch.full((nb,), bs, device=dev, dtype=torch.long)
    block_len[-1] = L - (nb - 1) * bs  # a short last block

    # 1) one corruption level per block
    m = eps + (1.0 - eps) * torch.rand(B * nb, device=dev, generator=generator)  # [B*nb]
    lens = block_len.repeat(B)  # [B*nb]
    k = torch.round(m * lens).long()
    k = torch.minimum(torch.clamp(k, min=1 if per_sequence else 0), lens)

    # 2) half-life positional bias; positions past a short last block can never be chosen
    lam = math.log(2.0) / (h * bs)
    j = torch.arange(bs, device=dev, dtype=torch.float32)  # [bs]
    log_w = lam * (1.0 - m)[:, None] * j[None, :]  # [B*nb, bs]
    log_w = log_w.masked_fill(j[None, :] >= lens[:, None], float("-inf"))

    # 3) exactly k per block, then keep only supervised positions
    chosen = gumbel_topk(log_w, k, generator).view(B, nb * bs)[:, :L]  # [B, L]
    noise = chosen & (loss_mask != 0)
    noisy = torch.where(noise, torch.full_like(input_ids, mask_token_id), input_ids)
    p_mask = m.view(B, nb).repeat_interleave(bs, dim=1)[:, :L].to(torch.float32).contiguous()  # [B, L]
    return noisy, noise, p_mask


def corrupt_mix(
    input_ids: Tensor,
    loss_mask: Tensor,
    mask_token_id: int,
    vocab_size: int,
    mask_prob: float | Tensor,
    uniform_prob: float | Tensor,
    *,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor]:
    """Absorbing + uniform channels (docs/strategies.md §2.2). Returns (noisy_ids, noise_mask), both [B, L].

    One u ~ U[0,1) per position: u < mask_prob -> [MASK]; mask_prob <= u < mask_prob + uniform_prob ->
    a token uniform over the vocabulary minus {[MASK], the clean token}. `mask_prob` / `uniform_prob`
    are floats or per-row tensors ([B] or [B, 1]). A clean token that already is [MASK] is never
    corrupted by either channel, so `noise_mask == (noisy_ids != input_ids)` exactly (we do not
    reproduce the reference's flagging of absorbed [MASK] tokens, docs/strategies.md §7 caveat 2).
    """
    if vocab_size < 3:
        raise ValueError(
            f"corrupt_mix needs vocab_size >= 3 (mask, clean and one other token), got {vocab_size}"
        )
    B, L = input_ids.shape
    dev = input_ids.device
    pm = _per_row(mask_prob, B, dev)  # [B, 1]
    pu = _per_row(uniform_prob, B, dev)  # [B, 1]
    if bool((pm < 0).any()) or bool((pu < 0).any()):
        raise ValueError("corrupt_mix: mask_prob and uniform_prob must be >= 0")
    if bool((pm + pu > 1.0 + 1e-5).any()):
        raise ValueError("corrupt_mix: mask_prob + uniform_prob must be <= 1")

    corruptible = (loss_mask != 0) & (input_ids != mask_token_id)  # [B, L]
    u = torch.rand(B, L, device=dev, generator=generator)  # [B, L]
    absorbed = (u < pm) & corruptible
    transitioned = (u >= pm) & (u < pm + pu) & corruptible

    # Uniform over V-2 values, shifted past min(x, M) then max(x, M): never M, never x.
    draw = torch.randint(0, vocab_size - 2, (B, L), device=dev, generator=generator, dtype=input_ids.dtype)
    mask_col = torch.full_like(input_ids, mask_token_id)
    lo, hi = torch.minimum(input_ids, mask_col), torch.maximum(input_ids, mask_col)
    draw = draw + (draw >= lo).to(draw.dtype)
    draw = draw + (draw >= hi).to(draw.dtype)
    draw = draw.clamp(max=vocab_size - 1)

    noisy = torch.where(absorbed, mask_col, torch.where(transitioned, draw, input_ids))
    return noisy, absorbed | transitioned


def corrupt_scdd(
    input_ids: Tensor,
    loss_mask: Tensor,
    mask_token_id: int,
    vocab_size: int,
    *,
    num_timesteps: int,
    uniform_ratio: float,
    schedule_shape: float = 1.0,
    schedule_peak: float = 0.5,
    eps: float = 1e-3,
    generator: torch.Generator | None = None,
) -> Corruption:
    """SCDD corruption (docs/strategies.md §2.2): t on the grid {1/T..(T-1)/T}, masses from the schedule at t.

    p_mask carries the TIME t (broadcast over the row), which the SCDD loss reads back.
    """
    B, L = input_ids.shape
    T = int(num_timesteps)
    # The documented draw: float32 `rand(B)`, and the grid index in float32 as the reference computes it.
    # A float64 draw would take two 32-bit words per sample from the generator and shift every later
    # draw (the per-position u and the replacement ids), so seeded runs could not match the recipe.
    u = torch.rand(B, device=input_ids.device, generator=generator)  # [B] float32
    u = (1.0 - eps) * u + eps
    step = torch.clamp(torch.floor(u * T) + 1.0, max=T - 1.0)  # [B], integer-valued: t = step / T
    # The time itself and the schedule in float64 (as the loss evaluates them): the grid point is exact
    # and the channel masses do not carry float32 rounding of t^a (1-t)^b.
    t = step.to(torch.float64) / T  # [B]
    sched = scdd_schedule(t, uniform_ratio, schedule_shape, schedule_peak)
    K = vocab_size - 1
    # A uniform draw over the K non-mask states that lands on x is a no-op; corrupt_mix excludes x.
    uniform_prob = sched.uniform * (K - 1) / K
    noisy, noise = corrupt_mix(
        input_ids, loss_mask, mask_token_id, vocab_size, sched.absorbed, uniform_prob, generator=generator
    )
    return noisy, noise, t[:, None].expand(B, L).to(torch.float32).contiguous()


def corrupt_uniform_random(
    input_ids: Tensor,
    loss_mask: Tensor,
    vocab_size: int,
    *,
    eps: float = 1e-3,
    block_size: int | None = None,
    generator: torch.Generator | None = None,
) -> Corruption:
    """DiffusionGemma corruption (docs/strategies.md §2.4): random replacement tokens, no [MASK], p_mask ≡ 1.

    t = eps + (1-eps) U per row (`block_size=None`) or per block of the row; a supervised position is
    replaced with prob. t by a token uniform over the FULL vocabulary (it may equal the original).
    """
    B, L = input_ids.shape
    dev = input_ids.device
    if block_size is None:
        t = eps + (1.0 - eps) * torch.rand(B, 1, device=dev, generator=generator)  # [B, 1]
    else:
        nb = math.ceil(L / block_size)
        t = eps + (1.0 - eps) * torch.rand(B, nb, device=dev, generator=generator)  # [B, nb]
        t = t.repeat_interleave(block_size, dim=1)[:, :L]  # [B, L]
    noise = (torch.rand(B, L, device=dev, generator=generator) < t) & (loss_mask != 0)  # [B, L]
    repl = torch.randint(0, vocab_size, (B, L), device=dev, generator=generator, dtype=input_ids.dtype)
    noisy = torch.where(noise, repl, input_ids)
    return noisy, noise, torch.ones(B, L, device=dev, dtype=torch.float32)


def corrupt_all_masked(
    input_ids: Tensor,
    loss_mask: Tensor,
    mask_token_id: int,
    *,
    generator: torch.Generator | None = None,
) -> Corruption:
    """I-DLM (docs/strategies.md §2.6): every supervised position becomes [MASK]; the prompt stays clean; p ≡ 1.
    Deterministic: `generator` is accepted for a uniform kernel signature and ignored."""
    noise = loss_mask != 0  # [B, L]
    noisy = torch.where(noise, torch.full_like(input_ids, mask_token_id), input_ids)
    return noisy, noise, torch.ones(input_ids.shape, device=input_ids.device, dtype=torch.float32)


def corrupt_one_block(
    input_ids: Tensor,
    loss_mask: Tensor,
    mask_token_id: int,
    *,
    block_size: int,
    eps: float = 1e-3,
    suffix: bool = False,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Block-causal A2D (docs/strategies.md §2.8): per row, the prompt is everything before the first
    supervised position S; blocks of `block_size` start at S. Draw a block j uniformly among those up to
    the last supervised position (the blocks before j stay clean, the ones after are never read), then
    mask in it:

    * random (`suffix` False): t ~ U[0,1), p = (1-eps) t + eps, each supervised position where u < p;
    * suffix: k ~ U{0..n-1} over the block's n supervised positions, the k-th and every later one
      (a clean prefix of the block, the rest masked: the views a left-to-right fill meets); p = 1.

    Returns (noisy ids, noise mask, p_mask, the block's positions [B, L] bool, S [B] long); a row with
    nothing supervised has S = L, no block and no noise (it draws nothing)."""
    B, L = input_ids.shape
    dev = input_ids.device
    pos = torch.arange(L, device=dev)
    noisy, noise = input_ids.clone(), torch.zeros(B, L, dtype=torch.bool, device=dev)
    p_mask = torch.full((B, L), 1.0 if suffix else eps, dtype=torch.float32, device=dev)
    block, prefix = torch.zeros_like(noise), torch.full((B,), L, dtype=torch.long, device=dev)
    for b in range(B):
        sup = (loss_mask[b] != 0).nonzero().squeeze(1)  # [n]
        if not sup.numel():
            continue
        start, last = int(sup[0]), int(sup[-1])
        num_blocks = (last - start) // block_size + 1
        j = int(torch.randint(num_blocks, (1,), device=dev, generator=generator))
        lo = start + j * block_size
        block[b] = (pos >= lo) & (pos < lo + block_size)
        in_block = block[b] & (loss_mask[b] != 0)  # [L]
        if suffix:
            cols = in_block.nonzero().squeeze(1)  # [n]
            k = int(torch.randint(cols.numel(), (1,), device=dev, generator=generator))
            noise[b] = in_block & (pos >= cols[k])
        else:
            t = torch.rand((), device=dev, generator=generator)
            p = (1.0 - eps) * t + eps
            u = torch.rand(L, device=dev, generator=generator)  # [L]
            noise[b] = in_block & (u < p)
            p_mask[b] = p.float()
        noisy[b] = torch.where(noise[b], torch.full_like(input_ids[b], mask_token_id), input_ids[b])
        prefix[b] = start
    return noisy, noise, p_mask, block, prefix


def _per_row(value: float | Tensor, batch: int, device: torch.device) -> Tensor:
    """A float or a per-row tensor ([B] / [B, 1]) as a float64 [B, 1] column."""
    if isinstance(value, Tensor):
        return value.to(device=device, dtype=torch.float64).reshape(-1, 1).expand(batch, 1)
    return torch.full((batch, 1), float(value), device=device, dtype=torch.float64)


def draw_draft_anchors(
    input_ids: Tensor,
    loss_mask: Tensor,
    *,
    anchors: int,
    generator: torch.Generator | None = None,
) -> tuple[Tensor]:
    """Drafting adapter (`dllm.mode: uno`, docs/strategies.md §2.9): per row, up to `anchors` distinct
    positions k drawn uniformly among those where x[k] and x[k+1] are both supervised (slot 0 stands at k
    and guesses x[k+1]; x[k] is the causal LM's own next token). Returns ([B, anchors] long, ascending,
    -1 where a row has fewer candidates)."""
    B, L = input_ids.shape
    out = torch.full((B, anchors), -1, dtype=torch.long, device=input_ids.device)
    sup = loss_mask != 0  # [B, L]
    ok = sup[:, :-1] & sup[:, 1:]  # [B, L-1]: k with x[k], x[k+1] supervised
    for b in range(B):
        cand = ok[b].nonzero().squeeze(1)  # [n]
        pick = torch.randperm(cand.numel(), device=input_ids.device, generator=generator)[:anchors]
        chosen = cand[pick].sort().values
        out[b, : chosen.numel()] = chosen
    return (out,)
