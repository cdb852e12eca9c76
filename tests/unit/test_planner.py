"""The memory planner against exact analytic counts on tiny configs (never wall-clock or RSS):
parameter counts equal `sum(p.numel())` of the eagerly built model, optimizer bytes = 8·trainable/world,
LoRA trainable counts equal peft's, bad world sizes and hub ids without a local config fail clearly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dllmflow.cli import main as cli_main
from dllmflow.diffusion.modes import MODES
from dllmflow.errors import UserError
from dllmflow.settings import load_settings
from dllmflow.training import planner


def _settings(recipe: str, tmp_path, **overrides):
    # no prepared tokenizer there: the planner's stand-in with tokenizer.train_vocab_size tokens
    return load_settings(
        f"params/{recipe}.yaml", **{"dataset.prepared_dir": str(tmp_path / "none"), **overrides}
    )


def _eager(settings):
    torch.manual_seed(0)
    return MODES[settings.dllm.mode].build_model(
        settings, planner.stand_in_tokenizer(settings.tokenizer, 512)
    )


@pytest.mark.parametrize("recipe", ["tiny_mdlm", "tiny_idlm", "tiny_hybrid"])
def test_param_count_equals_the_built_model(recipe, tmp_path):
    settings = _settings(recipe, tmp_path)
    count = planner.count_model(settings)
    model = _eager(settings)
    assert count.params == sum(p.numel() for p in model.parameters())
    assert count.trainable == sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert count.shape.vocab == 512 and count.shape.num_blocks == settings.model.tiny.num_hidden_layers


@pytest.mark.parametrize(("strategy", "world"), [("fsdp2", 2), ("ddp", 2), ("fsdp2", 1)])
def test_weights_grads_optimizer_bytes(strategy, world, tmp_path):
    settings = _settings(
        "tiny_mdlm", tmp_path, **{"distributed.strategy": strategy, "train.local_batch_size": 4}
    )
    plan = planner.plan_memory(settings, world_size=world)
    shard = world if strategy == "fsdp2" else 1
    assert plan.optimizer == -(-8 * plan.trainable // shard)
    assert plan.weights == -(-4 * plan.params // shard)
    assert plan.gradients == -(-4 * plan.trainable // shard)
    assert (plan.transient > 0) == (strategy == "fsdp2")
    assert plan.peak == plan.weights + plan.optimizer + max(plan.activations, plan.gradients) + plan.transient


def test_lora_trainable_count_equals_peft(tmp_path):
    from peft import LoraConfig, get_peft_model

    settings = _settings("tiny_mdlm_lora", tmp_path)
    count = planner.count_model(settings)
    cfg = settings.peft
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    peft_model = get_peft_model(
        _eager(settings),
        LoraConfig(r=cfg.r, lora_alpha=cfg.alpha, target_modules=cfg.target_modules or targets),
    )
    trainable, total = peft_model.get_nb_trainable_parameters()
    assert (count.trainable, count.params) == (trainable, total)
    plan = planner.plan_memory(settings, world_size=1)
    assert plan.optimizer == 8 * trainable and plan.gradients == 4 * trainable


def test_activation_formula_reference():
    # the bench's width: h 1024, 16 heads x 64, 8 kv heads, MLP 4096, vocab 32000, 4 blocks
    shape = planner.ModelShape(
        hidden=1024, intermediate=4096, q_dim=1024, kv_dim=512, num_blocks=4, vocab=32000
    )
    per_block = (4 * 1024 + 5 * 1024 + 5 * 512 + 4 * 4096) * 4
    assert planner.block_activation_bytes(shape, 4) == per_block
    assert planner.block_activation_bytes(shape, 2) == per_block // 2 + 2 * 1024 * 4
    head = 1024 * 4 + 32000 * 4  # embedding output + fp32 logits
    none = planner.activation_bytes(shape, 10, 4, "none", backward=False)
    assert none == 10 * (4 * per_block + head)
    full = planner.activation_bytes(shape, 10, 4, "full", backward=False)
    assert full == 10 * (4 * 1024 * 4 + head)  # block inputs only
    # a training step adds the logits' gradient and, under AC, the block recomputed in backward
    assert planner.activation_bytes(shape, 10, 4, "none") == none + 10 * 32000 * 4
    assert planner.activation_bytes(shape, 10, 4, "full") == full + 10 * (per_block + 32000 * 4)
    assert full < planner.activation_bytes(shape, 10, 4, "selective", backward=False) < none


def test_modes_scale_the_sequence(tmp_path):
    mdlm = planner.plan_memory(_settings("tiny_mdlm", tmp_path), world_size=1)
    idlm = planner.plan_memory(_settings("tiny_idlm", tmp_path), world_size=1)
    assert idlm.activations == 2 * mdlm.activations  # [x_t | x_0], same model and micro-batch


def test_bad_world_size_is_a_clear_error(tmp_path):
    settings = _settings("tiny_mdlm", tmp_path)  # global 8, local 8
    with pytest.raises(UserError, match="must be >= 1"):
        planner.plan_memory(settings, world_size=0)
    with pytest.raises(UserError, match=r"train.global_batch_size \(8\)"):
        planner.plan_memory(settings, world_size=3)
    assert cli_main(["plan", "--params", "params/tiny_mdlm.yaml", "--world-size", "0"]) == 2


def test_hub_id_without_local_config_fails_clearly(tmp_path):
    settings = _settings(
        "tiny_mdlm",
        tmp_path,
        model={"tiny": None, "pretrained_model_name_or_path": "nobody-xyz/not-cached-model"},
    )
    with pytest.raises(UserError, match="no local config.json"):
        planner.count_model(settings)


def test_config_only_dir_counts_the_skeleton(tmp_path, capsys):
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(
        vocab_size=600, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, tie_word_embeddings=False,
    )  # fmt: skip
    config.save_pretrained(tmp_path / "m")  # config.json only: no weights, no tokenizer
    settings = _settings(
        "tiny_mdlm", tmp_path, model={"tiny": None, "pretrained_model_name_or_path": str(tmp_path / "m")}
    )
    count = planner.count_model(settings)
    assert count.params == sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    assert any("not local" in n for n in count.notes)


RECIPES = sorted(p.stem for p in Path("params").glob("*.yaml"))


@pytest.mark.parametrize("recipe", RECIPES)
def test_plan_works_offline_for_every_recipe(recipe, tmp_path, monkeypatch):
    # a fresh HF cache: whatever the machine has cached must not be what makes it work
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    settings = _settings(recipe, tmp_path)
    plan = planner.plan_memory(settings)
    assert plan.params > 0 and plan.peak > plan.weights
    pretrained = settings.model.pretrained_model_name_or_path
    if pretrained and not Path(pretrained).is_dir():
        # the plan says where the config came from (shipped with dllmflow, here)
        assert any(n.startswith(f"config of {pretrained}: shipped ") for n in plan.notes), plan.notes


def test_shipped_qwen3_8b_counts_its_published_size(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    count = planner.count_model(_settings("qwen3_8b_idlm", tmp_path))
    # Qwen3-8B by hand: untied 151936 x 4096 embedding and head; 36 blocks of q (32x128), k/v (8x128),
    # o, SwiGLU 12288, two RMSNorms and the per-head q/k norms (128 each); the final norm
    h, v, i, q, kv, d = 4096, 151936, 12288, 32 * 128, 8 * 128, 128
    block = h * q + 2 * h * kv + q * h + 3 * h * i + 2 * h + 2 * d
    assert count.params == 2 * v * h + 36 * block + h == 8_190_735_360
    assert count.shape.num_blocks == 36


def test_shipped_configs_are_for_the_planner_only(tmp_path, monkeypatch):
    from dllmflow.models.shipped_configs import resolve_config, shipped_fallback

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(OSError):  # a training run never builds from a transcribed config
        resolve_config("Qwen/Qwen3-4B")
    with shipped_fallback() as sources:
        config = resolve_config("GSAI-ML/LLaDA-8B-Base", trust_remote_code=True)
    # LLaDA is remote code: a Llama stand-in of the same shapes, and the source says so
    assert (config.model_type, config.hidden_size, config.num_hidden_layers) == ("llama", 4096, 32)
    assert "stand-in" in sources["GSAI-ML/LLaDA-8B-Base"]
