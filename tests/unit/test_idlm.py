"""I-DLM: the 2L block-diffusion mask, the two-CE loss, the strategy's checks and the curriculum (docs/strategies.md §2.6, §5).

Math is compared with element-wise references written here; the end-to-end tests run a tiny Qwen3.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, Qwen3Config

from dllmflow.diffusion.masks import idlm as idlm_masks
from dllmflow.diffusion.masks.idlm import idlm_block_mask, idlm_dense_mask, idlm_split_attention, right_padded
from dllmflow.diffusion.strategies import build_strategy
from dllmflow.diffusion.strategies.idlm import (
    IDLMStrategy,
    curriculum_stages,
    idlm_attention_backend,
)
from dllmflow.errors import UserError
from dllmflow.models import split_attention as split_module
from dllmflow.models.shifted_attention import block_shifted_mask
from dllmflow.models.split_attention import SPLIT_ATTENTION
from dllmflow.settings import SettingsError, load_settings

MASK = 2
V = 40


def _settings(**dllm):
    return load_settings(dllm={"mode": "idlm", "mask_token_id": MASK, **dllm})


def _tiny_qwen3(attn="sdpa", seed=0):
    torch.manual_seed(seed)
    cfg = Qwen3Config(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, use_cache=False,
    )  # fmt: skip
    cfg._attn_implementation = attn
    return AutoModelForCausalLM.from_config(cfg)


def _batch(seed=0, B=2, L=9):
    """Row 0: prompt 3, response to the end. Row 1: prompt 2, response, 2 padded positions."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(3, V, (B, L), generator=g)
    loss_mask = torch.zeros(B, L)
    loss_mask[0, 3:] = 1
    loss_mask[1, 2 : L - 2] = 1
    attention_mask = torch.ones(B, L, dtype=torch.long)
    attention_mask[1, L - 2 :] = 0
    return {"input_ids": x, "loss_mask": loss_mask, "attention_mask": attention_mask}


# ---- the mask -------------------------------------------------------------------------------------


def _reference_keep(L, b, valid):
    """docs/strategies.md §2.6 written out position by position: (M_BD or M_OBC or M_BC) and valid[k mod L]."""
    keep = torch.zeros(2 * L, 2 * L, dtype=torch.bool)
    for q in range(2 * L):
        for k in range(2 * L):
            q_noisy, k_noisy = q < L, k < L
            bq, bk = (q % L) // b, (k % L) // b
            m_bd = bq == bk and q_noisy and k_noisy and q >= k
            m_obc = bq > bk and q_noisy and not k_noisy
            m_bc = q >= k and not q_noisy and not k_noisy
            keep[q, k] = (m_bd or m_obc or m_bc) and bool(valid[k % L])
    return keep


@pytest.mark.parametrize("b", [1, 2, 3])
def test_dense_mask_matches_elementwise_reference(b):
    am = _batch()["attention_mask"]
    L = am.shape[1]
    mask = idlm_dense_mask(am, b, dtype=torch.bfloat16)
    assert mask.shape == (2, 1, 2 * L, 2 * L) and mask.dtype == torch.bfloat16
    low = torch.finfo(torch.bfloat16).min
    assert set(mask.unique().tolist()) <= {0.0, low}
    for row in range(2):
        assert torch.equal(mask[row, 0] == 0, _reference_keep(L, b, am[row]))


def test_block_length_one_noisy_token_sees_itself_and_strictly_earlier_clean_tokens():
    L = 6
    keep = idlm_dense_mask(None, 1, dtype=torch.float32, seq_len=L)[0, 0] == 0
    for q in range(L):
        assert keep[q].nonzero().flatten().tolist() == [q] + [L + k for k in range(q)]
        assert keep[L + q].nonzero().flatten().tolist() == [L + k for k in range(q + 1)]


