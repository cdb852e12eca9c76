"""Settings: precedence (overrides > env > YAML > defaults), every validation rule, error messages that
name the dotted field and its origin, every YAML under params/ loads, settings.json round trip."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from dllmflow.settings import MODE_NAMES, Settings, SettingsError, load_settings, load_settings_json

ROOT = Path(__file__).resolve().parents[2]
PARAMS = sorted((ROOT / "params").glob("*.yaml"))


def write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


# ---- precedence ------------------------------------------------------------------------------------


def test_defaults_without_files():
    s = load_settings()
    assert s.dllm.mode == "mdlm" and s.dllm.eps == 1e-3 and s.train.seed == 42
    assert s.model.tiny is not None


def test_later_yaml_overrides_earlier_deep_merged(tmp_path):
    a = write(tmp_path, "a.yaml", "train: {lr: 0.1, max_steps: 7}\ndllm: {mode: mdlm, eps: 0.01}\n")
    b = write(tmp_path, "b.yaml", "train: {lr: 0.2}\n")
    s = load_settings(a, b)
    assert s.train.lr == 0.2 and s.train.max_steps == 7 and s.dllm.eps == 0.01


def test_env_beats_yaml_and_overrides_beat_env(tmp_path, monkeypatch):
    a = write(tmp_path, "a.yaml", "train: {lr: 0.1, max_steps: 7}\n")
    monkeypatch.setenv("DLLMFLOW_TRAIN__LR", "0.3")
    s = load_settings(a)
    assert s.train.lr == 0.3 and s.train.max_steps == 7
    assert load_settings(a, train={"lr": 0.5}).train.lr == 0.5
    assert load_settings(a, **{"train.lr": 0.6}).train.lr == 0.6


def test_env_can_switch_mode_and_keep_yaml_fields(tmp_path, monkeypatch):
    a = write(tmp_path, "a.yaml", "dllm: {mode: mdlm, eps: 0.01}\n")
    monkeypatch.setenv("DLLMFLOW_DLLM__MODE", "hybrid")
    s = load_settings(a)
    assert s.dllm.mode == "hybrid" and s.dllm.eps == 0.01 and s.dllm.ar_loss_alpha == 1.0


def test_settings_are_frozen():
    s = load_settings()
    from pydantic import ValidationError

    with pytest.raises(ValidationError):
        s.train.lr = 1.0  # type: ignore[misc]


def test_json_round_trip_ignores_env(tmp_path, monkeypatch):
    s = load_settings(train={"lr": 0.25})
    path = s.write_json(tmp_path / "run" / "settings.json")
    monkeypatch.setenv("DLLMFLOW_TRAIN__LR", "0.9")
    back = load_settings_json(path)
    assert back == s and back.train.lr == 0.25
    assert json.loads(path.read_text())["train"]["lr"] == 0.25
    assert not list(path.parent.glob("*.tmp"))


# ---- every shipped recipe ----------------------------------------------------------------------------


def test_there_are_recipes():
    assert any(p.name == "tiny_mdlm.yaml" for p in PARAMS)


def _leaves(data: dict, prefix: str = "") -> dict:
    """Dotted leaf keys of a nested dict, written here (not the loader's own flattening)."""
    out = {}
    for k, v in data.items():
        if isinstance(v, dict) and v:
            out.update(_leaves(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


@pytest.mark.parametrize("path", PARAMS, ids=[p.name for p in PARAMS])
def test_every_params_yaml_loads_with_every_value_it_sets(path):
    import yaml

    raw = yaml.safe_load(path.read_text())
    s = load_settings(path)
    assert s.dllm.mode == raw.get("dllm", {}).get("mode", "mdlm") and s.dllm.mode in MODE_NAMES
    flat = s.flat()
    for key, value in _leaves(raw).items():
        assert key in flat, f"{path.name}: {key} vanished"
        got = flat[key]
        got = list(got) if isinstance(got, tuple) else got
        assert got == value or (isinstance(value, (int, float)) and got == pytest.approx(value)), (
            f"{path.name}: {key} = {got!r}, the YAML says {value!r}"
        )


# ---- validation rules, each with the dotted path and the origin in the message ----------------------


def _err(tmp_path, text: str) -> str:
    f = write(tmp_path, "bad.yaml", text)
    with pytest.raises(SettingsError) as e:
        load_settings(f)
    msg = str(e.value)
    assert "bad.yaml" in msg, msg
    return msg


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("train: {lrr: 1}\n", "train.lrr"),  # unknown key
        ("dllm: {mode: mdlm, vocab_size: 5}\n", "dllm.vocab_size"),  # field of another mode
        ("train: {lr: fast}\n", "train.lr"),  # wrong type
        ("dllm: {mode: scdd}\n", "dllm.vocab_size"),  # scdd needs vocab_size
        ("dllm: {mode: scdd, vocab_size: 8, uniform_ratio: 1.0}\n", "dllm.uniform_ratio"),
        ("dllm: {mode: scdd, vocab_size: 8, uniform_ratio: -0.1}\n", "dllm.uniform_ratio"),
        ("dllm: {mode: scdd, vocab_size: 8, schedule_peak: 0.0}\n", "dllm.schedule_peak"),
        ("dllm: {mode: scdd, vocab_size: 8, schedule_peak: 1.0}\n", "dllm.schedule_peak"),
        ("dllm: {mode: scdd, vocab_size: 8, num_timesteps: 1}\n", "dllm.num_timesteps"),
        ("dllm: {mode: scdd, vocab_size: 8, chunk_size: 0}\n", "dllm.chunk_size"),
        ("dllm: {mode: block_diffusion}\n", "dllm.vocab_size"),
        ("dllm: {mode: idlm}\n", "dllm.mask_token_id"),
        ("dllm: {mode: dflash}\ndflash: {block_size: 16}\n", "dflash.target_model_id"),
        (
            "dllm: {mode: dflash}\ndflash: {target_model_id: t, attention_backend: flash}\n",
            "dflash.attention_backend",
        ),
        ("dllm: {mode: dflash}\ndflash: {target_model_id: t, block_size: 1}\n", "dflash"),
        ("dllm: {mode: diffusion}\n", "dllm"),  # unknown mode
        ("dataset: {unshifted: false}\n", "dataset"),
        ("dllm: {mode: mdlm, eps: 0}\n", "dllm.eps"),
        ("model: {tiny: {hidden_size: 10, num_attention_heads: 4}}\n", "model.tiny"),
    ],
)
def test_rule_violations_name_field_and_file(tmp_path, text, field):
    msg = _err(tmp_path, text)
    assert field in msg, msg


def test_removed_dataset_unshifted(tmp_path):
    """Its one legal value (true) is what earlier settings.json files record: dropped; false is refused."""
    s = load_settings(write(tmp_path, "t.yaml", "dataset: {unshifted: true}\n"))
    assert "unshifted" not in s.to_dict()["dataset"]
    msg = _err(tmp_path, "dataset: {unshifted: false}\n")
    assert "dataset.unshifted was removed" in msg and "delete the key" in msg


def test_dflash_mode_without_section_is_refused(tmp_path):
    f = write(tmp_path, "d.yaml", "dllm: {mode: dflash}\n")
    with pytest.raises(SettingsError, match="dflash"):
        load_settings(f)


def test_batch_divisibility(tmp_path):
    f = write(tmp_path, "b.yaml", "train: {global_batch_size: 6, local_batch_size: 4}\n")
    with pytest.raises(SettingsError, match="global_batch_size"):
        load_settings(f)


def test_valid_modes_all_validate():
    base = {"mask_token_id": 3}
    assert load_settings(dllm={"mode": "mdlm", **base}).dllm.mode == "mdlm"
    assert load_settings(dllm={"mode": "scdd", "vocab_size": 64, **base}).dllm.chunk_size == 1024
    assert load_settings(dllm={"mode": "scdd", "vocab_size": 64, "chunk_size": None}).dllm.chunk_size is None
    assert load_settings(dllm={"mode": "hybrid", "block_size": 4}).dllm.half_life_ratio == 0.25
    assert load_settings(dllm={"mode": "block_diffusion", "vocab_size": 64}).dllm.block_size == 256
    d = load_settings(dllm={"mode": "dflash"}, dflash={"target_model_id": "x"})
    assert d.dflash.attention_backend == "sdpa" and d.dflash.overlap_anchors is True
    assert load_settings(dllm={"mode": "idlm", **base}).dllm.clean_loss_weight == 0.2


def test_env_origin_is_named(monkeypatch):
    monkeypatch.setenv("DLLMFLOW_TRAIN__LR", "not-a-number")
    with pytest.raises(SettingsError) as e:
        load_settings()
    assert "train.lr" in str(e.value) and "DLLMFLOW_TRAIN__LR" in str(e.value)


def test_unknown_env_key_is_refused(monkeypatch):
    monkeypatch.setenv("DLLMFLOW_TRAIN__LRR", "1")
    with pytest.raises(SettingsError, match="train.lrr"):
        load_settings()


@pytest.mark.parametrize(
    ("text", "needle"),
    [("train: [1, 2\n", "invalid YAML"), ("- a\n- b\n", "mapping")],
)
def test_invalid_yaml(tmp_path, text, needle):
    f = write(tmp_path, "broken.yaml", text)
    with pytest.raises(SettingsError) as e:
        load_settings(f)
    assert needle in str(e.value) and "broken.yaml" in str(e.value)


def test_missing_file(tmp_path):
    with pytest.raises(SettingsError, match="not found"):
        load_settings(tmp_path / "nope.yaml")


def test_flat_view_for_mlflow_params():
    s = load_settings(train={"lr": 0.25, "betas": [0.8, 0.9]}, dllm={"mode": "hybrid", "block_size": 8})
    flat = s.flat()
    assert flat["dllm.mode"] == "hybrid" and flat["train.lr"] == 0.25 and flat["dllm.block_size"] == 8
    assert list(flat["train.betas"]) == [0.8, 0.9]
    # one entry per leaf of the nested dump, nothing else, no nested dicts left
    assert flat == _leaves(s.to_dict())
    assert not any(isinstance(v, dict) and v for v in flat.values())
    assert "train" not in flat and "dllm.ar_loss_alpha" in flat


def test_settings_is_the_root_type():
    assert isinstance(load_settings(), Settings)


def test_coerce_validates_dicts_once_and_with_run_dir_records_where_a_run_writes(tmp_path, monkeypatch):
    s = load_settings(name="x")
    assert Settings.coerce(s) is s  # already typed: no second validation
    assert Settings.coerce(s.to_dict()) == s
    with pytest.raises(SettingsError, match="train.lrr"):
        Settings.coerce({"train": {"lrr": 1}})
    monkeypatch.chdir(tmp_path)
    assert s.with_run_dir(tmp_path / "runs" / "x") is s  # the default run dir, spelled absolutely
    moved = s.with_run_dir("elsewhere")
    assert moved.run_dir == "elsewhere" and moved.resolved_run_dir == Path("elsewhere")


def test_untrained_baseline_is_on_in_the_demo_and_the_a2d_recipes():
    # The demo recipe turns it on for its tiny model; a pretrained recipe measures the converted model
    # before fine-tuning the same way (and the AR base beside it: tests/unit/test_ar_baseline.py).
    assert load_settings(ROOT / "params" / "tiny_addition.yaml").eval.untrained_baseline is True
    demo = load_settings(ROOT / "params" / "tiny_addition.yaml").eval  # the AR control's before and after
    assert demo.ar_baseline is True and demo.ar_control.enabled and demo.ar_control.steps is None
    assert load_settings(ROOT / "params" / "smollm2_idlm_lora.yaml").eval.untrained_baseline is True
    with pytest.raises(SettingsError, match="eval.ar_baseline"):
        load_settings(eval={"ar_baseline": "sometimes"})


def test_gpu_recipes_train_in_bfloat16():
    """A recipe asking for GPUs sets the FSDP2 mixed-precision policy (bf16 compute and all-gathers);
    without it FSDP2 all-gathers fp32 parameters."""
    gpu = [p for p in PARAMS if load_settings(p).launch.resources.gpu > 0]
    assert len(gpu) >= 7, [p.name for p in gpu]
    for path in gpu:
        assert load_settings(path).train.dtype == "bfloat16", path.name


def test_removed_autocast_dtype_is_refused_naming_train_dtype(tmp_path):
    recipe = tmp_path / "old.yaml"
    recipe.write_text("train:\n  autocast_dtype: bfloat16\n")
    with pytest.raises(SettingsError) as err:
        load_settings(recipe)
    message = str(err.value)
    assert "\n" not in message and "train.autocast_dtype was removed: set train.dtype: bfloat16" in message


@pytest.mark.parametrize(
    ("section", "where"),
    [
        ({"cache": "full"}, "eval.cache"),
        ({"sweep": {}}, "eval.sweep: give at least one of threshold, cache, steps, block_size"),
        (
            {"sweep": {"threshold": [0.9, 0.9]}},
            "eval.sweep.threshold: must be a non-empty list without repeats",
        ),
        ({"sweep": {"threshold": [1.5]}}, "eval.sweep.threshold.0"),
        ({"sweep": {"cache": ["none", "full"]}}, "eval.sweep.cache.1"),
        ({"sweep": {"temperature": [0.0]}}, "eval.sweep.temperature"),
        ({"sweep": {"steps": list(range(1, 9)), "block_size": list(range(1, 10))}}, "72 points; at most 64"),
        ({"sweep_tolerance": 2}, "eval.sweep_tolerance"),
    ],
)
def test_eval_cache_and_sweep_are_validated_naming_the_field(section, where):
    with pytest.raises(SettingsError, match=re.escape(where)):
        load_settings(eval=section)


def test_eval_cache_and_sweep_defaults_and_axes():
    s = load_settings()
    assert s.eval.cache is None and s.eval.sweep is None and s.eval.sweep_tolerance == 0.01
    s = load_settings(eval={"cache": "dual", "sweep": {"steps": [64, 128], "threshold": [None, 0.9]}})
    assert s.eval.cache == "dual"
    assert s.eval.sweep.axes() == {"threshold": [None, 0.9], "steps": [64, 128]}  # SWEEP_KEYS order
    assert Settings.coerce(s.to_dict()) == s  # survives the flow's artifact round trip
