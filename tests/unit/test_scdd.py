"""SCDD (docs/strategies.md §2.2): schedule properties, the NELBO against a direct per-position reference of its
posterior-expectation form, the r=0 reduction to MDLM, chunking, and the strategy end to end."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from dllmflow.diffusion.losses import scdd_loss_sum
from dllmflow.diffusion.schedules import scdd_schedule
from dllmflow.diffusion.strategies import build_strategy
from dllmflow.diffusion.strategies.scdd import SCDDStrategy
from dllmflow.errors import UserError
from dllmflow.settings import load_settings

ROOT = Path(__file__).resolve().parents[2]
V, M = 11, 4  # vocabulary and mask id (inside the range, so the mask column sits mid-vocabulary)


# ---- a direct reference, written from the definitions -----------------------------------------------


def ref_schedule(t: float, r: float, g: float, tau: float) -> dict[str, float]:
    a, b = g * tau, g * (1 - tau)
    c = (r / (1 - r)) / (tau**a * (1 - tau) ** b) * t**a * (1 - t) ** b
    clean, uniform, absorbed = (1 - t) / (1 + c), c / (1 + c), t / (1 + c)
    gamma = clean + uniform
    return dict(clean=clean, uniform=uniform, absorbed=absorbed, gamma=gamma, rho=clean / max(gamma, 1e-30))


def ref_scdd_loss(logits, x, z, sup, t, mask_id, T, r, g=1.0, tau=0.5) -> float:
    """Σ over supervised positions of T·ℓ, with ℓ written as expectations under q(z_s | z_t, x)."""
    B, L, Vv = logits.shape
    K = Vv - 1
    states = [v for v in range(Vv) if v != mask_id]
    total = 0.0
    for b in range(B):
        tt = float(t[b])
        ss = max(tt - 1.0 / T, 0.0)
        at_t, at_s = ref_schedule(tt, r, g, tau), ref_schedule(ss, r, g, tau)
        rho_t, rho_s = at_t["rho"], at_s["rho"]
        alpha = rho_t / max(rho_s, 1e-30)
        beta = (rho_s - rho_t) / max(rho_s, 1e-30)
        u = (at_s["gamma"] - at_t["gamma"]) / max(1 - at_t["gamma"], 1e-30)
        base_s, base_t = (1 - rho_s) / K, (1 - rho_t) / K
        for i in range(L):
            if not sup[b, i]:
                continue
            row = logits[b, i].double().clone()
            row[mask_id] = -math.inf
            p = torch.softmax(row, -1).tolist()
            A = {v: math.log(max(base_s + rho_s * p[v], 1e-30)) for v in states}
            xi, zi = int(x[b, i]), int(z[b, i])
            if zi == mask_id:  # -u E_{v ~ base_s + rho_s δ_x}[A(v)]
                ell = -u * sum((base_s + rho_s * (v == xi)) * A[v] for v in states)
            else:  # -E_{v ~ posterior}[A(v) - D], posterior ∝ (β/K + α δ_vz)(base_s + ρ_s δ_vx)
                D = math.log(max(base_t + rho_t * p[zi], 1e-30))
                w = {v: (beta / K + alpha * (v == zi)) * (base_s + rho_s * (v == xi)) for v in states}
                Z = sum(w.values())
                ell = -sum(w[v] / Z * (A[v] - D) for v in states)
            total += T * ell
    return total


def _problem(seed=0, B=3, L=7, T=20, mask_frac=0.4):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, L, V, generator=g) * 2
    clean_states = torch.tensor([v for v in range(V) if v != M])
    x = clean_states[torch.randint(0, V - 1, (B, L), generator=g)]
    z = x.clone()
    roll = torch.rand(B, L, generator=g)
    z[roll < mask_frac] = M
    swap = (roll >= mask_frac) & (roll < mask_frac + 0.3)
    z[swap] = clean_states[torch.randint(0, V - 1, (B, L), generator=g)][swap]  # visible, some != x
    sup = torch.ones(B, L)
    sup[:, :2] = 0  # a prompt
    t = (torch.randint(1, T, (B,), generator=g).float()) / T
    return logits, x, z, sup, t


def _loss(logits, x, z, sup, t, T=20, r=0.2, chunk_size=None, **kw):
    return scdd_loss_sum(logits, x, z, sup, t, M, T, r, chunk_size=chunk_size, **kw)


# ---- schedule ---------------------------------------------------------------------------------------


def test_schedule_boundaries():
    s = scdd_schedule(torch.tensor([0.0, 1.0], dtype=torch.float64), 0.2)
    assert s.clean[0] == 1 and s.absorbed[0] == 0
    assert s.absorbed[1] == 1 and s.gamma[1] == 0


def test_schedule_masses_form_a_distribution_and_match_reference():
    t = torch.linspace(0, 1, 101, dtype=torch.float64)
    s = scdd_schedule(t, 0.25, 2.0, 0.3)
    total = s.clean + s.uniform + s.absorbed
    assert torch.allclose(total, torch.ones_like(total), atol=1e-12)
    assert (s.clean >= 0).all() and (s.uniform >= 0).all() and (s.absorbed >= 0).all()
    for i in (3, 50, 77):
        ref = ref_schedule(float(t[i]), 0.25, 2.0, 0.3)
        for key in ("clean", "uniform", "absorbed", "gamma", "rho"):
            assert math.isclose(float(getattr(s, key)[i]), ref[key], rel_tol=1e-9, abs_tol=1e-12)


@pytest.mark.parametrize("tau,r", [(0.5, 0.1), (0.3, 0.25)])
def test_uniform_mass_peaks_at_tau_with_the_configured_ratio(tau, r):
    t = torch.linspace(0.001, 0.999, 999, dtype=torch.float64)
    s = scdd_schedule(t, r, 2.0, tau)
    assert math.isclose(float(scdd_schedule(torch.tensor(tau, dtype=torch.float64), r, 2.0, tau).uniform), r)
    assert abs(float(t[s.uniform.argmax()]) - tau) <= 0.0011


def test_rho_and_gamma_non_increasing():
    # ρ = 1 / (1 + S t^a (1-t)^(b-1)) falls monotonically when b = g(1-τ) <= 1 (the defaults, and every
    # released setting); γ = 1 - t/(1+c) falls for any shape.
    t = torch.linspace(0, 1, 2001, dtype=torch.float64)
    for r, g, tau in [(0.1, 1.0, 0.5), (0.2, 1.0, 0.5), (0.5, 2.0, 0.6), (0.9, 0.5, 0.8)]:
        s = scdd_schedule(t, r, g, tau)
        assert (s.gamma.diff() <= 1e-12).all() and (s.rho.diff() <= 1e-12).all()
    s = scdd_schedule(t, 0.5, 2.0, 0.3)
    assert (s.gamma.diff() <= 1e-12).all()


def test_zero_ratio_is_plain_masking():
    t = torch.linspace(0, 1, 11, dtype=torch.float64)
    s = scdd_schedule(t, 0.0)
    assert torch.equal(s.uniform, torch.zeros_like(t))
    assert torch.allclose(s.absorbed, t) and torch.allclose(s.clean, 1 - t)
    assert torch.allclose(s.rho[:-1], torch.ones(10, dtype=torch.float64))


def test_schedule_rejects_out_of_range():
    with pytest.raises(ValueError, match="uniform_ratio"):
        scdd_schedule(0.5, 1.0)
    with pytest.raises(ValueError, match="schedule_peak"):
        scdd_schedule(0.5, 0.1, 1.0, 0.0)


# ---- loss vs reference ------------------------------------------------------------------------------


@pytest.mark.parametrize("r,g,tau", [(0.2, 1.0, 0.5), (0.5, 2.0, 0.3)])
def test_loss_matches_reference(r, g, tau):
    logits, x, z, sup, t = _problem(seed=1)
    got = _loss(logits, x, z, sup, t, r=r, schedule_shape=g, schedule_peak=tau)
    want = ref_scdd_loss(logits, x, z, sup, t, M, 20, r, g, tau)
    assert math.isclose(got.item(), want, rel_tol=1e-4)


def test_per_position_time_tensor_equals_per_row_time():
    logits, x, z, sup, t = _problem(seed=2)
    a = _loss(logits, x, z, sup, t)
    b = _loss(logits, x, z, sup, t[:, None].expand(-1, x.shape[1]))
    assert torch.equal(a, b)


def test_reduces_to_mdlm_when_uniform_channel_off():
    logits, x, z, sup, t = _problem(seed=3)
    z = torch.where(z == M, z, x)  # r = 0: no uniform swaps
    got = _loss(logits, x, z, sup, t, r=0.0)
    masked = logits.double().clone()
    masked[..., M] = -math.inf
    logp = torch.log_softmax(masked, -1)
    want = 0.0
    for b in range(x.shape[0]):
        for i in range(x.shape[1]):
            if sup[b, i] and z[b, i] == M:
                want += -logp[b, i, x[b, i]].item() / t[b].item()
    assert math.isclose(got.item(), want, rel_tol=1e-5)


def test_mask_logit_shift_invariance_and_caller_logits_untouched():
    logits, x, z, sup, t = _problem(seed=4)
    before = logits.clone()
    base = _loss(logits, x, z, sup, t, chunk_size=5)
    _loss(logits, x, z, sup, t, chunk_size=None)
    assert torch.equal(logits, before)
    shifted = logits.clone()
    shifted[..., M] += 50.0
    assert torch.allclose(_loss(shifted, x, z, sup, t, chunk_size=5), base, rtol=1e-6)


def test_unsupervised_positions_are_excluded():
    logits, x, z, sup, t = _problem(seed=5)
    logits.requires_grad_(True)
    loss = _loss(logits, x, z, sup, t)
    loss.backward()
    assert (logits.grad[:, :2] == 0).all()
    assert (logits.grad[:, 2:].abs().sum(-1) > 0).all()  # every supervised position gets gradient
    other = logits.detach().clone()
    other[:, :2] = torch.randn_like(other[:, :2]) * 10
    assert torch.allclose(_loss(other, x, z, sup, t), loss.detach())


def test_visible_wrong_token_drives_the_correction_term():
    # One visible position that holds a wrong token z != x: a model confident in x costs less
    # than one confident in the (wrong) visible token.
    x, z = torch.tensor([[1]]), torch.tensor([[2]])
    sup, t = torch.ones(1, 1), torch.tensor([0.5])
    on_x, on_z = torch.zeros(1, 1, V), torch.zeros(1, 1, V)
    on_x[0, 0, 1], on_z[0, 0, 2] = 8.0, 8.0
    assert _loss(on_x, x, z, sup, t) < _loss(on_z, x, z, sup, t)
    losses = []
    for peak in (0.0, 2.0, 10.0):
        lg = torch.zeros(1, 1, V)
        lg[0, 0, 1] = peak
        losses.append(_loss(lg, x, z, sup, t).item())
    assert losses[0] > losses[1] > losses[2]


@pytest.mark.parametrize("tval", [0.001, 0.5, 0.9999])
def test_value_and_gradient_match_the_reference_across_the_schedule(tval):
    """At the ends of the schedule too: the value equals the reference, and the gradient equals central
    differences of the reference (float64) on a few entries, masked, visible and unsupervised."""
    logits, x, z, sup, _ = _problem(seed=6)
    t = torch.full((3,), tval)
    logits.requires_grad_(True)
    loss = scdd_loss_sum(logits, x, z, sup, t, M, 1000, 0.1, chunk_size=4)
    loss.backward()
    base = logits.detach().double()
    assert math.isclose(loss.item(), ref_scdd_loss(base, x, z, sup, t, M, 1000, 0.1), rel_tol=1e-4)
    h = 1e-4
    for b, i, v in [(0, 3, 1), (1, 4, int(x[1, 4])), (2, 6, 7), (0, 1, 2)]:
        up, down = base.clone(), base.clone()
        up[b, i, v] += h
        down[b, i, v] -= h
        fd = ref_scdd_loss(up, x, z, sup, t, M, 1000, 0.1) - ref_scdd_loss(down, x, z, sup, t, M, 1000, 0.1)
        fd /= 2 * h
        assert math.isclose(logits.grad[b, i, v].item(), fd, rel_tol=1e-3, abs_tol=1e-3), (b, i, v, fd)


# ---- chunking ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk_size", [1, 3, 7, 100])  # splits / aligns with / exceeds a row of L=7
def test_chunked_equals_unchunked_value_and_gradient(chunk_size):
    logits, x, z, sup, t = _problem(seed=7)
    a = logits.clone().requires_grad_(True)
    b = logits.clone().requires_grad_(True)
    la = _loss(a, x, z, sup, t, chunk_size=None)
    lb = _loss(b, x, z, sup, t, chunk_size=chunk_size)
    la.backward()
    lb.backward()
    torch.testing.assert_close(lb, la, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(b.grad, a.grad, rtol=1e-6, atol=1e-7)


def test_chunked_works_with_bf16_logits():
    logits, x, z, sup, t = _problem(seed=8)
    a = logits.bfloat16().requires_grad_(True)
    loss = _loss(a, x, z, sup, t, chunk_size=4)
    loss.backward()
    assert a.grad.dtype == torch.bfloat16 and torch.isfinite(a.grad.float()).all()
    assert math.isclose(loss.item(), _loss(a.detach().float(), x, z, sup, t).item(), rel_tol=1e-5)


def test_grad_accumulation_sums_match_the_full_batch():
    logits, x, z, sup, t = _problem(seed=9)
    full = _loss(logits, x, z, sup, t)
    parts = _loss(logits[:1], x[:1], z[:1], sup[:1], t[:1]) + _loss(logits[1:], x[1:], z[1:], sup[1:], t[1:])
    torch.testing.assert_close(parts, full)


def test_rejects_bad_grid_and_chunk_size():
    logits, x, z, sup, t = _problem(seed=10)
    for T in (0, 1):
        with pytest.raises(ValueError, match="num_timesteps"):
            scdd_loss_sum(logits, x, z, sup, t, M, T, 0.1)
    with pytest.raises(ValueError, match="chunk_size"):
        scdd_loss_sum(logits, x, z, sup, t, M, 20, 0.1, chunk_size=0)


# ---- strategy ---------------------------------------------------------------------------------------


def _settings(**dllm):
    cfg = {"mode": "scdd", "vocab_size": 64, "num_timesteps": 100, "uniform_ratio": 0.2, "chunk_size": 16}
    cfg.update(dllm)
    return load_settings(dllm=cfg)


def _tiny_qwen3(vocab: int = 64) -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, head_dim=8, use_cache=False,
    )  # fmt: skip
    cfg._attn_implementation = "sdpa"
    return Qwen3ForCausalLM(cfg)


def _batch(B=4, L=24, vocab=64, mask_id=63):
    g = torch.Generator().manual_seed(11)
    x = torch.randint(0, mask_id, (B, L), generator=g)
    loss_mask = torch.zeros(B, L)
    loss_mask[:, 6:] = 1
    attn = torch.ones(B, L, dtype=torch.long)
    attn[0, 20:] = 0
    return {"input_ids": x, "loss_mask": loss_mask, "attention_mask": attn}


def test_strategy_end_to_end_finite_grads_and_contract():
    strategy = build_strategy(_settings())
    assert isinstance(strategy, SCDDStrategy)
    model = _tiny_qwen3()
    strategy.setup(model, SimpleNamespace(mask_token_id=63), torch.device("cpu"))
    assert strategy.mask_token_id == 63
    batch = _batch()
    state = torch.get_rng_state()
    side = strategy.corrupt(batch, seeds=[1, 2, 3, 4])
    assert torch.equal(state, torch.get_rng_state())  # corruption never touches the global RNG
    again = strategy.corrupt(batch, seeds=[1, 2, 3, 4])
    assert all(torch.equal(side[k], again[k]) for k in side)
    t = side["p_mask"]
    assert torch.allclose(t * 100, (t * 100).round(), atol=1e-3)  # p_mask carries t on the grid
    batch.update(side)
    assert strategy.token_counts(batch)["diffusion"].item() == 4 * 18
    out = strategy.loss(model, batch)
    assert set(out.sums) == {"diffusion"}
    out.sums["diffusion"].backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)

    # The loss is the SCDD NELBO of the model's logits on the corrupted ids (corruption and loss
    # agree on p_mask = t).
    from dllmflow.models.attention import forward_bidirectional

    with torch.no_grad():  # row 0's padding [20:] is supervised: attended like the content
        logits = forward_bidirectional(
            model, side["noisy_input_ids"], torch.ones_like(batch["attention_mask"])
        )
    want = ref_scdd_loss(
        logits, batch["input_ids"], side["noisy_input_ids"], batch["loss_mask"], t[:, 0], 63, 100, 0.2
    )
    assert math.isclose(out.sums["diffusion"].item(), want, rel_tol=1e-5)


def test_strategy_time_is_a_float32_rand_from_each_samples_generator():
    """docs/strategies.md §2.2/§1.3: sample b's t comes from torch.Generator().manual_seed(seed_b).rand(1) (float32),
    u <- (1-eps) u + eps, t = min((floor(u T) + 1)/T, 1 - 1/T); the strategy's p_mask carries it."""
    strategy = build_strategy(_settings(eps=1e-3))
    strategy.setup(_tiny_qwen3(), SimpleNamespace(mask_token_id=63), torch.device("cpu"))
    seeds = [3, 2**43 + 2654435761, 17, 2**62 + 1]
    t = strategy.corrupt(_batch(), seeds=seeds)["p_mask"]  # [B, L]
    T = 100
    for row, seed in enumerate(seeds):
        u = torch.rand(1, generator=torch.Generator().manual_seed(seed))
        u = (1 - 1e-3) * u + 1e-3
        want = min(math.floor(float(u) * T) + 1, T - 1) / T
        assert float(t[row, 0]) == pytest.approx(want, abs=1e-7)
        assert torch.equal(t[row], t[row, :1].expand_as(t[row]))


def test_setup_rejects_vocab_mismatch_and_out_of_vocab_mask():
    strategy = build_strategy(_settings(vocab_size=70))
    with pytest.raises(UserError, match=r"dllm.vocab_size=70 .* 64"):
        strategy.setup(_tiny_qwen3(64), SimpleNamespace(mask_token_id=63), torch.device("cpu"))
    strategy = build_strategy(_settings(mask_token_id=64))
    with pytest.raises(UserError, match="mask_token_id"):
        strategy.setup(_tiny_qwen3(64), SimpleNamespace(mask_token_id=None), torch.device("cpu"))


def test_corrupt_without_mask_id_is_a_clear_error():
    strategy = build_strategy(_settings())
    with pytest.raises(UserError, match="mask_token_id"):
        strategy.corrupt(_batch(), seeds=[1, 2, 3, 4])


@pytest.mark.parametrize("name", ["tiny_scdd.yaml", "llada_scdd.yaml"])
def test_shipped_recipes_build_the_strategy(name):
    settings = load_settings(ROOT / "params" / name)
    strategy = build_strategy(settings)
    assert isinstance(strategy, SCDDStrategy)
    assert settings.dllm.vocab_size > 0 and settings.dllm.num_timesteps >= 2
