"""MLflow registry on a real SQLite store and a real `mlflow server`: run logging, idempotent
registration, the champion gate, and loading `models:/<name>@champion` in a fresh process that has no
access to the training directories."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _services import mlflow_server_args

from dllmflow.common.net import free_port
from dllmflow.errors import UserError
from dllmflow.settings import load_settings
from dllmflow.tracking import mlflow_run, registry

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def consolidated(tmp_path_factory) -> Path:
    """A consolidated HF dir (tiny random model + the prepared tokenizer + settings.json), no training."""
    from dllmflow.data.prepare import prepare
    from dllmflow.data.tokenizer import load_tokenizer
    from dllmflow.models.build import build_model

    tmp = tmp_path_factory.mktemp("ckpt")
    settings = load_settings(
        ROOT / "params" / "tiny_mdlm.yaml",
        dataset={"prepared_dir": str(tmp / "prepared"), "limit": 24},
        run_dir=str(tmp / "run"),
    )
    prepare(settings)
    tok = load_tokenizer(tmp / "prepared")
    model = build_model(settings, tok)
    out = tmp / "run" / "consolidated"
    model.save_pretrained(out)
    tok.save_pretrained(out)
    settings.write_json(out / "settings.json")
    settings.write_json(tmp / "run" / "settings.json")
    (tmp / "run" / "metrics.jsonl").write_text(
        "\n".join(
            json.dumps({"step": i, "loss": 5.0 - i, "dllm_loss": 5.0 - i, "lr": 1e-3}) for i in range(1, 4)
        )
    )
    return out


def _settings(tmp_path: Path, uri: str, **registry_over):
    return load_settings(
        ROOT / "params" / "tiny_mdlm.yaml",
        registry={"tracking_uri": uri, "model_name": "reg-test", **registry_over},
    )


def _evals(acc: float, tps: float = 50.0) -> dict:
    return {
        "llada": {
            "metrics": {"exact_match_flexible": acc, "exact_match_strict": acc, "tokens_per_s": tps},
            "protocol": {"sampler": "llada", "sampler_settings": {"steps": 8, "max_new_tokens": 8}},
            "predictions": [{"prompt": "p", "prediction": "q"}],
        }
    }


def test_log_register_gate_and_idempotency(tmp_path, consolidated):
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    # The prepared dir on disk holds other data (its manifest's hash) than the lineage's "abc" below.
    s = load_settings(
        ROOT / "params" / "tiny_mdlm.yaml",
        dataset={"prepared_dir": str(consolidated.parents[1] / "prepared")},
        registry={"tracking_uri": uri, "model_name": "reg-test", "gate": {"tolerance": 0.05}},
    )
    run_dir = consolidated.parent

    # with eval.untrained_baseline and eval.ar_baseline: the model before training, the AR base (`ar`)
    evals = _evals(0.5)
    evals["llada"]["baseline"] = {"metrics": {"exact_match_flexible": 0.125}, "model": "untrained"}
    evals["ar"] = {
        "metrics": {"exact_match_flexible": 0.25, "tokens_per_s": 9.0},
        "protocol": {"sampler": "ar"},
    }
    run1 = mlflow_run.log_run(
        s, run_dir, evals=evals, lineage={"metaflow_run": "F/1", "data_content_hash": "abc"}
    )
    v1 = registry.register_model(s, run1, consolidated, sampler="llada", sampler_settings={"steps": 8})
    assert (
        registry.register_model(s, run1, consolidated, sampler="llada").version == v1.version
    )  # no second version
    d1 = registry.apply_gate(s, v1, _evals(0.5), "llada")
    assert d1["promoted"] and "no champion" in d1["reason"]

    client = MlflowClient(uri)
    run = client.get_run(run1)
    assert run.data.tags["data_content_hash"] == "abc" and run.data.params["dllm.mode"] == "mdlm"
    # the lineage's data hash only: not the manifest's, the data now on disk
    assert [i.dataset.digest for i in run.inputs.dataset_inputs] == ["abc"]
    assert [m.value for m in client.get_metric_history(run1, "train/loss")] == [4.0, 3.0, 2.0]
    assert run.data.metrics["eval/llada/exact_match_flexible"] == 0.5
    assert run.data.metrics["eval/llada/before/exact_match_flexible"] == 0.125
    assert run.data.metrics["eval/ar/exact_match_flexible"] == 0.25
    # Same Metaflow pathspec -> the same MLflow run (a resumed flow does not fork the record).
    assert mlflow_run.log_run(s, run_dir, evals={}, lineage={"metaflow_run": "F/1"}) == run1

    # A worse model outside the tolerance stays candidate; champion does not move.
    run2 = mlflow_run.log_run(s, run_dir, evals=_evals(0.3), lineage={"metaflow_run": "F/2"})
    v2 = registry.register_model(s, run2, consolidated, sampler="llada")
    d2 = registry.apply_gate(s, v2, _evals(0.3), "llada")
    assert not d2["promoted"] and "<" in d2["reason"]
    assert client.get_model_version_by_alias("reg-test", "champion").version == v1.version
    assert client.get_model_version_by_alias("reg-test", "candidate").version == v2.version
    assert client.get_model_version("reg-test", v2.version).tags["gate.decision"] == "rejected"

    # Within the tolerance it is promoted; a speed floor can still refuse.
    run3 = mlflow_run.log_run(s, run_dir, evals=_evals(0.46), lineage={"metaflow_run": "F/3"})
    v3 = registry.register_model(s, run3, consolidated, sampler="llada")
    assert registry.apply_gate(s, v3, _evals(0.46), "llada")["promoted"]
    slow = _settings(tmp_path, uri, gate={"min_tokens_per_s": 1e9})
    assert not registry.apply_gate(slow, v3, _evals(0.9), "llada")["promoted"]


def _load_champion_in_subprocess(uri: str, name: str, cwd: Path) -> list:
    code = (
        "import json, mlflow; "
        f"m = mlflow.pyfunc.load_model('models:/{name}@champion'); "
        "print('PRED=' + json.dumps(m.predict(['What is 2 + 3?'], params={'steps': 4, 'max_new_tokens': 4})))"
    )
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri}
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("PRED="))
    return json.loads(line[5:])


def test_champion_loads_without_training_dirs(tmp_path, consolidated):
    # Register a copy, then delete the copy: the model must come from the MLflow artifact store.
    ckpt = tmp_path / "ckpt"
    shutil.copytree(consolidated, ckpt)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    s = _settings(tmp_path, uri)
    run = mlflow_run.log_run(s, consolidated.parent, evals=_evals(0.2), lineage={"metaflow_run": "F/9"})
    v = registry.register_model(
        s, run, ckpt, sampler="llada", sampler_settings={"steps": 8, "max_new_tokens": 8}
    )
    assert registry.apply_gate(s, v, _evals(0.2), "llada")["promoted"]
    shutil.rmtree(ckpt)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    preds = _load_champion_in_subprocess(uri, "reg-test", elsewhere)
    assert isinstance(preds, list) and len(preds) == 1 and isinstance(preds[0], str)


def test_dead_server_is_a_clear_error(tmp_path):
    s = _settings(tmp_path, f"http://127.0.0.1:{free_port()}")
    with pytest.raises(UserError, match="not reachable"):
        mlflow_run.connect(s)


def test_missing_consolidated_dir_is_a_clear_error(tmp_path):
    s = _settings(tmp_path, f"sqlite:///{tmp_path / 'mlflow.db'}")
    with pytest.raises(UserError, match="consolidated"):
        registry.register_model(s, "no-run", tmp_path / "nope", sampler="llada")


@pytest.mark.slow
def test_real_mlflow_server(tmp_path, consolidated):
    port = free_port()
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlflow",
            *mlflow_server_args(f"sqlite:///{tmp_path / 'server.db'}", str(tmp_path / "artifacts"), port),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    uri = f"http://127.0.0.1:{port}"
    try:
        import httpx

        deadline = time.time() + 90
        while True:
            try:
                if httpx.get(uri + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert server.poll() is None, "mlflow server exited"
            assert time.time() < deadline, "mlflow server did not answer /health in 90 s"
            time.sleep(1)
        s = _settings(tmp_path, uri)
        run = mlflow_run.log_run(s, consolidated.parent, evals=_evals(0.4), lineage={"metaflow_run": "S/1"})
        v = registry.register_model(s, run, consolidated, sampler="llada", sampler_settings={"steps": 8})
        assert registry.apply_gate(s, v, _evals(0.4), "llada")["promoted"]
        preds = _load_champion_in_subprocess(uri, "reg-test", tmp_path)
        assert len(preds) == 1
    finally:
        os.killpg(server.pid, 15)
        server.wait(timeout=30)


def test_registered_model_carries_its_own_environment_and_links_its_logged_model(tmp_path, consolidated):
    """What `--env-manager virtualenv` installs (tests/integration/test_pyfunc_install.py builds it):
    this project's wheel logged with the model, the lock's pins as constraints, no partial code_paths;
    and MLflow 3's links: the version from its LoggedModel, which holds the run's eval metrics, named
    with the prepared dataset that is the run's input."""
    import mlflow
    import yaml
    from mlflow import MlflowClient

    from dllmflow.data.prepared_dir import read_manifest

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    prepared = str(consolidated.parents[1] / "prepared")
    s = load_settings(
        ROOT / "params" / "tiny_mdlm.yaml",
        registry={"tracking_uri": uri, "model_name": "reg-test"},
        dataset={"prepared_dir": prepared, "limit": 24},
    )
    run = mlflow_run.log_run(s, consolidated.parent, evals=_evals(0.5), lineage={"metaflow_run": "E/1"})
    v = registry.register_model(s, run, consolidated, sampler="llada", sampler_settings={"steps": 8})

    model_dir = Path(mlflow.artifacts.download_artifacts(v.source, dst_path=str(tmp_path / "model")))
    reqs = (model_dir / "requirements.txt").read_text().splitlines()
    wheels = [r.removeprefix("./") for r in reqs if r.endswith(".whl")]  # a path relative to the model
    assert len(wheels) == 1 and wheels[0].startswith("artifacts/dllmflow-"), reqs
    wheel = model_dir / wheels[0]
    assert wheel.is_file() and wheel.name == "dllmflow-0.1.0-py3-none-any.whl"
    import zipfile

    packaged = zipfile.ZipFile(wheel).namelist()
    ours = {p.relative_to(ROOT / "src").as_posix() for p in (ROOT / "src" / "dllmflow").rglob("*.py")}
    assert ours <= set(packaged), sorted(ours - set(packaged))[:5]  # the whole package, not a part
    assert not (model_dir / "code").exists()  # no code_paths: the wheel is the code
    assert "-c constraints.txt" in reqs
    lock = dict(
        line.split("==", 1) for line in (ROOT / "requirements.lock").read_text().splitlines() if "==" in line
    )
    constraints = dict(line.split("==", 1) for line in (model_dir / "constraints.txt").read_text().split())
    assert constraints["torch"] == lock["torch"] and constraints["mlflow"] == lock["mlflow"]
    assert all(lock[name] == version for name, version in constraints.items())
    assert "pytest" not in constraints and "ruff" not in constraints  # dev tools are not installed
    assert f"torch=={lock['torch']}" in reqs and f"transformers=={lock['transformers']}" in reqs
    env = yaml.safe_load((model_dir / "python_env.yaml").read_text())
    assert env["python"] == ".".join(map(str, sys.version_info[:3]))
    assert env["dependencies"] == ["-r requirements.txt"]

    client = MlflowClient(uri)
    model_id = v.source.removeprefix("models:/")
    logged = client.get_logged_model(model_id)
    assert logged.source_run_id == run == v.run_id
    assert {"name": "reg-test", "version": int(v.version)} in json.loads(logged.tags["mlflow.modelVersions"])
    digest = read_manifest(prepared)["content_hash"][:32]
    metrics = {m.key: m for m in logged.metrics}
    assert metrics["eval/llada/exact_match_flexible"].value == 0.5
    assert metrics["eval/llada/exact_match_flexible"].dataset_digest == digest
    assert (metrics["train/loss"].step, metrics["train/loss"].value) == (3, 2.0)  # the final training loss
    inputs = client.get_run(run).inputs.dataset_inputs
    assert [(i.dataset.digest, {t.key: t.value for t in i.tags}["mlflow.data.context"]) for i in inputs] == [
        (digest, "training")
    ]


