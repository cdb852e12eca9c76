"""The export's model card (README.md, HF layout) and the `dllm` block of config.json /
generation_config.json: written by `Strategy.export`, read back by `generate` (default sampler)."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from transformers import AutoConfig, GenerationConfig, Qwen3Config, Qwen3ForCausalLM

from dllmflow.cli import main
from dllmflow.data.tokenizer import train_bpe_tokenizer
from dllmflow.diffusion.strategies import build_strategy
from dllmflow.inference.generate import resolve_default_sampler
from dllmflow.models.model_card import (
    EVALS_BEGIN,
    README,
    default_sampler,
    read_dllm_block,
    update_model_card,
)
from dllmflow.settings import load_settings


def front_matter(text: str) -> dict:
    assert text.startswith("---\n")
    return yaml.safe_load(text.split("---\n")[1])


@pytest.fixture(scope="module")
def tok():
    return train_bpe_tokenizer(
        ["What is 2 + 3? The answer is 5. #### 5"] * 5, 300, "<mask>", "<pad>", "<eos>"
    )


def tiny_export(tok, out, **overrides):
    """A tiny Qwen3 exported by the mode's strategy (what the trainer's exporter calls)."""
    settings = load_settings(**{"name": "tiny_card", **overrides})
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=16, intermediate_size=64)  # fmt: skip
    model = Qwen3ForCausalLM(cfg)
    strategy = build_strategy(settings)
    strategy.mask_token_id = tok.mask_token_id  # what `setup` resolves
    strategy.export(model, model.state_dict(), tok, out)
    settings.write_json(out / "settings.json")  # the trainer's exporter copies it in
    return settings


def test_export_carries_card_and_dllm_block(tok, tmp_path):
    out = tmp_path / "export"
    tiny_export(tok, out, **{"dllm.mode": "scdd", "dllm.vocab_size": len(tok)})
    card = (out / README).read_text()
    meta = front_matter(card)
    assert meta["library_name"] == "transformers" and meta["pipeline_tag"] == "text-generation"
    assert meta["tags"][:3] == ["dllm", "diffusion", "scdd"]
    assert meta["dllm"]["mode"] == "scdd" and meta["dllm"]["default_sampler"] == "scdd"
    assert "data_content_hash" in meta["dllm"]  # None here: no prepared data
    assert "base_model" not in meta  # random init: no hub id to name
    assert "dllmflow generate --checkpoint PATH --sampler scdd" in card
    assert "load_for_generation" in card and EVALS_BEGIN in card

    config = json.loads((out / "config.json").read_text())
    assert config["dllm"]["mode"] == "scdd" and config["dllm"]["default_sampler"] == "scdd"
    assert config["dllm"]["mask_token_id"] == tok.mask_token_id
    assert config["dllm"]["sampler_settings"]["max_new_tokens"] == 128  # eval.max_new_tokens
    assert json.loads((out / "generation_config.json").read_text())["dllm"] == config["dllm"]
    # transformers still loads both (the block becomes a plain attribute)
    assert AutoConfig.from_pretrained(out).dllm["mode"] == "scdd"
    GenerationConfig.from_pretrained(out)
    assert default_sampler(out) == "scdd" == resolve_default_sampler(out)


def test_hub_base_model_and_dataset_in_front_matter(tok, tmp_path):
    (tmp_path / "prepared").mkdir()
    (tmp_path / "prepared" / "manifest.json").write_text(json.dumps({"content_hash": "ab" * 32}))
    settings = load_settings(**{"dataset.prepared_dir": str(tmp_path / "prepared"),
                                "dataset.path_or_dataset_id": "openai/gsm8k",
                                "model.pretrained_model_name_or_path": "HuggingFaceTB/SmolLM2-135M"})  # fmt: skip
    from dllmflow.diffusion.strategies.base import export_facts
    from dllmflow.models.model_card import render_card

    meta = front_matter(render_card(export_facts(settings, 5)))
    assert meta["base_model"] == "HuggingFaceTB/SmolLM2-135M" and meta["datasets"] == ["openai/gsm8k"]
    assert meta["dllm"] == {"mode": "mdlm", "default_sampler": "llada", "data_content_hash": "ab" * 32}


def test_update_model_card_with_evaluations(tok, tmp_path):
    out = tmp_path / "export"
    tiny_export(tok, out)
    result = {"metrics": {"exact_match_flexible": 0.25, "num_examples": 8}, "protocol": {"sampler": "llada"}}
    update_model_card(out, {"llada": result})
    update_model_card(out, {"llada": result})  # idempotent: the section is replaced, not appended
    card = (out / README).read_text()
    assert card.count("| `llada` | exact_match_flexible | 0.25 |") == 1
    assert card.count("## Evaluation") == 1 and "Not evaluated" not in card
    front_matter(card)  # still a valid card


def test_generate_without_sampler_uses_the_export_default(tok, tmp_path, capsys):
    out = tmp_path / "export"
    tiny_export(tok, out, **{"dllm.mode": "scdd", "dllm.vocab_size": len(tok)})
    rc = main(["generate", "--checkpoint", str(out), "--prompt", "What is 2 + 3?", "--raw",
               "--max-new-tokens", "4", "--steps", "2"])  # fmt: skip
    assert rc == 0
    assert "[scdd]" in capsys.readouterr().err


def test_default_sampler_falls_back_to_the_mode(tok, tmp_path):
    out = tmp_path / "export"
    tiny_export(tok, out, **{"dllm.mode": "hybrid"})
    for name in ("config.json", "generation_config.json"):  # an export from before the block
        data = json.loads((out / name).read_text())
        data.pop("dllm")
        (out / name).write_text(json.dumps(data))
    assert read_dllm_block(out) is None and default_sampler(out) is None
    assert resolve_default_sampler(out) == "nemotron"  # MODES["hybrid"].samplers[0]
    (out / "settings.json").unlink()
    assert resolve_default_sampler(out) == "llada"  # nothing recorded: the old default