def test_padded_keys_blocked_in_both_copies():
    am = _batch()["attention_mask"]
    L = am.shape[1]
    mask = idlm_dense_mask(am, 2, dtype=torch.float32)
    for k in (L - 2, L - 1):  # padded in row 1 only
        assert (mask[1, 0, :, k] < 0).all() and (mask[1, 0, :, L + k] < 0).all()
    assert (mask[0, 0, :, 2 * L - 1] == 0).any()  # the same key is visible in the unpadded row


def test_flex_block_mask_matches_dense_on_cpu():
    from torch.nn.attention.flex_attention import flex_attention

    am = _batch()["attention_mask"]
    L = am.shape[1]
    for b in (1, 3):
        dense = idlm_dense_mask(am, b, dtype=torch.float32)
        bm = idlm_block_mask(am, b)
        g = torch.Generator().manual_seed(b)
        q, k, v = (torch.randn(2, 2, 2 * L, 8, generator=g) for _ in range(3))
        out_flex = flex_attention(q, k, v, block_mask=bm)  # uncompiled reference path, forward only
        out_sdpa = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense)
        torch.testing.assert_close(out_flex, out_sdpa, atol=1e-5, rtol=1e-5)


# ---- the loss on fixed random logits -----------------------------------------------------------------


class FixedLogits(nn.Module):
    """Stands in for a model: returns given logits [B, 2L, V] and records what it was called with."""

    def __init__(self, logits):
        super().__init__()
        self.logits = nn.Parameter(logits.clone())
        self.calls = []

    def forward(self, **kwargs):
        self.calls.append(kwargs)
        return type("Out", (), {"logits": self.logits})()


def _reference_loss(logits, x, loss_mask, attention_mask, alpha):
    """CE_noisy + alpha CE_clean, next-token shift, shared denominator N_sup (auto: alpha=None).

    N_sup = loss_mask.sum() over the UNSHIFTED mask (docs/strategies.md §1.2, §2.6), not the number of scored
    positions (this reference used the shifted count before; the two differ when position 0 or a pad
    is supervised)."""
    B, L = x.shape
    noisy = clean = 0.0
    for b in range(B):
        for i in range(L - 1):
            if loss_mask[b, i + 1] and attention_mask[b, i + 1]:
                target = int(x[b, i + 1])
                noisy += -torch.log_softmax(logits[b, i].double(), -1)[target]
                clean += -torch.log_softmax(logits[b, L + i].double(), -1)[target]
    count = max(int(loss_mask.sum()), 1)
    ce_noisy, ce_clean = noisy / count, clean / count
    if alpha is None:
        alpha = ce_noisy / max(ce_clean, 1e-6)
    return ce_noisy + alpha * ce_clean, ce_noisy


def _total(out, counts):
    return sum(out.weight(k) * out.sums[k] / max(int(counts[k]), 1) for k in out.sums)


@pytest.mark.parametrize("auto", [False, True])
def test_loss_matches_reference(auto):
    batch = _batch()
    B, L = batch["input_ids"].shape
    logits = torch.randn(B, 2 * L, V, generator=torch.Generator().manual_seed(1))
    strategy = build_strategy(_settings(clean_loss_weight=0.3, auto_balance_clean_loss=auto, block_length=2))
    model = FixedLogits(logits)
    batch.update(strategy.corrupt(batch, [11, 12]))
    counts = strategy.token_counts(batch)
    out = strategy.loss(model, batch)
    total = _total(out, counts)
    ref_total, ref_dllm = _reference_loss(logits, batch["input_ids"], batch["loss_mask"], batch["attention_mask"],
                                          None if auto else 0.3)  # fmt: skip
    assert math.isclose(float(total), float(ref_total), rel_tol=1e-5)
    assert math.isclose(float(out.sums["noisy"] / counts["noisy"]), float(ref_dllm), rel_tol=1e-5)
    assert out.dllm_terms == ("noisy",)

    # The model saw [x_t | x_0], positions restarting at the clean copy, the 2L mask, no cache.
    call = model.calls[0]
    x, z = batch["input_ids"], batch["noisy_input_ids"]
    assert torch.equal(call["input_ids"], torch.cat([z, x], 1))
    assert call["position_ids"][0].tolist() == list(range(L)) * 2
    assert call["attention_mask"].shape == (B, 1, 2 * L, 2 * L) and call["use_cache"] is False


