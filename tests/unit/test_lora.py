"""`models/lora.py`: LoRA targets per family, injection, tied adapters, merge, peft-layout export, load.

Tiny random models, no training loop (tests/integration/test_lora_train.py trains every mode). lora_B starts
at zero (the update is 0), so the tests give it random values before comparing merged and unmerged models.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dllmflow.data.tokenizer import train_bpe_tokenizer
from dllmflow.errors import UserError
from dllmflow.models.build import build_model
from dllmflow.models.lora import (
    ADAPTER_DIR,
    LORA_INFO,
    adapters_disabled,
    apply_lora,
    export_with_lora,
    has_lora,
    load_adapter,
    lora_target_modules,
)
from dllmflow.settings import SettingsError, load_settings

ROOT = Path(__file__).resolve().parents[2]
TEXTS = ["Tom has 3 apples and buys 4 more. 3 + 4 = 7", "#### 7", "How many now?"] * 20
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def tok():
    return train_bpe_tokenizer(TEXTS, 300, "<mask>", "<pad>", "<eos>")


def lora_settings(recipe: str | None = None, **peft):
    args = [ROOT / "params" / recipe] if recipe else []
    return load_settings(*args, peft={"r": 4, "alpha": 8, **peft})


def qwen(tok, seed: int = 0, **peft):
    """(plain base, the same weights with adapters) from one seed."""
    s = lora_settings(**peft)
    torch.manual_seed(seed)
    base = build_model(s, tok)
    torch.manual_seed(seed)
    return base.eval(), apply_lora(build_model(s, tok), s).eval()


def randomize_lora_b(model) -> None:
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():  # tied adapters are listed once
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)


def save_hf(model, state, tokenizer, out: Path) -> None:  # the default Strategy.export
    model.save_pretrained(out, state_dict=state, safe_serialization=True)
    tokenizer.save_pretrained(out)


IDS = torch.tensor([[1, 5, 7, 9, 11, 3]])


# ---- settings -------------------------------------------------------------------------------------


def test_defaults_leave_the_model_untouched(tok):
    s = load_settings()
    assert s.peft is None
    torch.manual_seed(0)
    model = build_model(s, tok)
    rng = torch.get_rng_state()
    assert apply_lora(model, s) is model and not has_lora(model)
    assert torch.equal(rng, torch.get_rng_state())  # golden trajectories untouched
    off = load_settings(peft={"enabled": False})
    assert not has_lora(apply_lora(build_model(off, tok), off))


@pytest.mark.parametrize(
    ("peft", "field"),
    [
        ({"target_modules": []}, "peft.target_modules"),
        ({"parts": ["middle"]}, "peft.parts"),
        ({"parts": []}, "peft.parts"),
        ({"r": 0}, "peft.r"),
        ({"dropout": 1.0}, "peft.dropout"),
        ({"rank": 8}, "peft.rank"),
    ],
)
def test_bad_settings_name_the_field(peft, field):
    with pytest.raises(SettingsError, match=field.replace(".", r"\.")):
        load_settings(peft=peft)


# ---- targets --------------------------------------------------------------------------------------


def test_default_targets_and_only_adapters_train(tok):
    from dllmflow.training.trainer import build_optimizer

    _, model = qwen(tok)
    adapted = {n.rsplit(".", 3)[0] for n, _ in model.named_parameters() if ".lora_A." in n}
    assert adapted == {f"model.layers.{i}.{part}.{p}" for i in range(2) for part, p in _where(PROJ)}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    optimizer = build_optimizer(model, lora_settings())
    in_optim = {id(p) for g in optimizer.param_groups for p in g["params"]}
    assert in_optim == {id(p) for p in model.parameters() if p.requires_grad}


def _where(names):
    return [("self_attn" if n[0] in "qkvo" else "mlp", n) for n in names]


def test_unknown_target_module_names_field_name_and_choices(tok):
    with pytest.raises(UserError) as err:
        qwen(tok, target_modules=["q_proj", "qkv_proj"])
    msg = str(err.value)
    assert "peft.target_modules" in msg and "'qkv_proj'" in msg
    assert "available linear module names: down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj" in msg


def test_explicit_targets_and_modules_to_save(tok):
    _, model = qwen(tok, target_modules=["q_proj", "v_proj"], modules_to_save=["embed_tokens"])
    adapted = sorted({n.split(".")[-4] for n, _ in model.named_parameters() if ".lora_A." in n})
    assert adapted == ["q_proj", "v_proj"]
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert "model.embed_tokens.modules_to_save.default.weight" in trainable
    with pytest.raises(UserError, match=r"peft\.modules_to_save: 'embeddings'"):
        qwen(tok, modules_to_save=["embeddings"])


def test_adapters_disabled_computes_the_base_then_restores(tok):
    """GRPO's KL reference with LoRA: the policy with its adapters (and a modules_to_save copy) off gives
    the base model's logits exactly; after the block the adapters act again and only they train."""
    base, model = qwen(tok, modules_to_save=["embed_tokens"])
    randomize_lora_b(model)
    with torch.no_grad():
        model.get_input_embeddings().modules_to_save["default"].weight.mul_(1.5)
    ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    with torch.no_grad():
        adapted = model(input_ids=ids).logits
        with adapters_disabled(model):
            off = model(input_ids=ids).logits
        again = model(input_ids=ids).logits
    assert torch.equal(off, base(input_ids=ids).logits)
    assert not torch.allclose(adapted, off) and torch.equal(again, adapted)
    assert {n for n, p in model.named_parameters() if p.requires_grad} == trainable


