"""Names that become paths or MLflow names (`name`, `registry.model_name`) are validated at load time:
no path separators, no '.'/'..', not empty, nothing MLflow rejects; the message names the field and
the fix. Every recipe's names pass."""

from __future__ import annotations

from pathlib import Path

import pytest

from dllmflow.settings import SettingsError, load_settings
from dllmflow.settings.loader import read_yaml

ROOT = Path(__file__).resolve().parents[2]
BAD = ["", ".", "..", "../x", "a/b", "a\\b", ".hidden", "a:b", "a%b", "a@champion", " ", "a b"]


@pytest.mark.parametrize("value", BAD)
@pytest.mark.parametrize("field", ["name", "registry.model_name"])
def test_unsafe_names_rejected(field, value):
    with pytest.raises(SettingsError, match=rf"{field}: .* is not a safe name: use letters, digits"):
        load_settings(**{field: value})


@pytest.mark.parametrize("value", ["tiny", "tiny_mdlm", "qwen3-8b-idlm", "run.v2", "_x", "A1"])
def test_safe_names_pass(value):
    s = load_settings(name=value, registry={"model_name": value})
    assert s.resolved_run_dir == Path("runs") / value and s.registry.model_name == value


def test_experiment_name_not_empty():
    with pytest.raises(SettingsError, match=r"registry\.experiment_name"):
        load_settings(registry={"experiment_name": ""})
    # MLflow allows '/' in experiment names (workspace paths): still accepted
    assert load_settings(registry={"experiment_name": "/Users/me/dllm"}).registry.experiment_name


def test_mlflow_accepts_every_recipe_model_name():
    from mlflow.utils.validation import _validate_model_name

    for path in sorted((ROOT / "params").glob("*.yaml")):
        data = read_yaml(path)
        name = data.get("registry", {}).get("model_name")
        if name:
            _validate_model_name(name)
