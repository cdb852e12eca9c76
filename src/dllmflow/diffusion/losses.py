"""Shared loss math as plain functions. Each returns a SUM over the micro-batch; the trainer divides by
the global token count (see `strategies/base.py`), so nothing here normalises.

    per_token_ce(logits, targets)                        -> [...] fp32 CE, no reduction
    shifted_supervision(loss_mask, attention_mask)       -> [B, L-1]: logit i scores x[i+1]
    loss_columns(selected)                               -> [n] positions any row selects (for the LM head)
    mdlm_loss_sum(logits, targets, noise_mask, loss_mask, p_mask)
        = Σ_i CE_i · 1[noise_i ∧ sup_i] / max(p_i, 1e-8)                             (docs/strategies.md §2.1)
    scdd_loss_sum(logits, targets, noisy_ids, loss_mask, t, mask_token_id, num_timesteps, ...)
        = Σ_i T · (ℓ_abs if z_i = [MASK] else ℓ_vis) · sup_i                          (docs/strategies.md §2.2)

SCDD needs p_θ over the whole vocabulary (no fused CE), so its [positions, V] fp32 work runs in
checkpointed chunks of `chunk_size` positions: forward keeps only four [chunk] vectors per chunk and
backward recomputes the chunk's intermediates instead of storing them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from dllmflow.diffusion.schedules import TINY, scdd_schedule


def _materialize(logits: Tensor) -> Tensor:
    """A vocab-sharded DTensor (tensor parallel LM head) becomes a plain tensor."""
    return logits.full_tensor() if hasattr(logits, "full_tensor") else logits


def per_token_ce(logits: Tensor, targets: Tensor) -> Tensor:
    """Cross-entropy per position in fp32 (bf16 logits are upcast first): [..., V], [...] -> [...]."""
    logits = _materialize(logits)
    V = logits.shape[-1]
    ce = F.cross_entropy(logits.reshape(-1, V).float(), targets.reshape(-1), reduction="none")
    return ce.view(targets.shape)


def shifted_supervision(loss_mask: Tensor, attention_mask: Tensor | None) -> Tensor:
    """Which next-token targets a causal read scores (logit i predicts x[i+1]): [B, L-1] bool,
    sup_i = m_sup[i+1] and valid[i+1] for i in [0, L-1)."""
    sup = loss_mask[:, 1:] != 0
    if attention_mask is not None:
        sup = sup & (attention_mask[:, 1:] != 0)
    return sup


def loss_columns(selected: Tensor) -> Tensor:
    """Positions [n] where any row of `selected` [B, L] is set, ascending. Never empty: a micro-batch
    with nothing selected keeps its last column (it contributes zero) so the graph still reaches
    every parameter."""
    cols = selected.any(0).nonzero().squeeze(1)  # [n]
    return cols if cols.numel() else torch.tensor([selected.shape[1] - 1], device=selected.device)


def mdlm_loss_sum(
    logits: Tensor, targets: Tensor, noise_mask: Tensor, loss_mask: Tensor, p_mask: Tensor
) -> Tensor:
    """Σ CE · 1[noise ∧ supervised] / max(p, 1e-8) over the batch (a 0-d fp32 tensor).

    Only the selected rows of the logits go through the CE, so clean positions cost nothing."""
    logits = _materialize(logits)
    sel = noise_mask.bool() & (loss_mask != 0)  # [B, L]
    ce = per_token_ce(logits[sel], targets[sel])  # [n]
    return (ce / p_mask[sel].float().clamp_min(1e-8)).sum()


# ---- SCDD ---------------------------------------------------------------------------------------


def _scdd_vocab_terms(
    logits: Tensor, x: Tensor, z: Tensor, base_s: Tensor, rho_s: Tensor, mask_token_id: int
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The only [n, V] work: A(v) = log(base_s + ρ_s p_θ(v)) with p_θ = softmax over v ≠ [MASK].

    Returns Σ_{v≠M} A(v), A(x), A(z) and log p_θ(z), each [n]."""
    # a copy: the caller's logits stay untouched; at least fp32 (a float64 reference run stays float64)
    lg = logits.to(torch.promote_types(logits.dtype, torch.float32), copy=True)
    lg[:, mask_token_id] = float("-inf")
    logp = torch.log_softmax(lg, dim=-1)  # [n, V]; logp[:, M] = -inf
    A = torch.log(torch.addcmul(base_s[:, None], rho_s[:, None], logp.exp()).clamp_min(TINY))  # [n, V]
    sum_a = A.sum(-1) - A[:, mask_token_id]  # drop A(M) = log base_s
    a_x = A.gather(1, x[:, None]).squeeze(1)
    a_z = A.gather(1, z[:, None]).squeeze(1)
    logp_z = logp.gather(1, z[:, None]).squeeze(1)
    return sum_a, a_x, a_z, logp_z