def test_parts_need_an_encoder_decoder_model(tok):
    with pytest.raises(UserError, match=r"peft\.parts=\['decoder'\].*remove peft\.parts"):
        qwen(tok, parts=["decoder"])


def test_dflash_draft_gets_adapters_on_its_layers_only(tmp_path):
    from _dflash_common import make_settings, make_tokenizer

    from dllmflow.diffusion.modes import build_mode_model

    settings = make_settings(tmp_path / "target")
    draft = build_mode_model(settings, make_tokenizer())
    cfg = lora_settings().peft
    targets = lora_target_modules(draft, cfg)
    assert targets and all(t.startswith("layers.") for t in targets)  # not `fc`, never the target
    assert {t.rpartition(".")[2] for t in targets} == set(PROJ)


# ---- merge, export, load --------------------------------------------------------------------------


def test_merged_export_and_base_plus_adapter_match_the_trained_model(tok, tmp_path):
    base, model = qwen(tok)
    randomize_lora_b(model)
    with torch.no_grad():
        want = model(input_ids=IDS).logits
        assert not torch.allclose(want, base(input_ids=IDS).logits, atol=1e-4)
    out = tmp_path / "consolidated"
    export_with_lora(save_hf, model, model.state_dict(), tok, out, lora_settings())
    assert has_lora(model) and any(".lora_A." in n for n, _ in model.named_parameters())  # restored

    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(out).eval()
    assert not any("lora" in k for k in merged.state_dict())
    adapter = load_adapter(base, out / ADAPTER_DIR)
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=IDS).logits, want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(adapter(input_ids=IDS).logits, want, atol=1e-5, rtol=1e-5)
    config = json.loads((out / ADAPTER_DIR / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (4, 8.0, "LORA")
    info = json.loads((out / LORA_INFO).read_text())
    assert info["adapter"] == ADAPTER_DIR and info["r"] == 4 and info["merged_exact"] is True
    assert info["base_model"].startswith("random init")


def test_saved_tied_embedding_stays_tied_in_the_merged_export(tok, tmp_path):
    _, model = qwen(tok, modules_to_save=["embed_tokens"])
    with torch.no_grad():
        model.model.embed_tokens.modules_to_save["default"].weight.add_(0.5)
        want = model(input_ids=IDS).logits
    export_with_lora(save_hf, model, model.state_dict(), tok, tmp_path, lora_settings())
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        got = AutoModelForCausalLM.from_pretrained(tmp_path).eval()(input_ids=IDS).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_hybrid_adapter_exports_keys_of_the_inner_model(tok, tmp_path):
    from dllmflow.models.hybrid_adapter import HybridAdapter

    base, _ = qwen(tok)
    s = lora_settings()
    torch.manual_seed(0)
    model = apply_lora(HybridAdapter(build_model(s, tok), tok.mask_token_id), s).eval()
    randomize_lora_b(model)
    export_with_lora(save_hf, model, model.state_dict(), tok, tmp_path, s)
    from safetensors.torch import load_file

    keys = load_file(str(tmp_path / ADAPTER_DIR / "adapter_model.safetensors"))
    assert keys and all(k.startswith("base_model.model.model.layers.") for k in keys)
    with torch.no_grad():
        want = model.model(input_ids=IDS).logits
        got = load_adapter(base, tmp_path / ADAPTER_DIR)(input_ids=IDS).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_load_adapter_needs_an_adapter_dir(tok, tmp_path):
    base, _ = qwen(tok)
    with pytest.raises(UserError, match="adapter_config.json"):
        load_adapter(base, tmp_path)


# ---- DiffusionGemma: encoder and decoder share their weights ----------------------------------------


def gemma(tok, **peft):
    from dllmflow.diffusion.modes import build_mode_model
    from dllmflow.diffusion.strategies import build_strategy

    s = load_settings(
        ROOT / "params" / "tiny_block_diffusion.yaml",
        model={"canvas_length": 16},
        dllm={"vocab_size": len(tok), "block_size": 16, "pad_block_size": 16, "pad_seq_len_divisible": 16},
        peft={"r": 4, "alpha": 8, **peft},
    )
    strategy = build_strategy(s)
    torch.manual_seed(0)
    model = apply_lora(build_mode_model(s, tok), s)
    strategy.setup(model, tok, torch.device("cpu"))
    return s, strategy, model


def _encoder_decoder_pairs(model):
    pairs = zip(model.model.encoder.language_model.layers, model.model.decoder.layers)
    return [(e.self_attn.q_proj, d.self_attn.q_proj) for e, d in pairs]


def test_gemma_default_parts_share_one_adapter(tok):
    _, _, model = gemma(tok)
    for enc, dec in _encoder_decoder_pairs(model):
        assert enc.lora_A["default"].weight is dec.lora_A["default"].weight
        assert enc.lora_B["default"].weight is dec.lora_B["default"].weight
    names = [n for n, _ in model.named_parameters() if ".lora_" in n]
    assert not any("vision" in n or "self_conditioning" in n for n in names)


def test_gemma_decoder_only_and_export_round_trip(tok, tmp_path):
    from dllmflow.models.diffusion_gemma import DiffusionGemmaForBlockDiffusionTraining

    s, strategy, model = gemma(tok, parts=["decoder"])
    assert not any(".lora_" in n for n, _ in model.model.encoder.named_parameters())
    export_with_lora(strategy.export, model, model.state_dict(), tok, tmp_path / "dec", s)
    assert json.loads((tmp_path / "dec" / LORA_INFO).read_text())["merged_exact"] is False

    s, strategy, model = gemma(tok)
    randomize_lora_b(model)
    out = tmp_path / "both"
    export_with_lora(strategy.export, model, model.state_dict(), tok, out, s)
    assert json.loads((out / LORA_INFO).read_text())["merged_exact"] is True
    merged = DiffusionGemmaForBlockDiffusionTraining.from_pretrained(out).eval()
    dec = {"decoder_input_ids": torch.tensor([[4, 8, 15, 16]]), "use_cache": False}
    with torch.no_grad():
        want = model.eval()(input_ids=IDS, **dec).logits
        torch.testing.assert_close(merged(input_ids=IDS, **dec).logits, want, atol=1e-5, rtol=1e-5)
        # base + adapter: the adapter holds both aliases, applied on the fly (merging would add it twice)
        _, _, fresh = gemma(tok, enabled=False)
        fresh.save_pretrained(tmp_path / "base")
        base = DiffusionGemmaForBlockDiffusionTraining.from_pretrained(tmp_path / "base").eval()
        got = load_adapter(base, out / ADAPTER_DIR)(input_ids=IDS, **dec).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


# ---- CLI ------------------------------------------------------------------------------------------


def test_generate_and_evaluate_take_an_adapter_flag():
    import argparse

    from dllmflow.evaluation.accuracy import add_cli_args as eval_args
    from dllmflow.inference.generate import add_cli_args as gen_args

    for add in (gen_args, eval_args):
        parser = argparse.ArgumentParser()
        add(parser)
        extra = ["--prompt", "x"] if add is gen_args else []
        args = parser.parse_args(["--checkpoint", "c", "--adapter", "a", *extra])
        assert args.adapter == "a"


# ---- default targets per backbone family: the exact adapted modules ---------------------------------


def _default_targets(model) -> set[str]:
    return set(lora_target_modules(model, lora_settings().peft))


def test_default_targets_qwen3_and_llama(tok):
    for arch in ("qwen3", "llama"):
        s = load_settings(model={"tiny": {"architecture": arch}}, peft={"r": 4})
        model = build_model(s, tok)
        layers = range(s.model.tiny.num_hidden_layers)
        want = {f"model.layers.{i}.{part}.{p}" for i in layers for part, p in _where(PROJ)}
        assert _default_targets(model) == want, arch  # never lm_head


def test_default_targets_hybrid_adapter(tok):
    from dllmflow.models.hybrid_adapter import HybridAdapter

    s = load_settings(peft={"r": 4})
    model = HybridAdapter(build_model(s, tok), mask_token_id=tok.mask_token_id)
    want = {f"model.model.layers.{i}.{part}.{p}" for i in range(2) for part, p in _where(PROJ)}
    assert _default_targets(model) == want


def test_default_targets_diffusion_gemma_text_layers_only(tok):
    """Its MoE experts are fused 3-D weights (no Linear): attention + dense MLP of every text layer."""
    _, _, model = gemma(tok)
    got = {
        n
        for n, _ in model.named_modules()
        if n.endswith(tuple(PROJ)) and hasattr(model.get_submodule(n), "lora_A")
    }
    scopes = ("model.decoder.layers.", "model.encoder.language_model.layers.")
    assert got and all(n.startswith(scopes) for n in got)
    assert {n.rpartition(".")[2] for n in got} == set(PROJ)
    assert not any("expert" in n or "router" in n for n in got)


def test_default_targets_qwen3_moe_leave_experts_and_router_frozen():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                         num_experts_per_tok=2, head_dim=8)  # fmt: skip
    model = Qwen3MoeForCausalLM(cfg)
    want = {
        f"model.layers.{i}.self_attn.{p}" for i in range(2) for p in ("q_proj", "k_proj", "v_proj", "o_proj")
    }
    assert _default_targets(model) == want


class _Named(torch.nn.Module):
    """A stand-in with a remote-code family's module names (LLaDA, LLaDA2 are not in transformers; the
    target choice reads only `config.model_type` and the module tree)."""

    def __init__(self, model_type: str, linears: list[str]):
        super().__init__()
        self.config = type("Config", (), {"model_type": model_type})()
        for name in linears:
            *path, leaf = name.split(".")
            parent = self
            for part in path:
                if not hasattr(parent, part):
                    parent.add_module(part, torch.nn.Module())
                parent = getattr(parent, part)
            parent.add_module(leaf, torch.nn.Linear(4, 4))


def test_default_targets_llada_not_its_lm_head():
    """LLaDA's head `model.transformer.ff_out` shares its name with each block's MLP output."""
    block = ("q_proj", "k_proj", "v_proj", "attn_out", "ff_proj", "up_proj", "ff_out")
    blocks = [f"model.transformer.blocks.{i}.{p}" for i in range(2) for p in block]
    model = _Named("llada", [*blocks, "model.transformer.ff_out"])
    assert _default_targets(model) == set(blocks)


def test_default_targets_llada2_moe_keep_routed_experts_frozen():
    attn = [f"model.layers.{i}.attention.{p}" for i in range(2) for p in ("query_key_value", "dense")]
    dense_mlp = [f"model.layers.0.mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj")]  # first_k_dense
    shared = [f"model.layers.1.mlp.shared_experts.{p}" for p in ("gate_proj", "up_proj", "down_proj")]
    experts = [
        f"model.layers.1.mlp.experts.{e}.{p}" for e in range(4) for p in ("gate_proj", "up_proj", "down_proj")
    ]
    model = _Named("llada2_moe", [*attn, *dense_mlp, *shared, *experts, "model.layers.1.mlp.gate", "lm_head"])
    assert _default_targets(model) == {*attn, *dense_mlp, *shared}
    # an explicit choice is the user's: experts included when named
    explicit = lora_target_modules(model, lora_settings(target_modules=["experts.0.up_proj"]).peft)
    assert explicit == ["model.layers.1.mlp.experts.0.up_proj"]
