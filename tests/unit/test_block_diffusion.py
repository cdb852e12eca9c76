"""`block_diffusion` strategy on a tiny real DiffusionGemmaForBlockDiffusion (docs/strategies.md §2.4, §3.5).

References are computed directly here: corruption by re-drawing each row's generator in the kernel's
order, the diffusion loss from the model's own *inference* forward (encoder over the prefix, then
one canvas block) and the encoder AR loss from the HF encoder with its own causal masks.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache

from dllmflow.data.collate import DLLMCollator
from dllmflow.data.gsm8k import load_gsm8k_rows
from dllmflow.data.tokenizer import encode_chat, train_bpe_tokenizer
from dllmflow.diffusion.modes import build_mode_model
from dllmflow.diffusion.strategies import build_strategy
from dllmflow.errors import UserError
from dllmflow.models.diffusion_gemma import export_diffusion_gemma, load_diffusion_gemma
from dllmflow.settings import SettingsError, load_settings

ROOT = Path(__file__).resolve().parents[2]
TINY_YAML = ROOT / "params" / "tiny_block_diffusion.yaml"
BS = 16
SEEDS = [101, 202, 303, 404]


@pytest.fixture(scope="module")
def tok():
    rows = load_gsm8k_rows()[:64]
    return train_bpe_tokenizer(
        [m["content"] for r in rows for m in r["messages"]], 512, "<mask>", "<pad>", "<eos>"
    )


@pytest.fixture(scope="module")
def rows(tok):
    encoded = [
        dict(zip(("input_ids", "loss_mask"), encode_chat(tok, r["messages"]))) for r in load_gsm8k_rows()[:64]
    ]
    return sorted(encoded, key=lambda r: len(r["input_ids"]))[:4]  # the shortest: no truncation, fast


def make_settings(tok, **dllm):
    return load_settings(
        TINY_YAML,
        model={"canvas_length": BS},
        dataset={"seq_length": 192},
        dllm={
            "vocab_size": len(tok),
            "block_size": BS,
            "pad_block_size": BS,
            "pad_seq_len_divisible": BS,
            **dllm,
        },
    )


def make(tok, rows, seeds=SEEDS, **dllm):
    """(strategy, model, corrupted batch) with the model seeded for reproducible weights."""
    settings = make_settings(tok, **dllm)
    strategy = build_strategy(settings)
    torch.manual_seed(0)
    model = build_mode_model(settings, tok)
    strategy.setup(model, tok, torch.device("cpu"))
    batch = DLLMCollator.from_settings(settings, tok)(rows[: len(seeds)])
    batch.update(strategy.corrupt(batch, seeds))
    return strategy, model, batch


def softcap(x, c):
    return c * torch.tanh(x / c)


# ---- corruption and window ------------------------------------------------------------------------


def test_corruption_is_uniform_random_tokens_on_supervised_positions_only(tok, rows):
    strategy, _, batch = make(tok, rows)
    V, eps = len(tok), strategy.cfg.eps
    for b, seed in enumerate(SEEDS):
        n = int(batch["attention_mask"][b].sum())  # drawn over the row's own length, not the padded one
        x, sup = batch["input_ids"][b : b + 1, :n], batch["loss_mask"][b : b + 1, :n] != 0
        gen = torch.Generator().manual_seed(seed)
        t = eps + (1 - eps) * torch.rand(1, 1, generator=gen)  # one t per example
        noise = (torch.rand(x.shape, generator=gen) < t) & sup
        repl = torch.randint(0, V, x.shape, generator=gen)
        assert torch.equal(batch["noise_mask"][b : b + 1, :n], noise)
        assert torch.equal(batch["noisy_input_ids"][b : b + 1, :n], torch.where(noise, repl, x))
        assert not batch["noise_mask"][b, n:].any()
    assert not (batch["noise_mask"] & (batch["loss_mask"] == 0)).any()  # the prompt stays clean
    changed = batch["noisy_input_ids"] != batch["input_ids"]
    assert not (changed & ~batch["noise_mask"]).any()
    assert batch["noisy_input_ids"][batch["noise_mask"]].unique().numel() > 20  # many tokens, no [MASK]


def test_window_uses_absolute_positions_from_the_first_supervised_token(tok, rows):
    _, _, batch = make(tok, rows)
    ids, noisy, attn = batch["input_ids"], batch["noisy_input_ids"], batch["attention_mask"]
    for b in range(len(SEEDS)):
        prefix = int(torch.nonzero(batch["loss_mask"][b]).min())
        resp = int(attn[b].sum()) - prefix
        assert int(batch["prefix_lengths"][b]) == prefix and int(batch["response_lengths"][b]) == resp
        assert resp % BS == 0  # the collator's response-aligned block fill
        for j in range(resp):
            assert int(batch["canvas_position_ids"][b, j]) == prefix + j
            assert int(batch["canvas_targets"][b, j]) == int(ids[b, prefix + j])
            assert int(batch["canvas_ids"][b, j]) == int(noisy[b, prefix + j])
        assert batch["canvas_valid"][b].sum() == resp


def test_block_selection_is_seeded_per_sample_and_independent_of_the_batch_split(tok, rows):
    strategy, _, whole = make(tok, rows)
    again = strategy.corrupt({k: whole[k] for k in ("input_ids", "loss_mask", "attention_mask")}, SEEDS)
    assert torch.equal(again["selected_block"], whole["selected_block"])
    collate = DLLMCollator.from_settings(make_settings(tok), tok)
    lengths = set()
    for lo, hi in ((0, 2), (2, 4), (0, 1), (3, 4)):  # the same samples cut into other micro-batches / ranks
        part = collate(rows[lo:hi])  # re-collated: a different padded length
        lengths.add(part["input_ids"].shape[1])
        split = strategy.corrupt(part, SEEDS[lo:hi])
        assert torch.equal(split["selected_block"], whole["selected_block"][lo:hi])
        assert torch.equal(split["self_conditioning_mask"], whole["self_conditioning_mask"][lo:hi])
        L, R = split["noisy_input_ids"].shape[1], split["canvas_ids"].shape[1]
        assert torch.equal(split["noisy_input_ids"], whole["noisy_input_ids"][lo:hi, :L])
        assert torch.equal(split["canvas_ids"], whole["canvas_ids"][lo:hi, :R])
        assert torch.equal(split["canvas_loss_mask"], whole["canvas_loss_mask"][lo:hi, :R])
    assert len(lengths | {whole["input_ids"].shape[1]}) > 1  # the padding really changed
    # over many seeds every block of a row gets chosen, and only real blocks
    one = {k: whole[k][:1] for k in ("input_ids", "loss_mask", "attention_mask")}
    nvb = int(whole["response_lengths"][0]) // BS
    picks = {int(strategy.corrupt(one, [s])["selected_block"][0]) for s in range(1000, 1000 + 20 * nvb)}
    assert picks == set(range(nvb))


def test_denominators(tok, rows):
    strategy, _, batch = make(tok, rows)
    counts = strategy.token_counts(batch)
    attn = batch["attention_mask"]
    expect_ar = sum(
        int(attn[b, i] and attn[b, i + 1]) for b in range(attn.shape[0]) for i in range(attn.shape[1] - 1)
    )
    assert int(counts["encoder_ar"]) == expect_ar
    expect_diff = 0
    for b in range(attn.shape[0]):
        sel, p = int(batch["selected_block"][b]), int(batch["prefix_lengths"][b])
        expect_diff += int(batch["loss_mask"][b, p + sel * BS : p + (sel + 1) * BS].sum())
    assert int(counts["diffusion"]) == expect_diff


# ---- loss -----------------------------------------------------------------------------------------


def test_loss_is_flat_ce_on_the_selected_block_plus_weighted_encoder_ar(tok, rows):
    strategy, model, batch = make(tok, rows, self_conditioning_p=0.0, encoder_loss_weight=0.7)
    model.train()
    out = strategy.loss(model, batch)
    assert out.weights["encoder_ar"] == 0.7 and out.dllm_terms == ("diffusion",)

    text = model.config.get_text_config()
    cap = text.final_logit_softcapping
    ids, attn = batch["input_ids"], batch["attention_mask"]
    ref_diff, ref_ar, noised_in_loss, clean_in_loss = 0.0, 0.0, 0, 0
    with torch.no_grad():
        for b in range(ids.shape[0]):
            # the model's own inference forward for the selected block: encoder over the prefix, one canvas
            p, sel, rb = (int(batch[k][b]) for k in ("prefix_lengths", "selected_block", "response_lengths"))
            start, n = p + sel * BS, min(BS, rb - sel * BS)
            canvas = batch["noisy_input_ids"][b : b + 1, start : start + n]
            logits = model(
                input_ids=ids[b : b + 1, :start], cache=DynamicCache(config=text), decoder_input_ids=canvas
            )
            for i in range(n):
                if (
                    batch["loss_mask"][b, start + i] != 0
                ):  # every supervised position, noised or not, weight 1
                    ref_diff += F.cross_entropy(logits.logits[0, i], ids[b, start + i]).item()
                    noised = bool(batch["noise_mask"][b, start + i])
                    noised_in_loss += noised
                    clean_in_loss += not noised
            enc = model.model.encoder(input_ids=ids[b : b + 1], attention_mask=attn[b : b + 1])
            enc_logits = softcap(model.lm_head(enc.last_hidden_state[0]).float(), cap)
            for i in range(ids.shape[1] - 1):
                if attn[b, i] and attn[b, i + 1]:
                    ref_ar += F.cross_entropy(enc_logits[i], ids[b, i + 1]).item()
    assert out.sums["diffusion"].item() == pytest.approx(ref_diff, rel=1e-4)
    assert out.sums["encoder_ar"].item() == pytest.approx(ref_ar, rel=1e-4)
    assert noised_in_loss > 0 and clean_in_loss > 0  # not noise-gated

    model.eval()  # validation: the diffusion term only
    assert set(strategy.loss(model, batch).sums) == {"diffusion"}


def _signals(strategy, model, batch):
    """The self-conditioning signal the decoder received, one entry per decoder pass."""
    seen = []
    hook = model.model.decoder.self_conditioning.register_forward_hook(
        lambda m, args, out: seen.append(args[1])
    )
    try:
        strategy.loss(model, batch)
    finally:
        hook.remove()
    return seen


@pytest.mark.parametrize("p", [0.0, 1.0])
def test_self_conditioning_coin_all_or_nothing(tok, rows, p):
    strategy, model, batch = make(tok, rows, self_conditioning_p=p)
    signals = _signals(strategy, model.train(), batch)
    if p == 0.0:
        assert len(signals) == 1 and torch.count_nonzero(signals[0]) == 0  # zero soft embedding
    else:
        assert len(signals) == 2 and torch.count_nonzero(signals[0]) == 0  # pass 1: zero signal
        assert all(
            torch.count_nonzero(signals[1][b]) > 0 for b in range(len(SEEDS))
        )  # pass 2: soft predictions


def test_self_conditioning_coin_per_example(tok, rows):
    strategy, model, batch = make(tok, rows, self_conditioning_p=0.5)
    for start in range(0, 400, 4):  # find seeds whose coins differ within the batch
        seeds = list(range(start, start + 4))
        coins = strategy.corrupt({k: batch[k] for k in ("input_ids", "loss_mask", "attention_mask")}, seeds)
        if 0 < int(coins["self_conditioning_mask"].sum()) < 4:
            batch.update(coins)
            break
    signals = _signals(strategy, model.train(), batch)
    assert len(signals) == 2
    for b, coin in enumerate(batch["self_conditioning_mask"].tolist()):
        assert (torch.count_nonzero(signals[1][b]) > 0) == coin


def test_model_self_conditioning_off_runs_one_pass(tok, rows):
    data = make_settings(tok, self_conditioning_p=1.0).to_dict()
    data["model"]["self_conditioning"] = False
    settings = load_settings(**data)
    strategy = build_strategy(settings)
    model = build_mode_model(settings, tok)
    strategy.setup(model, tok, torch.device("cpu"))
    batch = DLLMCollator.from_settings(settings, tok)(rows)
    batch.update(strategy.corrupt(batch, SEEDS))
    assert not batch["self_conditioning_mask"].any()
    assert len(_signals(strategy, model.train(), batch)) == 1


# ---- training step, freezing, export --------------------------------------------------------------


def _step(strategy, model, batch):
    counts = strategy.token_counts(batch)
    out = strategy.loss(model, batch)
    total = sum(out.weight(k) * out.sums[k] / counts[k].clamp(min=1) for k in out.sums)
    total.backward()
    return total


@pytest.mark.parametrize("freeze", [True, False])
def test_finite_grads_and_freeze_router(tok, rows, freeze):
    settings = make_settings(tok, self_conditioning_p=1.0)
    data = settings.to_dict()
    data["model"]["freeze_router"] = freeze
    settings = load_settings(**data)
    strategy = build_strategy(settings)
    torch.manual_seed(0)
    model = build_mode_model(settings, tok).train()
    strategy.setup(model, tok, torch.device("cpu"))
    batch = DLLMCollator.from_settings(settings, tok)(rows)
    batch.update(strategy.corrupt(batch, SEEDS))
    router = {n: p.detach().clone() for n, p in model.named_parameters() if ".router." in n}
    assert router and all(model.get_parameter(n).requires_grad != freeze for n in router)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    assert torch.isfinite(_step(strategy, model, batch))
    for n, p in model.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and torch.isfinite(p.grad).all(), n
    opt.step()
    for n in router:
        assert torch.equal(model.get_parameter(n), router[n]) == freeze, n
    assert not torch.equal(model.get_parameter("model.decoder.self_conditioning.up_proj.weight"),
                           before["model.decoder.self_conditioning.up_proj.weight"])  # fmt: skip
    # the (unused) vision tower is frozen: no grads, no optimizer state
    assert not any(p.requires_grad for n, p in model.named_parameters() if "vision" in n)


def test_full_export_loads_back_and_generates(tok, rows, tmp_path):
    from dllmflow.diffusion.samplers import SAMPLERS
    from dllmflow.diffusion.samplers.base import build_sampler_config

    strategy, model, batch = make(tok, rows)
    _step(strategy, model.train(), batch)
    strategy.export(model, model.state_dict(), tok, tmp_path)
    loaded = load_diffusion_gemma(tmp_path).eval()
    assert type(loaded).__name__ == "DiffusionGemmaForBlockDiffusion"
    for k, v in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    prompt = batch["input_ids"][:1, : int(batch["prefix_lengths"][0])]
    out = loaded.generate(prompt, max_new_tokens=BS, max_denoising_steps=3, eos_token_id=tok.eos_token_id)
    assert out.sequences.shape == (1, prompt.shape[1] + BS)
    assert torch.equal(out.sequences[:, : prompt.shape[1]], prompt)
    sampler = SAMPLERS["gemma"](
        loaded, tok, build_sampler_config("gemma", {"steps": 3, "max_new_tokens": BS})
    )
    result = sampler.generate([prompt[0].tolist()])
    assert len(result.sequences) == 1 and len(result.sequences[0]) <= BS and 1 <= result.nfe <= 3


def test_decoder_only_export_overlays_the_base(tok, rows, tmp_path):
    strategy, model, batch = make(tok, rows)
    base = tmp_path / "base"
    export_diffusion_gemma(model, model.state_dict(), tok, base, base_name_or_path=None)  # the "hub" base
    _step(strategy, model.train(), batch)
    torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1).step()

    settings = load_settings(
        **{**make_settings(tok).to_dict(), "model": {"pretrained_model_name_or_path": str(base)}}
    )
    build_strategy(settings).export(model, model.state_dict(), tok, tmp_path / "out")
    import json

    from safetensors.torch import load_file

    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["_name_or_path"] == str(base) and config["architectures"] == [
        "DiffusionGemmaForBlockDiffusion"
    ]
    saved = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert saved and all(k.startswith("model.decoder.") for k in saved)
    loaded = load_diffusion_gemma(tmp_path / "out")
    for k, v in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k


# ---- bad input ------------------------------------------------------------------------------------


def test_missing_vocab_size_is_a_settings_error():
    with pytest.raises(SettingsError, match="vocab_size"):
        load_settings(dllm={"mode": "block_diffusion"})


def test_vocab_mismatch_is_a_clear_error(tok):
    settings = make_settings(tok)
    data = settings.to_dict()
    data["dllm"]["vocab_size"] = 999
    strategy = build_strategy(load_settings(**data))
    model = build_mode_model(settings, tok)
    with pytest.raises(UserError, match=rf"dllm.vocab_size=999 .* \({len(tok)}\)"):
        strategy.setup(model, tok, torch.device("cpu"))


def test_not_a_diffusion_gemma_model_is_a_clear_error(tok):
    strategy = build_strategy(make_settings(tok))
    with pytest.raises(UserError, match="DiffusionGemma"):
        strategy.setup(torch.nn.Linear(2, 2), tok, torch.device("cpu"))


def test_multi_turn_supervision_is_a_clear_error(tok, rows):
    strategy, _, batch = make(tok, rows)
    loss_mask = batch["loss_mask"].clone()
    loss_mask[1, 2:4] = 1  # a second supervised run inside the prompt
    with pytest.raises(UserError, match="mask_history"):
        strategy.corrupt({**batch, "loss_mask": loss_mask}, SEEDS)


def test_shipped_recipes_validate():
    real = load_settings(ROOT / "params" / "diffusion_gemma_sft.yaml")
    assert real.dllm.mode == "block_diffusion" and real.dllm.vocab_size == 262144
    assert real.dllm.block_size == real.model.canvas_length == real.dllm.pad_block_size == 256
    tiny = load_settings(TINY_YAML)
    assert tiny.dllm.vocab_size == tiny.tokenizer.train_vocab_size
    assert tiny.dataset.mask_history