def _measured(settings, consolidated: Path, limit: int, value: float) -> dict:
    """A real evaluation of `consolidated` (its protocol, as the flow's evaluate step records it) with
    the gated figure replaced by `value`: what a version measured at `value` under that protocol logs."""
    from dllmflow.evaluation.accuracy import evaluate

    result = evaluate(
        consolidated, settings, sampler="llada", limit=limit, overrides={"steps": 4, "max_new_tokens": 4}
    )
    result["metrics"] = {**result["metrics"], "exact_match_flexible": value}
    return {"llada": result}


def _gated(s, consolidated: Path, evals: dict, key: str) -> dict:
    run = mlflow_run.log_run(s, consolidated.parent, evals=evals, lineage={"metaflow_run": key})
    return registry.apply_gate(
        s, registry.register_model(s, run, consolidated, sampler="llada"), evals, "llada"
    )


def test_gate_compares_a_candidate_with_the_champion_only_under_one_protocol(tmp_path, consolidated):
    """The champion's recorded figure is used only under the candidate's protocol; otherwise (another
    limit, no figure, a NaN one) it is measured again here, or the gate refuses naming what differs."""
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    reg = {"tracking_uri": uri, "model_name": "reg-test", "gate": {"min_accuracy": 0.0}}
    data = {"prepared_dir": str(consolidated.parents[1] / "prepared")}
    s = load_settings(ROOT / "params" / "tiny_mdlm.yaml", dataset=data, registry=reg)
    reg["gate"]["remeasure_champion"] = False
    off = load_settings(ROOT / "params" / "tiny_mdlm.yaml", dataset=data, registry=reg)
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)  # not an earlier test's registry

    # v1 champion recorded at 0.6 on 2 rows; v2 at 0.3 under the same protocol is compared with it
    d1 = _gated(s, consolidated, _measured(s, consolidated, 2, 0.6), "P/1")
    assert d1["promoted"]
    v1 = client.get_model_version("reg-test", str(d1["version"]))
    recorded = json.loads(v1.tags["eval.protocol"])
    assert (
        recorded["limit"] == 2
        and recorded["sampler_settings"]["steps"] == 4
        and len(recorded["split_sha256"]) == 64
    )
    d2 = _gated(s, consolidated, _measured(s, consolidated, 2, 0.3), "P/2")
    assert not d2["promoted"] and d2["reason"] == "exact_match_flexible 0.3000 < champion v1 0.6000 - 0.0"

    # 3 rows: another protocol. Refused naming the limit when re-measuring is off ...
    d3 = _gated(off, consolidated, _measured(off, consolidated, 3, 0.3), "P/3")
    assert not d3["promoted"]
    assert "champion v1 was measured under another protocol (limit: 2 -> 3)" in d3["reason"]
    assert "remeasure_champion is off" in d3["reason"]
    # ... else v1 is evaluated again on 3 rows: its real figure (an untrained model: 0), not 0.6
    d4 = _gated(s, consolidated, _measured(s, consolidated, 3, 0.3), "P/4")
    assert d4["promoted"], d4["reason"]
    assert (
        "(limit: 2 -> 3); re-measured under this version's protocol: exact_match_flexible 0.0000"
        in d4["reason"]
    )
    champion = client.get_model_version_by_alias("reg-test", "champion")
    assert str(champion.version) == str(d4["version"])

    # A champion whose figure is NaN lets nothing through unmeasured
    client.set_model_version_tag("reg-test", champion.version, "eval.exact_match_flexible", "nan")
    d5 = _gated(off, consolidated, _measured(off, consolidated, 3, 0.9), "P/5")
    assert not d5["promoted"]
    assert f"no exact_match_flexible of champion v{champion.version} to compare with" in d5["reason"]
    assert f"champion v{champion.version} has no exact_match_flexible figure (missing or NaN)" in d5["reason"]
    # the rows of the protocol not on this machine: the re-measure cannot run, refused naming why
    gone = _measured(s, consolidated, 3, 0.9)
    gone["llada"]["protocol"]["prepared_dir"] = str(tmp_path / "not-here")
    d6 = _gated(s, consolidated, gone, "P/6")
    assert not d6["promoted"] and "re-measuring it under this version's protocol failed" in d6["reason"]
    assert str(client.get_model_version_by_alias("reg-test", "champion").version) == str(champion.version)