@pytest.mark.parametrize("auto", [False, True])
def test_denominator_is_the_unshifted_supervised_count(auto):
    """Row 0 supervises position 0 (no logit predicts it) and row 1 supervises its two pads
    (supervise_padding: loss_mask 1, attention 0, never scored): N_sup still counts all of them."""
    batch = _batch()
    B, L = batch["input_ids"].shape
    batch["loss_mask"][0, :] = 1
    batch["loss_mask"][1, 2:] = 1
    n_sup = int(batch["loss_mask"].sum())
    assert n_sup == L + (L - 2)
    scored = int((batch["loss_mask"][:, 1:] * batch["attention_mask"][:, 1:]).sum())
    assert scored == n_sup - 3  # position 0 of row 0, the two pads of row 1
    logits = torch.randn(B, 2 * L, V, generator=torch.Generator().manual_seed(4))
    strategy = build_strategy(_settings(clean_loss_weight=0.2, auto_balance_clean_loss=auto))
    batch.update(strategy.corrupt(batch, [1, 2]))
    counts = strategy.token_counts(batch)
    assert int(counts["noisy"]) == int(counts["clean"]) == n_sup
    out = strategy.loss(FixedLogits(logits), batch)
    ref_total, ref_dllm = _reference_loss(logits, batch["input_ids"], batch["loss_mask"], batch["attention_mask"],
                                          None if auto else 0.2)  # fmt: skip
    assert math.isclose(float(_total(out, counts)), float(ref_total), rel_tol=1e-5)
    assert math.isclose(float(out.sums["noisy"] / n_sup), float(ref_dllm), rel_tol=1e-5)


def test_auto_balance_alpha_is_a_stopgrad_ratio():
    batch = _batch()
    B, L = batch["input_ids"].shape
    logits = torch.randn(B, 2 * L, V, generator=torch.Generator().manual_seed(2))
    strategy = build_strategy(_settings(auto_balance_clean_loss=True))
    model = FixedLogits(logits)
    batch.update(strategy.corrupt(batch, [0, 1]))
    out = strategy.loss(model, batch)
    alpha = out.weight("clean")
    assert isinstance(alpha, torch.Tensor) and not alpha.requires_grad
    assert math.isclose(float(alpha), float(out.sums["noisy"] / out.sums["clean"]), rel_tol=1e-6)
    # The gradient is that of CE_noisy + (constant alpha) CE_clean.
    (out.sums["noisy"] + alpha * out.sums["clean"]).backward()
    got = model.logits.grad.clone()
    model.logits.grad = None
    out2 = strategy.loss(model, batch)
    (out2.sums["noisy"] + float(alpha) * out2.sums["clean"]).backward()
    torch.testing.assert_close(got, model.logits.grad)


def test_loss_excludes_prompt_padding_and_last_position():
    batch = _batch()
    B, L = batch["input_ids"].shape
    logits = torch.randn(B, 2 * L, V, generator=torch.Generator().manual_seed(3))
    strategy = build_strategy(_settings())
    batch.update(strategy.corrupt(batch, [0, 1]))
    base = strategy.loss(FixedLogits(logits), batch).sums
    poked = logits.clone()
    # Logit i predicts x[i+1]: row 0 supervises i >= 2; row 1 supervises i in [1, L-4] (pads at L-2, L-1).
    for row, positions in ((0, [0, 1, L - 1]), (1, [0, L - 3, L - 2, L - 1])):
        for i in positions:
            poked[row, i] += 100 * torch.randn(V)
            poked[row, L + i] += 100 * torch.randn(V)
    out = strategy.loss(FixedLogits(poked), batch).sums
    for k in ("noisy", "clean"):
        assert torch.isfinite(out[k]) and torch.equal(out[k], base[k])
    counts = strategy.token_counts(batch)
    assert int(counts["noisy"]) == int(counts["clean"]) == (L - 3) + (L - 4)


