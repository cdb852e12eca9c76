"""Hybrid (Nemotron-Labs-Diffusion) strategy and the hybrid adapter (docs/strategies.md §2.3, §5, §7 caveat 5).

Loss math is compared with a position-by-position reference written here; the adapter and the
end-to-end tests run a tiny Qwen3.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, Qwen3Config

from dllmflow.diffusion.modes import build_mode_model
from dllmflow.diffusion.strategies import build_strategy
from dllmflow.diffusion.strategies.hybrid import HybridStrategy
from dllmflow.errors import UserError
from dllmflow.models.hybrid_adapter import HybridAdapter, HybridOutput, apply_hybrid_adapter
from dllmflow.settings import load_settings

MASK = 2
V = 40


def _settings(**dllm):
    return load_settings(dllm={"mode": "hybrid", "mask_token_id": MASK, **dllm})


def _tiny_qwen3(seed=0):
    torch.manual_seed(seed)
    cfg = Qwen3Config(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, use_cache=False,
    )  # fmt: skip
    cfg._attn_implementation = "sdpa"
    return AutoModelForCausalLM.from_config(cfg)


def _batch(seed=0, B=3, L=12, prompt=(0, 3, 5)):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(3, V, (B, L), generator=g)
    loss_mask = torch.zeros(B, L)
    for b, start in enumerate(prompt):
        loss_mask[b, start:] = 1
    return {"input_ids": x, "loss_mask": loss_mask, "attention_mask": torch.ones(B, L, dtype=torch.long)}


# ---- corruption ------------------------------------------------------------------------------------


def test_uniform_corruption_when_block_size_unset():
    batch = _batch(L=32)
    side = build_strategy(_settings(eps=0.01)).corrupt(batch, [1, 2, 3])
    sup = batch["loss_mask"] != 0
    noise, p = side["noise_mask"], side["p_mask"]
    assert not (noise & ~sup).any()
    assert torch.equal(side["noisy_input_ids"][noise], torch.full((int(noise.sum()),), MASK))
    assert torch.equal(side["noisy_input_ids"][~noise], batch["input_ids"][~noise])
    assert (p == p[:, :1]).all() and ((p >= 0.01) & (p <= 1)).all()  # one level per sequence


def test_blockwise_corruption_masks_exactly_k_per_block():
    L, bs, eps = 40, 8, 0.05
    batch = _batch(L=L, prompt=(0, 0, 0))
    strategy = build_strategy(_settings(block_size=bs, eps=eps, half_life_ratio=0.5))
    side = strategy.corrupt(batch, [7, 8, 9])
    noise, p = side["noise_mask"], side["p_mask"]
    levels = set()
    for b in range(3):
        for j in range(L // bs):
            blk = slice(j * bs, (j + 1) * bs)
            m = float(p[b, blk][0])
            assert (p[b, blk] == m).all() and eps <= m <= 1
            assert int(noise[b, blk].sum()) == min(max(round(m * bs), 0), bs)
            levels.add(m)
    assert len(levels) > 3  # a level per block, not per sequence

    # With a prompt, only supervised positions are corrupted (selection first, then the mask).
    batch = _batch(L=L, prompt=(0, 9, 20))
    side = strategy.corrupt(batch, [7, 8, 9])
    assert not (side["noise_mask"] & (batch["loss_mask"] == 0)).any()


def test_corruption_is_seeded_per_sample():
    batch = _batch(L=24)
    s = build_strategy(_settings(block_size=4))
    a, b = s.corrupt(batch, [1, 2, 3]), s.corrupt(batch, [1, 2, 3])
    assert all(torch.equal(a[k], b[k]) for k in a)
    row = {k: v[1:2] for k, v in batch.items()}
    alone = s.corrupt(row, [2])
    assert torch.equal(alone["noise_mask"][0], a["noise_mask"][1])


# ---- the loss on fixed random logits -----------------------------------------------------------------


class NativeHybrid(nn.Module):
    """Stands in for a remote-code Nemotron-Labs-Diffusion model: fixed logits, records its inputs.
    `layout`: "separate" (logits + causal_logits), "concat" ([B, 2L, V] logits), "none" (no AR logits)."""

    def __init__(self, logits, causal, layout="separate"):
        super().__init__()
        self.logits, self.causal, self.layout = (
            nn.Parameter(logits.clone()),
            nn.Parameter(causal.clone()),
            layout,
        )
        self.calls = []

    def forward(self, input_ids, masked_indices, labels=None, skip_loss=False):
        self.calls.append({"input_ids": input_ids, "masked_indices": masked_indices, "labels": labels,
                           "skip_loss": skip_loss})  # fmt: skip
        if self.layout == "concat":
            return HybridOutput(logits=torch.cat([self.logits, self.causal], 1))
        return HybridOutput(
            logits=self.logits, causal_logits=self.causal if self.layout == "separate" else None
        )


def _reference(logits, causal, x, noise, p, loss_mask, alpha):
    """alpha * sum CE/p over noise&sup / N_noise  +  sum_{i>=1} CE(causal_{i-1}, x_i) sup_i / N_sup."""
    B, L = x.shape
    diff, ar = 0.0, 0.0
    n_noise = int((noise & (loss_mask != 0)).sum())
    n_sup = int((loss_mask != 0).sum())
    for b in range(B):
        for i in range(L):
            if noise[b, i] and loss_mask[b, i]:
                diff += -torch.log_softmax(logits[b, i].double(), -1)[x[b, i]] / float(p[b, i])
            if i >= 1 and loss_mask[b, i]:
                ar += -torch.log_softmax(causal[b, i - 1].double(), -1)[x[b, i]]
    return alpha * diff / max(n_noise, 1) + ar / max(n_sup, 1), alpha * diff / max(n_noise, 1)


def _run(alpha=1.0, layout="separate", seed=0, **dllm):
    batch = _batch(seed=seed)
    B, L = batch["input_ids"].shape
    g = torch.Generator().manual_seed(seed + 100)
    logits, causal = torch.randn(B, L, V, generator=g), torch.randn(B, L, V, generator=g)
    strategy = build_strategy(_settings(ar_loss_alpha=alpha, **dllm))
    model = NativeHybrid(logits, causal, layout)
    batch.update(strategy.corrupt(batch, [4, 5, 6]))
    counts = strategy.token_counts(batch)
    out = strategy.loss(model, batch)
    total = sum(out.weight(k) * out.sums[k].detach() / max(int(counts[k]), 1) for k in out.sums)
    dllm = sum(out.weight(k) * out.sums[k].detach() / max(int(counts[k]), 1) for k in out.dllm_terms)
    return float(total), float(dllm), batch, logits, causal, model, counts


@pytest.mark.parametrize("block_size", [None, 4])
def test_loss_matches_reference(block_size):
    total, dllm, batch, logits, causal, model, counts = _run(alpha=0.3, block_size=block_size)
    ref_total, ref_dllm = _reference(logits, causal, batch["input_ids"], batch["noise_mask"], batch["p_mask"],
                                     batch["loss_mask"], 0.3)  # fmt: skip
    assert math.isclose(total, float(ref_total), rel_tol=1e-5)
    assert math.isclose(dllm, float(ref_dllm), rel_tol=1e-5)
    # Denominators: corrupted supervised positions, and ALL supervised positions for AR (row 0 has
    # i = 0 supervised, which the AR numerator cannot score).
    assert int(counts["diffusion"]) == int(batch["noise_mask"].sum())
    assert int(counts["ar"]) == int((batch["loss_mask"] != 0).sum())
    # The model got the clean ids and the noise mask (it masks internally), as the reference feeds it.
    call = model.calls[0]
    assert torch.equal(call["input_ids"], batch["input_ids"]) and torch.equal(
        call["labels"], batch["input_ids"]
    )
    assert torch.equal(call["masked_indices"], batch["noise_mask"]) and call["skip_loss"] is True


def test_alpha_scales_the_diffusion_term_only():
    t1, d1, *_ = _run(alpha=1.0)
    t3, d3, *_ = _run(alpha=0.3)
    t0, d0, *_ = _run(alpha=0.0)
    assert d0 == 0.0 and t0 > 0  # the AR part is unweighted
    assert math.isclose(d3, 0.3 * d1, rel_tol=1e-6)
    assert math.isclose(t1 - t0, d1, rel_tol=1e-5) and math.isclose(t3 - t0, d3, rel_tol=1e-5)


def test_concatenated_legacy_layout_equals_separate_causal_logits():
    assert _run(layout="concat")[:2] == _run(layout="separate")[:2]


def test_model_without_causal_logits_is_refused():
    with pytest.raises(UserError, match="causal_logits"):
        _run(layout="none")


def test_zero_diffusion_loss_when_nothing_is_corrupted():
    batch = _batch()
    B, L = batch["input_ids"].shape
    strategy = build_strategy(_settings())
    batch.update(strategy.corrupt(batch, [1, 2, 3]))
    batch["noise_mask"] = torch.zeros_like(batch["noise_mask"])
    out = strategy.loss(NativeHybrid(torch.randn(B, L, V), torch.randn(B, L, V)), batch)
    assert float(out.sums["diffusion"]) == 0.0 and float(out.sums["ar"]) > 0


# ---- the adapter -----------------------------------------------------------------------------------


def test_adapter_branches_diffusion_bidirectional_on_masked_input_causal_on_clean_input():
    model = _tiny_qwen3().eval()
    adapter = apply_hybrid_adapter(model, MASK)
    assert isinstance(adapter, HybridAdapter) and adapter.config is model.config
    g = torch.Generator().manual_seed(0)
    x = torch.randint(3, V, (2, 10), generator=g)
    masked = torch.zeros(2, 10, dtype=torch.bool)
    masked[:, [2, 6, 7]] = True
    with torch.no_grad():
        out = adapter(input_ids=x, masked_indices=masked)
        z = torch.where(masked, torch.full_like(x, MASK), x)
        zeros = torch.zeros(2, 1, 10, 10)  # every query sees every key
        torch.testing.assert_close(out.logits, model(input_ids=z, attention_mask=zeros).logits)
        torch.testing.assert_close(out.causal_logits, model(input_ids=x).logits)

        # A later clean token: changes every diffusion logit (bidirectional), no earlier causal logit.
        x2 = x.clone()
        x2[:, 8] = (x[:, 8] + 1 - 3) % (V - 3) + 3
        out2 = adapter(input_ids=x2, masked_indices=masked)
        assert not torch.allclose(out2.logits[:, :8], out.logits[:, :8])
        torch.testing.assert_close(out2.causal_logits[:, :8], out.causal_logits[:, :8])
        assert not torch.allclose(out2.causal_logits[:, 8:], out.causal_logits[:, 8:])
        # A masked position's clean token is invisible to the diffusion branch.
        x3 = x.clone()
        x3[:, 6] = (x[:, 6] + 1 - 3) % (V - 3) + 3
        torch.testing.assert_close(adapter(input_ids=x3, masked_indices=masked).logits, out.logits)


def test_adapter_blocks_padded_keys():
    model = _tiny_qwen3().eval()
    adapter = apply_hybrid_adapter(model, MASK)
    x = torch.randint(3, V, (1, 8), generator=torch.Generator().manual_seed(1))
    am = torch.ones(1, 8, dtype=torch.long)
    am[0, 6:] = 0
    masked = torch.zeros(1, 8, dtype=torch.bool)
    masked[0, 3] = True
    with torch.no_grad():
        a = adapter(input_ids=x, masked_indices=masked, attention_mask=am)
        x2 = x.clone()
        x2[0, 7] = (x[0, 7] + 1 - 3) % (V - 3) + 3
        b = adapter(input_ids=x2, masked_indices=masked, attention_mask=am)
    torch.testing.assert_close(a.logits[:, :6], b.logits[:, :6])


def test_native_model_used_as_is_and_unadaptable_models_refused():
    native = NativeHybrid(torch.zeros(1, 2, V), torch.zeros(1, 2, V))
    assert apply_hybrid_adapter(native, MASK) is native
    base = _tiny_qwen3().model  # a Qwen3Model: no LM head, no masked_indices
    with pytest.raises(UserError, match="causal logits"):
        apply_hybrid_adapter(base, MASK)
    with pytest.raises(UserError, match="masked_indices"):
        build_strategy(_settings()).setup(_tiny_qwen3(), None, torch.device("cpu"))


def test_end_to_end_tiny_qwen3_finite_grads_and_plain_export(tmp_path):
    from dllmflow.data.tokenizer import train_bpe_tokenizer

    tok = train_bpe_tokenizer(["the cat sat on the mat 1 2 3"] * 8, 300, "<mask>", "<pad>", "<eos>")
    s = load_settings(
        model={"tiny": {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
                        "num_key_value_heads": 2, "intermediate_size": 64}},
        dllm={"mode": "hybrid", "block_size": 4, "ar_loss_alpha": 0.5},
    )  # fmt: skip
    strategy = build_strategy(s)
    assert isinstance(strategy, HybridStrategy)
    torch.manual_seed(0)
    model = build_mode_model(s, tok)  # mask id from the tokenizer
    strategy.setup(model, tok, torch.device("cpu"))
    assert isinstance(model, HybridAdapter) and model.mask_token_id == tok.mask_token_id

    batch = _batch(L=12)
    batch["input_ids"] = batch["input_ids"] % len(tok)
    batch["attention_mask"][2, 10:] = 0
    batch["loss_mask"][2, 10:] = 0
    batch.update(strategy.corrupt(batch, [1, 2, 3]))
    counts = strategy.token_counts(batch)
    out = strategy.loss(model, batch)
    total = sum(out.weight(k) * out.sums[k] / max(int(counts[k]), 1) for k in out.sums)
    total.backward()
    grads = [p.grad for p in model.parameters()]
    assert torch.isfinite(total) and all(g is not None and torch.isfinite(g).all() for g in grads)

    # The export is the plain HF causal LM, loadable without dllmflow.
    strategy.export(model, model.state_dict(), tok, tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    inner = model.model.state_dict()
    assert all(torch.equal(v, inner[k]) for k, v in reloaded.state_dict().items())
