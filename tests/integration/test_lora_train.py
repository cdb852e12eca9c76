"""LoRA through the real trainer, every mode's tiny recipe (8 GSM8K rows, seq 128, batch 2, `peft:` on).

* each mode trains (loss falls on the small overfit set) and only the adapters move: every base weight in
  the final DCP checkpoint is bit-identical to the initial build, the adapters are not;
* 2 + resume 2 steps == 4 steps (losses and adapter weights), via the trainer's fault injection;
* the merged consolidated export generates the same text (llada, greedy) as base + adapter (`--adapter`);
* DDP and FSDP2 on 2 processes give the 1-process losses with adapters.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from dllmflow.models.lora import ADAPTER_DIR, LORA_INFO, apply_lora
from dllmflow.runs import read_metrics
from dllmflow.settings import load_settings

ROOT = Path(__file__).resolve().parents[2]
MODES = ("mdlm", "scdd", "hybrid", "block_diffusion", "dflash", "idlm")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def prep(tmp_path_factory) -> Path:
    from dllmflow.data.prepare import prepare

    out = tmp_path_factory.mktemp("lora-prepared") / "tiny"
    prepare(load_settings(ROOT / "params" / "tiny_mdlm.yaml", **_data(out)))
    return out


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("lora-target") / "tiny_qwen3"


def _data(prep: Path) -> dict:
    return {"dataset": {"limit": 8, "seq_length": 128, "prepared_dir": str(prep)}}


def lora_settings(mode: str, prep: Path, target: Path, steps: int = 16, **sections):
    cfg = {
        **_data(prep),
        "train": {"max_steps": steps, "global_batch_size": 2, "local_batch_size": 2, "lr": 3e-2,
                  "warmup_steps": 0, "lr_schedule": "constant", "seed": 0},
        "checkpoint": {"every_steps": steps, "keep_last": 1},
        "peft": {"r": 8, "alpha": 16},
    }  # fmt: skip
    if mode == "dflash":
        cfg["dflash"] = {"target_model_id": f"tiny:{target}"}
    for name, values in sections.items():
        cfg[name] = {**cfg.get(name, {}), **values}
    return load_settings(ROOT / "params" / f"tiny_{mode}.yaml", **cfg)


def initial_and_trained(settings, checkpoint: Path):
    """(strategy, model, state the trainer started from, the final DCP checkpoint's state), rebuilt
    like the trainer does (same seed, same build, same adapters)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    from dllmflow.data.tokenizer import load_tokenizer
    from dllmflow.diffusion.modes import build_mode_model
    from dllmflow.diffusion.strategies import build_strategy

    tokenizer = load_tokenizer(settings.dataset.prepared_dir)
    torch.manual_seed(settings.train.seed)
    strategy = build_strategy(settings)
    model = apply_lora(build_mode_model(settings, tokenizer), settings)
    strategy.setup(model, tokenizer, torch.device("cpu"))
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    state = get_model_state_dict(model)
    dcp.load(state, checkpoint_id=str(checkpoint / "model"))
    set_model_state_dict(model, state)
    return strategy, model, tokenizer, initial, {k: v.clone() for k, v in model.state_dict().items()}


def fixed_noise_loss(strategy, model, tokenizer, settings, state) -> float:
    """The training loss over the whole (tiny) training set under one fixed corruption: the per-step
    losses are too noisy (a fresh t per step) to show learning in 16 steps."""
    from dllmflow.data.collate import DLLMCollator
    from dllmflow.data.dataset import PreparedDataset
    from dllmflow.diffusion.seeding import sample_seed

    model.load_state_dict(state)
    rows = PreparedDataset(settings.dataset.prepared_dir, "train")
    batch = DLLMCollator.from_settings(settings, tokenizer)([rows[i] for i in range(len(rows))])
    batch.pop("global_index", None)
    batch.update(strategy.corrupt(batch, [sample_seed(123, 0, i) for i in range(len(rows))]))
    with torch.no_grad():
        out = strategy.loss(model.train(), batch)
        counts = strategy.token_counts(batch)
        return float(sum(out.weight(k) * v / max(float(counts[k]), 1.0) for k, v in out.sums.items()))


@pytest.mark.parametrize("mode", MODES)
def test_lora_trains_only_the_adapters(mode, prep, target, tmp_path):
    from dllmflow.training.trainer import run_training

    settings = lora_settings(mode, prep, target)
    result = run_training(settings, tmp_path / "run")
    losses = result.losses
    assert len(losses) == 16 and all(math.isfinite(x) for x in losses), losses

    strategy, model, tokenizer, initial, trained = initial_and_trained(settings, result.checkpoint_dir)
    before = fixed_noise_loss(strategy, model, tokenizer, settings, initial)
    after = fixed_noise_loss(strategy, model, tokenizer, settings, trained)
    assert after < 0.99 * before, (before, after, losses)  # a random 1-layer DFlash draft learns slowest
    base = [k for k in initial if ".lora_" not in k]
    assert base and all(torch.equal(initial[k], trained[k]) for k in base)
    adapters = [k for k in initial if ".lora_B." in k]
    assert adapters and all(not torch.equal(initial[k], trained[k]) for k in adapters)

    out = result.consolidated_dir
    assert (out / "config.json").is_file() and (out / LORA_INFO).is_file()
    assert (out / ADAPTER_DIR / "adapter_config.json").is_file()
    assert (out / ADAPTER_DIR / "adapter_model.safetensors").is_file()


def test_resume_reproduces_the_uninterrupted_run(prep, target, tmp_path, monkeypatch):
    from safetensors.torch import load_file

    from _plugins.fault_hooks import FailAfterStep
    from dllmflow.training.trainer import run_training

    settings = lora_settings("mdlm", prep, target, steps=4, checkpoint={"every_steps": 2, "keep_last": 2})
    straight = run_training(settings, tmp_path / "straight")
    with pytest.raises(RuntimeError, match="injected failure after step 2"):
        run_training(settings, tmp_path / "resumed", hooks=[FailAfterStep(2)])
    resumed = run_training(settings, tmp_path / "resumed", resume=True)
    assert resumed.losses == straight.losses[2:]
    losses = [r["loss"] for r in read_metrics(resumed.metrics_path)]
    assert losses == straight.losses
    a = load_file(str(straight.consolidated_dir / ADAPTER_DIR / "adapter_model.safetensors"))
    b = load_file(str(resumed.consolidated_dir / ADAPTER_DIR / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_merged_export_generates_like_base_plus_adapter(prep, target, tmp_path):
    from dllmflow.data.tokenizer import load_tokenizer
    from dllmflow.diffusion.samplers import SAMPLERS
    from dllmflow.diffusion.samplers.base import build_sampler_config
    from dllmflow.inference.generate import encode_prompt, load_for_generation
    from dllmflow.models.build import build_model
    from dllmflow.training.trainer import run_training

    settings = lora_settings("mdlm", prep, target, steps=8)
    merged_dir = run_training(settings, tmp_path / "run").consolidated_dir
    # the base the adapter was trained on: the trainer's seeded tiny build, saved as an HF dir
    tokenizer = load_tokenizer(prep)
    torch.manual_seed(settings.train.seed)
    build_model(settings, tokenizer).save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")

    config = build_sampler_config(
        "llada", {"steps": 16, "max_new_tokens": 16, "block_size": 16, "temperature": 0.0}
    )

    def generate(path, adapter=None):
        model, tok, _ = load_for_generation(path, device="cpu", adapter=adapter)
        ids = [encode_prompt(tok, "Tom has 3 apples and buys 4 more. How many?")]
        torch.manual_seed(0)
        with torch.no_grad():
            logits = model(input_ids=torch.tensor(ids)).logits
        sampler = SAMPLERS["llada"](model, tok, config, mask_id=model.config.mask_token_id)
        return sampler.generate(ids).sequences, logits

    merged, merged_logits = generate(merged_dir)
    with_adapter, adapter_logits = generate(tmp_path / "base", adapter=merged_dir / ADAPTER_DIR)
    _, base_logits = generate(tmp_path / "base")
    assert not torch.allclose(base_logits, merged_logits, atol=1e-3)  # the adapter did something
    torch.testing.assert_close(adapter_logits, merged_logits, atol=1e-4, rtol=1e-4)
    assert merged == with_adapter


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_two_processes_match_one(strategy, prep, target, tmp_path):
    from dllmflow.training.launch import launch
    from dllmflow.training.trainer import run_training

    def settings(**sections):
        return lora_settings(
            "mdlm", prep, target, steps=3, train={"global_batch_size": 4, "local_batch_size": 2}, **sections
        )

    single = run_training(settings(), tmp_path / "one")
    two = settings(distributed={"strategy": strategy}, launch={"nproc_per_node": 2})
    assert launch(two, run_dir=tmp_path / "two").state == "SUCCEEDED"
    got = [r["loss"] for r in read_metrics(tmp_path / "two" / "metrics.jsonl")]
    assert got == pytest.approx(single.losses, rel=1e-5)
    assert (tmp_path / "two" / "checkpoints" / "LATEST" / "model" / "consolidated" / ADAPTER_DIR).is_dir()
