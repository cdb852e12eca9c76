"""MDLM (docs/strategies.md §2.1): the loss against a direct reference formula, and the strategy end to end."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen3Config, Qwen3ForCausalLM

from dllmflow.diffusion.losses import mdlm_loss_sum, per_token_ce
from dllmflow.diffusion.strategies import LossOutput, build_strategy
from dllmflow.diffusion.strategies.mdlm import MDLMStrategy
from dllmflow.errors import UserError
from dllmflow.models.attention import forward_bidirectional
from dllmflow.settings import load_settings

V = 13


def ref_mdlm_sum(logits, x, noise, sup, p) -> float:
    """Σ_i -log softmax(logits_i)[x_i] · 1[noise_i ∧ sup_i] / max(p_i, 1e-8), one position at a time."""
    total = 0.0
    B, L, _ = logits.shape
    for b in range(B):
        for i in range(L):
            if noise[b, i] and sup[b, i]:
                row = logits[b, i].double()
                logz = math.log(sum(math.exp(v) for v in row.tolist()))
                total += (logz - row[x[b, i]].item()) / max(p[b, i].item(), 1e-8)
    return total


def _problem(seed=0, B=3, L=9):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, L, V, generator=g) * 3
    x = torch.randint(0, V, (B, L), generator=g)
    noise = torch.rand(B, L, generator=g) < 0.5
    sup = torch.ones(B, L)
    sup[:, :3] = 0
    p = (0.05 + 0.95 * torch.rand(B, 1, generator=g)).expand(B, L)
    return logits, x, noise, sup, p


def test_per_token_ce_matches_cross_entropy_and_upcasts():
    logits, x, *_ = _problem(1)
    ce = per_token_ce(logits, x)
    assert ce.shape == x.shape and ce.dtype == torch.float32
    torch.testing.assert_close(
        ce, F.cross_entropy(logits.reshape(-1, V), x.reshape(-1), reduction="none").view_as(x)
    )
    assert per_token_ce(logits.bfloat16(), x).dtype == torch.float32


def test_loss_matches_reference_formula():
    logits, x, noise, sup, p = _problem(2)
    got = mdlm_loss_sum(logits, x, noise, sup, p)
    assert math.isclose(got.item(), ref_mdlm_sum(logits, x, noise, sup, p), rel_tol=1e-5)


def test_zero_when_no_noise():
    logits, x, _, sup, p = _problem(3)
    logits.requires_grad_(True)
    loss = mdlm_loss_sum(logits, x, torch.zeros_like(x, dtype=torch.bool), sup, p)
    assert loss.item() == 0.0
    loss.backward()  # still differentiable (an empty sum)
    assert (logits.grad == 0).all()


def test_only_corrupted_supervised_positions_count():
    logits, x, noise, sup, p = _problem(4)
    noise[:, :3] = True  # corrupted but unsupervised: must not count
    counted = noise & (sup != 0)
    logits.requires_grad_(True)
    mdlm_loss_sum(logits, x, noise, sup, p).backward()
    has_grad = logits.grad.abs().sum(-1) > 0
    assert torch.equal(has_grad, counted)


def test_inverse_p_weighting():
    logits, x, noise, sup, _ = _problem(5)
    one = mdlm_loss_sum(logits, x, noise, sup, torch.ones(3, 9))
    quarter = mdlm_loss_sum(logits, x, noise, sup, torch.full((3, 9), 0.25))
    torch.testing.assert_close(quarter, 4 * one)


# ---- strategy ---------------------------------------------------------------------------------------


def _tiny_qwen3(vocab=48):
    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, head_dim=8, use_cache=False,
    )  # fmt: skip
    cfg._attn_implementation = "sdpa"
    return Qwen3ForCausalLM(cfg)


def _batch(B=4, L=20, mask_id=47):
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, mask_id, (B, L), generator=g)
    loss_mask = torch.zeros(B, L)
    loss_mask[:, 5:] = 1
    attn = torch.ones(B, L, dtype=torch.long)
    attn[1, 15:] = 0
    return {"input_ids": x, "loss_mask": loss_mask, "attention_mask": attn}


def test_strategy_end_to_end():
    strategy = build_strategy(load_settings(dllm={"mode": "mdlm", "eps": 0.001}))
    assert isinstance(strategy, MDLMStrategy)
    model = _tiny_qwen3()
    strategy.setup(model, SimpleNamespace(mask_token_id=47), torch.device("cpu"))
    batch = _batch()
    clean = batch["input_ids"].clone()
    state = torch.get_rng_state()
    side = strategy.corrupt(batch, seeds=[10, 11, 12, 13])
    assert torch.equal(state, torch.get_rng_state())
    assert set(side) == {"noisy_input_ids", "noise_mask", "p_mask"}
    assert (side["noisy_input_ids"][side["noise_mask"]] == 47).all()
    assert side["noise_mask"].any()
    batch.update(side)
    assert torch.equal(batch["input_ids"], clean)  # clean ids stay intact
    assert strategy.token_counts(batch) == {"diffusion": torch.tensor(4 * 15)}
    out = strategy.loss(model, batch)
    assert isinstance(out, LossOutput) and set(out.sums) == {"diffusion"}
    out.sums["diffusion"].backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    assert any(g.abs().sum() > 0 for g in grads)

    # The model reads the noisy ids (bidirectionally); the loss is the reference formula on its logits.
    # Row 1's padding [15:] is supervised, so it is attended like the content: every key is.
    with torch.no_grad():
        logits = forward_bidirectional(
            model, side["noisy_input_ids"], torch.ones_like(batch["attention_mask"])
        )
    want = ref_mdlm_sum(logits, clean, side["noise_mask"], batch["loss_mask"], side["p_mask"])
    assert math.isclose(out.sums["diffusion"].item(), want, rel_tol=1e-5)


def test_strategy_seeds_are_per_sample():
    strategy = build_strategy(load_settings(dllm={"mode": "mdlm", "mask_token_id": 47}))
    batch = _batch()
    full = strategy.corrupt(batch, seeds=[10, 11, 12, 13])
    half = strategy.corrupt({k: v[2:] for k, v in batch.items()}, seeds=[12, 13])
    assert all(torch.equal(full[k][2:], half[k]) for k in full)


def test_strategy_without_mask_id_raises_clearly():
    strategy = build_strategy(load_settings(dllm={"mode": "mdlm"}))
    with pytest.raises(UserError, match="mask_token_id"):
        strategy.corrupt(_batch(), seeds=[1, 2, 3, 4])


def test_setup_with_a_tokenizer_without_mask_token_raises_clearly():
    """Missing mask token: neither dllm.mask_token_id nor the tokenizer gives one."""

    class NoMaskTokenizer:
        mask_token_id = None

    strategy = build_strategy(load_settings(dllm={"mode": "mdlm"}))
    with pytest.raises(UserError, match="dllm.mask_token_id"):
        strategy.setup(_tiny_qwen3(), NoMaskTokenizer(), torch.device("cpu"))
    out_of_vocab = build_strategy(load_settings(dllm={"mode": "mdlm", "mask_token_id": 10_000}))
    with pytest.raises(UserError, match="outside the model vocabulary"):
        out_of_vocab.setup(_tiny_qwen3(), NoMaskTokenizer(), torch.device("cpu"))


def test_loss_gradients_equal_the_full_head_reference():
    """The strategy runs the LM head only on the columns that are noised and supervised in some row;
    its gradients equal those of the reference formula written over every position's logits."""
    strategy = build_strategy(load_settings(dllm={"mode": "mdlm", "eps": 0.001}))
    model = _tiny_qwen3()
    strategy.setup(model, SimpleNamespace(mask_token_id=47), torch.device("cpu"))
    batch = _batch(L=24)
    batch["loss_mask"][:, :18] = 0  # a few supervised columns, as on a short-answer task
    batch.update(strategy.corrupt(batch, seeds=[5, 6, 7, 8]))
    strategy.loss(model, batch).sums["diffusion"].backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    keys = batch["attention_mask"].clone()
    keys[1, 18:] = 1  # row 1's padding: [15, 18) unsupervised stays hidden, the supervised [18:] is attended
    logits = forward_bidirectional(model, batch["noisy_input_ids"], keys)  # [B, L, V]
    sel = batch["noise_mask"].bool() & (batch["loss_mask"] != 0)
    ce = F.cross_entropy(logits[sel], batch["input_ids"][sel], reduction="none")
    (ce / batch["p_mask"][sel]).sum().backward()
    assert sel.any() and not sel[:, :18].any()
    for name, p in model.named_parameters():
        torch.testing.assert_close(got[name], p.grad, rtol=1e-5, atol=1e-7, msg=name)
    assert got["lm_head.weight"].abs().sum() > 0