def test_a_grpo_version_is_gated_against_the_sft_champion(tmp_path, consolidated):
    """GRPO's register step (workflow.grpo.register) into a model whose champion is the SFT parent: an
    RL version worse than it under the same protocol stays candidate, a better one is promoted; both
    carry their parent."""
    from mlflow import MlflowClient

    from dllmflow.workflow import finetune, grpo

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    reg = {"tracking_uri": uri, "model_name": "reg-rl", "gate": {"min_accuracy": 0.0, "tolerance": 0.02}}
    data = {"prepared_dir": str(consolidated.parents[1] / "prepared")}
    sft = load_settings(ROOT / "params" / "tiny_mdlm.yaml", dataset=data, registry=reg)
    run_dir, training = str(consolidated.parent), {"consolidated_dir": str(consolidated)}
    champion = finetune.register(sft, run_dir, _measured(sft, consolidated, 2, 0.6), data={}, training=training,
                                 pathspec="SFT/1")  # fmt: skip
    assert champion["gate_promoted"]

    rl = load_settings(ROOT / "params" / "tiny_mdlm.yaml", dataset=data, registry=reg,
                       rl={"init_from": f"models:/reg-rl/{champion['version']}"})  # fmt: skip
    parent = {"parent_init_from": rl.rl.init_from, "parent_model": f"reg-rl/{champion['version']}"}
    worse = grpo.register(rl, run_dir, _measured(rl, consolidated, 2, 0.5), training={**training, "parent": parent},
                          pathspec="GRPO/1")  # fmt: skip
    assert not worse["gate_promoted"]
    assert (
        worse["gate_reason"] == f"exact_match_flexible 0.5000 < champion v{champion['version']} 0.6000 - 0.02"
    )
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)  # not an earlier test's registry
    assert str(client.get_model_version_by_alias("reg-rl", "champion").version) == str(champion["version"])
    tags = client.get_model_version("reg-rl", str(worse["version"])).tags
    assert (
        tags["stage"] == "grpo" and tags["gate.decision"] == "rejected" and tags["parent_model"] == "reg-rl/1"
    )

    better = grpo.register(rl, run_dir, _measured(rl, consolidated, 2, 0.75), training={**training, "parent": parent},
                           pathspec="GRPO/2")  # fmt: skip
    assert better["gate_promoted"]
    assert str(client.get_model_version_by_alias("reg-rl", "champion").version) == str(better["version"])
