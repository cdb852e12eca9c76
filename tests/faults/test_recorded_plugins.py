"""A checkpoint's settings.json cannot make this process import code: its `plugins` list is data.

Settings read back from a checkpoint, an export or a registered model (`load_settings_json`,
`runs.recorded_settings`, generate's loader, the default-sampler lookup) keep `plugins` as recorded and
import nothing; plugins are imported only from the caller's own recipe / overrides, and by the torchrun
entry (`import_plugins=True`) from the settings.json its own launcher wrote. The marker module below
writes a file when imported: the file's absence is the proof.
"""

from __future__ import annotations

import json
import sys
import uuid
from pathlib import Path

import pytest

from dllmflow.errors import UserError
from dllmflow.runs import recorded_settings
from dllmflow.settings import load_settings, load_settings_json

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def marker(tmp_path, monkeypatch) -> tuple[str, Path]:
    """(module name, the file it writes when imported), the module on sys.path, never imported yet."""
    name = f"dllmflow_marker_{uuid.uuid4().hex[:8]}"
    trace = tmp_path / "imported.txt"
    pkg = tmp_path / "plugins"
    pkg.mkdir()
    (pkg / f"{name}.py").write_text(f"from pathlib import Path\nPath({str(trace)!r}).write_text('ran')\n")
    monkeypatch.syspath_prepend(str(pkg))
    yield name, trace
    sys.modules.pop(name, None)


def _checkpoint(tmp_path: Path, plugin: str) -> Path:
    """An export-shaped dir: config.json and a settings.json whose `plugins` names the marker."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    load_settings(ROOT / "params" / "tiny_mdlm.yaml").write_json(ckpt / "settings.json")
    data = json.loads((ckpt / "settings.json").read_text())
    data["plugins"] = [plugin]
    (ckpt / "settings.json").write_text(json.dumps(data))
    (ckpt / "config.json").write_text(
        json.dumps({"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]})
    )
    return ckpt


def _not_imported(name: str, trace: Path) -> None:
    assert not trace.exists() and name not in sys.modules, (
        f"{name} was imported from a recorded settings.json"
    )


def test_reading_a_checkpoints_settings_imports_nothing(marker, tmp_path):
    name, trace = marker
    ckpt = _checkpoint(tmp_path, name)
    settings = load_settings_json(ckpt / "settings.json")
    assert settings.plugins == [name]  # kept as recorded
    assert recorded_settings(ckpt).plugins == [name]
    _not_imported(name, trace)


def test_generate_and_default_sampler_paths_import_nothing(marker, tmp_path):
    from dllmflow.inference.generate import load_for_generation, resolve_default_sampler

    name, trace = marker
    ckpt = _checkpoint(tmp_path, name)
    assert resolve_default_sampler(ckpt) == "llada"  # read from the recorded mdlm settings
    with pytest.raises(UserError):  # no tokenizer, no weights: refused after the settings were read
        load_for_generation(ckpt, device="cpu")
    _not_imported(name, trace)


def test_an_unknown_recorded_plugin_mode_names_the_plugins(tmp_path):
    ckpt = _checkpoint(tmp_path, "some_plugin_pkg")
    data = json.loads((ckpt / "settings.json").read_text())
    data["dllm"]["mode"] = "plugin_mode"
    (ckpt / "settings.json").write_text(json.dumps(data))
    with pytest.raises(
        UserError, match=r"unknown mode 'plugin_mode'.*plugins \['some_plugin_pkg'\] are not imported"
    ):
        load_settings_json(ckpt / "settings.json")


def test_the_callers_recipe_and_the_torchrun_entry_do_import(marker, tmp_path):
    """The positive control: the same marker is imported where plugins are allowed to come from."""
    name, trace = marker
    ckpt = _checkpoint(tmp_path, name)
    load_settings_json(ckpt / "settings.json", import_plugins=True)  # training.main, its launcher's file
    assert trace.read_text() == "ran"
    trace.unlink()
    sys.modules.pop(name)
    load_settings(ROOT / "params" / "tiny_mdlm.yaml", plugins=[name])  # the caller's own recipe
    assert trace.read_text() == "ran"


def test_coerce_of_a_dict_imports_nothing_unless_asked(marker):
    """`Settings.coerce(dict)` (a flow step's artifact, any dict a caller hands in) and `model_validate`
    keep `plugins` and user reward modules as data: importing is one switch, default off; only the
    caller's own recipe load and the torchrun entry turn it on."""
    from dllmflow.settings import Settings, importing_plugins

    name, trace = marker
    recorded = {"plugins": [name]}
    assert Settings.coerce(recorded).plugins == [name]
    assert Settings.model_validate(recorded).plugins == [name]
    assert Settings.coerce({"rl": {"rewards": [f"{name}:reward"]}}).rl.rewards == [f"{name}:reward"]
    assert not trace.exists()
    with importing_plugins():
        Settings.model_validate(recorded)
    assert trace.exists()  # the switch is what imports


def test_coerce_opts_in_for_a_dict_its_caller_wrote(marker):
    from dllmflow.settings import Settings

    name, trace = marker
    Settings.coerce({"plugins": [name]}, import_plugins=True)
    assert trace.exists()