def test_loss_with_nothing_selected_is_zero_and_still_backpropagates():
    strategy = build_strategy(load_settings(dllm={"mode": "mdlm", "eps": 0.001}))
    model = _tiny_qwen3()
    strategy.setup(model, SimpleNamespace(mask_token_id=47), torch.device("cpu"))
    batch = _batch()
    batch.update(strategy.corrupt(batch, seeds=[5, 6, 7, 8]))
    batch["loss_mask"].zero_()
    total = strategy.loss(model, batch).sums["diffusion"]
    assert total.item() == 0.0 and total.requires_grad
    total.backward()
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())


@pytest.mark.parametrize("supervised", [True, False])
def test_a_supervised_tail_is_attended_and_unsupervised_padding_is_not(supervised):
    """The sampler decodes the positions past the answer (block fill, `supervise_padding`) from [MASK]s its
    whole window attends, so training attends them when they are supervised; unsupervised padding stays
    hidden (a row's loss does not depend on how far its batch was padded). Changing a padding position
    that is no loss column changes the loss exactly when it is supervised."""
    strategy = build_strategy(load_settings(dllm={"mode": "mdlm", "eps": 0.001}))
    model = _tiny_qwen3()
    strategy.setup(model, SimpleNamespace(mask_token_id=47), torch.device("cpu"))
    batch = _batch()  # row 1 is padded from 15 on
    batch["loss_mask"][1, 15:] = float(supervised)
    batch.update(strategy.corrupt(batch, seeds=[10, 11, 12, 13]))
    batch["noise_mask"][:, 5:15] = True  # every answer position a loss column, no padding one
    batch["noise_mask"][:, 15:] = False
    batch["noisy_input_ids"] = torch.where(batch["noise_mask"], 47, batch["input_ids"])
    with torch.no_grad():
        base = strategy.loss(model, batch).sums["diffusion"].item()
        edited = {**batch, "noisy_input_ids": batch["noisy_input_ids"].clone()}
        edited["noisy_input_ids"][1, 15:] = 47  # the padding as the sampler shows it: masked
        after = strategy.loss(model, edited).sums["diffusion"].item()
    if supervised:
        assert not math.isclose(after, base, rel_tol=1e-6)
    else:
        assert after == base