class _ChunkedVocabTerms(torch.autograd.Function):
    """`_scdd_vocab_terms` over `chunk_size` positions at a time, checkpointed by hand.

    Forward keeps only the four [N] outputs (and the caller's logits, no copy). Backward recomputes
    one chunk at a time and writes its logits gradient straight into one preallocated [N, V] buffer,
    so the peak is that buffer plus one chunk's fp32 intermediates. (`torch.utils.checkpoint` over
    split chunks gives the same numbers but also holds every chunk's gradient until the split's
    backward concatenates them: one more [N, V].)
    """

    @staticmethod
    def forward(ctx, flat, x, z, base_s, rho_s, mask_token_id, chunk_size):
        with torch.no_grad():
            parts = [
                _scdd_vocab_terms(flat[i : i + chunk_size], x[i : i + chunk_size], z[i : i + chunk_size],
                                  base_s[i : i + chunk_size], rho_s[i : i + chunk_size], mask_token_id)
                for i in range(0, flat.shape[0], chunk_size)
            ]  # fmt: skip
        ctx.save_for_backward(flat, x, z, base_s, rho_s)
        ctx.mask_token_id, ctx.chunk_size = mask_token_id, chunk_size
        return tuple(torch.cat(p) for p in zip(*parts))

    @staticmethod
    def backward(ctx, *grads):
        flat, x, z, base_s, rho_s = ctx.saved_tensors
        C = ctx.chunk_size
        grad = torch.empty_like(flat)  # [N, V]
        for i in range(0, flat.shape[0], C):
            with torch.enable_grad():
                chunk = flat[i : i + C].detach().requires_grad_(True)
                outs = _scdd_vocab_terms(chunk, x[i : i + C], z[i : i + C], base_s[i : i + C], rho_s[i : i + C],
                                         ctx.mask_token_id)  # fmt: skip
                (g,) = torch.autograd.grad(outs, chunk, grad_outputs=[gr[i : i + C] for gr in grads])
            grad[i : i + C] = g
        return grad, None, None, None, None, None, None


def scdd_loss_sum(
    logits: Tensor,
    targets: Tensor,
    noisy_ids: Tensor,
    loss_mask: Tensor,
    t: Tensor,
    mask_token_id: int,
    num_timesteps: int,
    uniform_ratio: float,
    schedule_shape: float = 1.0,
    schedule_peak: float = 0.5,
    chunk_size: int | None = 1024,
) -> Tensor:
    """Discrete-time SCDD NELBO summed over supervised positions (docs/strategies.md §2.2).

    logits [B, L, V], targets (clean x) / noisy_ids (z) / loss_mask [B, L], t [B] or [B, L] (the
    corruption's p_mask, which carries the time). Absorbed positions (z = M) score
    -u E_{q(z_s|z_t=M,x)} A; every supervised visible position (corrupted or not) scores the
    correction term -E_{q(z_s|z_t,x)}[A(v) - D]. `chunk_size=None` = one shot, no checkpointing;
    any chunk size gives the same value and gradients.
    """
    T = int(num_timesteps)
    if T < 2:
        raise ValueError(f"dllm.num_timesteps must be >= 2 for the SCDD loss, got {num_timesteps}")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"dllm.chunk_size must be a positive int or null, got {chunk_size}")
    logits = _materialize(logits)
    B, L, V = logits.shape
    K = V - 1  # non-mask states
    M = int(mask_token_id)

    # 1) schedule at t and s = t - 1/T, per position (fp64 for the ratios, fp32 for the rest)
    t = t.to(torch.float64)
    t = (t[:, None] if t.dim() == 1 else t).expand(B, L).reshape(-1)  # [N]
    s = (t - 1.0 / T).clamp_min(0.0)
    at_t = scdd_schedule(t, uniform_ratio, schedule_shape, schedule_peak)
    at_s = scdd_schedule(s, uniform_ratio, schedule_shape, schedule_peak)
    rho_t, rho_s = at_t.rho, at_s.rho
    alpha = rho_t / rho_s.clamp_min(TINY)
    beta = (rho_s - rho_t) / rho_s.clamp_min(TINY)
    u = (at_s.gamma - at_t.gamma) / (1.0 - at_t.gamma).clamp_min(TINY)
    base_s, base_t = (1.0 - rho_s) / K, (1.0 - rho_t) / K
    f32 = dict(dtype=torch.float32, device=logits.device)
    alpha, beta, u, base_s, base_t, rho_s, rho_t = (
        v.to(**f32) for v in (alpha, beta, u, base_s, base_t, rho_s, rho_t)
    )

    # 2) the vocabulary reduction: one shot, or chunked and recomputed in backward
    flat = logits.reshape(B * L, V)  # a view, no copy
    x, z = targets.reshape(-1), noisy_ids.reshape(-1)  # [N]
    if chunk_size is None:
        sum_a, a_x, a_z, logp_z = _scdd_vocab_terms(flat, x, z, base_s, rho_s, M)
    else:
        sum_a, a_x, a_z, logp_z = _ChunkedVocabTerms.apply(flat, x, z, base_s, rho_s, M, int(chunk_size))

    # 3) per-position NELBO terms
    D = torch.log((base_t + rho_t * logp_z.exp()).clamp_min(TINY))  # log q-side normaliser at z
    r = (z == x).to(torch.float32)
    loss_abs = -u * (base_s * sum_a + rho_s * a_x)
    num = (
        base_s * (beta / K) * (sum_a - K * D)
        + rho_s * (beta / K) * (a_x - D)
        + base_s * alpha * (a_z - D)
        + rho_s * alpha * r * (a_x - D)
    )
    loss_vis = -num / (base_t + rho_t * r).clamp_min(TINY)
    per_token = T * torch.where(z == M, loss_abs, loss_vis)  # [N]
    sup = loss_mask.reshape(-1) != 0
    return torch.where(sup, per_token, torch.zeros_like(per_token)).sum()