def test_corruption_masks_every_supervised_position_and_nothing_else():
    batch = _batch()
    side = build_strategy(_settings()).corrupt(batch, [5, 6])
    sup = batch["loss_mask"] != 0
    assert torch.equal(side["noise_mask"], sup)
    assert (side["noisy_input_ids"][sup] == MASK).all()
    assert torch.equal(side["noisy_input_ids"][~sup], batch["input_ids"][~sup])
    assert (side["p_mask"] == 1).all()


# ---- end to end with a tiny Qwen3 ---------------------------------------------------------------------


def test_end_to_end_tiny_qwen3_mask_semantics_and_finite_grads():
    model = _tiny_qwen3()
    strategy = build_strategy(_settings(block_length=1))
    strategy.setup(model, None, torch.device("cpu"))
    batch = _batch()
    x, am = batch["input_ids"], batch["attention_mask"]
    L = x.shape[1]
    batch.update(strategy.corrupt(batch, [0, 1]))
    z = batch["noisy_input_ids"]

    captured = {}
    handle = model.register_forward_hook(
        lambda m, a, kw, out: captured.update(logits=out.logits), with_kwargs=True
    )
    out = strategy.loss(model, batch)
    handle.remove()
    logits = captured["logits"].detach()  # [B, 2L, V]
    with torch.no_grad():
        # The clean copy is exactly the causal LM on x.
        causal = model(input_ids=x, attention_mask=am).logits
        torch.testing.assert_close(logits[0, L:], causal[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(logits[1, L : 2 * L - 2], causal[1, : L - 2], atol=1e-5, rtol=1e-5)
        # With b = 1 the noisy token at i reads the clean prefix x[:i] and itself, at position i.
        for i in (3, 6):
            prefix = torch.cat([x[:1, :i], z[:1, i : i + 1]], 1)
            torch.testing.assert_close(
                logits[0, i], model(input_ids=prefix).logits[0, i], atol=1e-5, rtol=1e-5
            )

    total = out.sums["noisy"] + out.weight("clean") * out.sums["clean"]
    total.backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert any(g.abs().sum() > 0 for g in grads)


def test_attention_mask_absent_means_no_padding():
    batch = _batch()
    del batch["attention_mask"]
    strategy = build_strategy(_settings())
    batch.update(strategy.corrupt(batch, [0, 1]))
    B, L = batch["input_ids"].shape
    model = FixedLogits(torch.randn(B, 2 * L, V))
    out = strategy.loss(model, batch)
    assert torch.isfinite(out.sums["noisy"])
    assert (model.calls[0]["attention_mask"] == idlm_dense_mask(None, 1, torch.float32, seq_len=L)).all()


# ---- attention backends: split sdpa == dense mask -----------------------------------------------------


def test_attention_backend_selection():
    for requested in ("sdpa", "flex_attention", SPLIT_ATTENTION):
        assert idlm_attention_backend("cuda", requested) == "flex"  # GPU: flex BlockMask wherever it runs
        assert idlm_attention_backend(torch.device("cuda:1"), requested) == "flex"
        assert idlm_attention_backend("cpu", requested) == "split"  # flex has no CPU backward
    assert idlm_attention_backend("cpu", "eager") == idlm_attention_backend("cuda", "eager") == "dense"
    assert idlm_attention_backend("cpu", "some_kernel") == "dense"
    with pytest.raises(UserError, match="flash_attention_2"):
        idlm_attention_backend("cpu", "flash_attention_2")


def test_setup_selects_the_backend_on_cpu():
    strategy = build_strategy(_settings())
    split, eager = _tiny_qwen3("sdpa"), _tiny_qwen3("eager")
    strategy.setup(split, None, torch.device("cpu"))
    strategy.setup(eager, None, torch.device("cpu"))
    assert split.config._attn_implementation == SPLIT_ATTENTION
    assert eager.config._attn_implementation == "eager"
    assert "_attn_implementation" not in split.config.to_dict()  # not exported: the checkpoint stays sdpa


def _split_mask_reference(am, b, chunks):
    """The split's masks must be the dense mask's entries at the keys each chunk gathers."""
    L = am.shape[1]
    dense = idlm_dense_mask(am, b, dtype=torch.float32)  # [B, 1, 2L, 2L]
    for a, e, mask in chunks:
        keys = list(range(a, e)) + [L + k for k in range(e)]
        assert torch.equal(mask, dense[:, :, a:e][..., keys])
        # nothing visible is left out of the gathered keys
        assert (dense[:, :, a:e][..., [k for k in range(2 * L) if k not in keys]] < 0).all()


@pytest.mark.parametrize("chunk", [1, 4, 256])
@pytest.mark.parametrize("b", [1, 2, 3])
def test_split_masks_are_the_dense_masks_entries(b, chunk):
    am = _batch(L=11)["attention_mask"]
    split = idlm_split_attention(am, b, torch.float32, chunk=chunk)
    assert split.seq_len == 11
    assert [a % b for a, _, _ in split.chunks] == [0] * len(split.chunks)
    assert split.chunks[0][0] == 0 and split.chunks[-1][1] == 11
    assert len(split.chunks) == (1 if chunk == 256 else -(-11 // max(b, chunk // b * b)))
    _split_mask_reference(am, b, split.chunks)
    assert right_padded(am) and right_padded(None) and not right_padded(am.flip(1))


def _loss_and_grads(strategy, batch, split: bool):
    model = _tiny_qwen3()
    if split:
        strategy.setup(model, None, torch.device("cpu"))
    assert (model.config._attn_implementation == SPLIT_ATTENTION) == split
    out = strategy.loss(model, batch)
    total = out.sums["noisy"] + out.weight("clean") * out.sums["clean"]
    total.backward()
    return total.detach(), {n: p.grad for n, p in model.named_parameters()}


def test_split_block_form_on_cpu_builds_no_mask():
    am = _batch(L=11)["attention_mask"]
    split = idlm_split_attention(am, 3, torch.float32)
    assert (split.seq_len, split.block_length, split.chunks) == (11, 3, ())


@pytest.mark.parametrize("b", [1, 2, 3])
def test_block_shifted_mask_is_the_dense_masks_noisy_rows(b):
    L = 11
    dense = idlm_dense_mask(None, b, dtype=torch.float32, seq_len=L)[0, 0]  # [2L, 2L]
    torch.testing.assert_close(block_shifted_mask(L, b, torch.float32), dense[:L], rtol=0, atol=0)


@pytest.mark.parametrize(
    "case", ["padded", "supervise_padding", "no_padding", "left_padded", "all_padding_row"]
)
@pytest.mark.parametrize("b", [1, 2, 3])
@pytest.mark.parametrize("form", ["shifted", "short", 2, 256])
def test_split_attention_loss_and_grads_equal_the_dense_mask(case, b, form, monkeypatch):
    if form == "shifted":  # the block form's mask-free kernel, not its short-L masked SDPA
        monkeypatch.setattr(split_module, "MASKED_MAX_LEN", 0)
    elif form != "short":  # the chunk form (devices without the shifted kernel); 2 -> several chunks
        monkeypatch.setattr(idlm_masks, "SHIFTED_DEVICES", frozenset())
        monkeypatch.setattr(idlm_masks, "NOISY_CHUNK", form)
    batch = _batch(L=11 if b == 3 else 10)  # L=11 with b=3: a partial last block
    if case == "supervise_padding":
        batch["loss_mask"][1, 2:] = 1
    elif case == "no_padding":
        batch["attention_mask"][:] = 1
    elif case == "left_padded":  # not the collator's: the split model falls back to the dense mask
        batch["attention_mask"] = batch["attention_mask"].flip(1)
        batch["loss_mask"] = batch["loss_mask"].flip(1)
    elif case == "all_padding_row":
        batch["attention_mask"][1] = 0
    strategy = build_strategy(_settings(block_length=b, auto_balance_clean_loss=True))
    batch.update(strategy.corrupt(batch, [3, 4]))
    dense_loss, dense_grads = _loss_and_grads(strategy, batch, split=False)
    split_loss, split_grads = _loss_and_grads(strategy, batch, split=True)
    torch.testing.assert_close(split_loss, dense_loss, rtol=1e-5, atol=1e-5)
    for name, g in dense_grads.items():
        torch.testing.assert_close(split_grads[name], g, rtol=1e-5, atol=1e-5, msg=name)


def test_split_attention_without_split_kwargs_is_sdpa():
    x = torch.randint(3, V, (2, 7), generator=torch.Generator().manual_seed(5))
    sdpa, split = _tiny_qwen3("sdpa"), _tiny_qwen3("sdpa")
    build_strategy(_settings()).setup(split, None, torch.device("cpu"))
    with torch.no_grad():
        torch.testing.assert_close(split(input_ids=x).logits, sdpa(input_ids=x).logits, rtol=0, atol=0)


# ---- checks and settings -------------------------------------------------------------------------------


def test_flash_attention_2_refused():
    model = _tiny_qwen3()
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(UserError, match="flash_attention_2"):
        build_strategy(_settings()).setup(model, None, torch.device("cpu"))
    s = load_settings(
        dllm={"mode": "idlm", "mask_token_id": MASK},
        model={"tiny": {}, "attn_implementation": "flash_attention_2"},
    )
    with pytest.raises(UserError, match="model.attn_implementation"):
        build_strategy(s).setup(_tiny_qwen3(), None, torch.device("cpu"))


def test_mask_id_required_and_inside_the_vocabulary():
    with pytest.raises(SettingsError, match="dllm.mask_token_id"):
        load_settings(dllm={"mode": "idlm"})
    strategy = build_strategy(load_settings(dllm={"mode": "idlm", "mask_token_id": V}))
    with pytest.raises(UserError, match="outside the model vocabulary"):
        strategy.setup(_tiny_qwen3(), None, torch.device("cpu"))


def test_curriculum_stages_chain_consolidated_checkpoints(tmp_path):
    s = _settings(block_length=[1, 2, 3])
    s = load_settings(dllm=s.dllm.model_dump(), run_dir=str(tmp_path / "run"))
    stages = curriculum_stages(s)
    assert [st.dllm.block_length for st in stages] == [1, 2, 3]
    assert [st.resolved_run_dir for st in stages] == [tmp_path / "run" / f"stage_{i}" for i in range(3)]
    assert stages[0].model == s.model
    for i in (1, 2):
        want = tmp_path / "run" / f"stage_{i - 1}" / "checkpoints" / "LATEST" / "model" / "consolidated"
        assert stages[i].model.pretrained_model_name_or_path == str(want) and stages[i].model.tiny is None
    assert all(IDLMStrategy(st).block_length == st.dllm.block_length for st in stages)
    single = _settings(block_length=2)
    assert curriculum_stages(single) == [single]


def test_list_block_length_outside_the_stages_trains_the_first(monkeypatch):
    """Only the stages carry the later block lengths (curriculum_stages); no environment picks one."""
    s = _settings(block_length=[2, 1, 3])
    monkeypatch.setenv("DLLM_IDLM_STAGE", "2")  # the environment switch that was removed: ignored
    assert IDLMStrategy(s).block_length == 2
