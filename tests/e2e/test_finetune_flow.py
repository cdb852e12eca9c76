"""FinetuneFlow end to end on the tiny recipe: real Metaflow runs, a real DVC stage, a real torchx
launch of torchrun, a real SQLite MLflow store; then the champion is loaded in a fresh process.

Each test works in its own git + DVC repo under tmp (a copy of the flow, the recipe, dvc.yaml and the
data code the stage depends on), so nothing touches the checkout.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from _plugins.fault_hooks import with_fault_env

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _recipe(train_retries: int) -> dict:
    data = yaml.safe_load((ROOT / "params" / "tiny_mdlm.yaml").read_text())
    data["dataset"]["limit"] = 64
    data["train"].update(max_steps=6, global_batch_size=4, local_batch_size=4, warmup_steps=1)
    data["checkpoint"] = {"every_steps": 3}
    data["eval"] = {"limit": 2, "max_new_tokens": 16, "steps": 16, "batch_size": 2}
    data["flow"] = {"train_retries": train_retries}
    # 6 steps on GSM8K score 0: no accuracy floor, so the first version is promoted (plumbing under test).
    data["registry"] = {"model_name": "e2e-tiny", "gate": {"tolerance": 0.0, "min_accuracy": 0.0}}
    return data


@pytest.fixture()
def project(tmp_path) -> Path:
    """A throwaway project: git + DVC repo with the flow, a fast recipe and the dvc.yaml stage."""
    proj = tmp_path / "proj"
    (proj / "flows").mkdir(parents=True)
    (proj / "params").mkdir()
    shutil.copy(ROOT / "flows" / "finetune.py", proj / "flows" / "finetune.py")
    # `resume` loads the flow's default Config file before the run's own: it must exist, as in a checkout.
    shutil.copy(ROOT / "params" / "tiny_addition.yaml", proj / "params" / "tiny_addition.yaml")
    shutil.copy(ROOT / "dvc.yaml", proj / "dvc.yaml")
    shutil.copytree(
        ROOT / "src" / "dllmflow" / "data",
        proj / "src" / "dllmflow" / "data",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    for cmd in (["git", "init", "-q"], ["dvc", "init", "-q"]):
        subprocess.run(cmd, cwd=proj, check=True)
    return proj


def _env(proj: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DLLMFLOW_", "DLLM_"))}
    env.update(
        METAFLOW_DATASTORE_SYSROOT_LOCAL=str(proj),
        MLFLOW_TRACKING_URI=f"sqlite:///{proj / 'mlflow.db'}",
        GIT_AUTHOR_NAME="t",
        GIT_AUTHOR_EMAIL="t@t",
        GIT_COMMITTER_NAME="t",
        GIT_COMMITTER_EMAIL="t@t",
        **extra,
    )
    return env


def _flow(proj: Path, *args: str, env: dict[str, str], check: bool = True) -> subprocess.CompletedProcess:
    # `resume` reuses the failed run's Config (Metaflow refuses --config with resume).
    config = [] if args[0] == "resume" else ["--config", "recipe", "params/tiny_mdlm.yaml"]
    cmd = [sys.executable, "flows/finetune.py", *config, *args]
    proc = subprocess.run(cmd, cwd=proj, env=env, capture_output=True, text=True, timeout=900)
    if check:
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc


_RUN_INFO = """
import base64, json, re
from metaflow import Flow, namespace
from metaflow.cards import get_cards
namespace(None)
run = Flow("FinetuneFlow").latest_run
html = get_cards(run["end"].task, id="report")[0].get() if run.successful else ""
m = re.search(r'__MF_DATA__\\["[^"]+"\\] = "([^"]+)"', html)
print("INFO=" + json.dumps({
    "id": run.id,
    "successful": run.successful,
    "data": run["prepare"].task.data.data,
    "training": run["train"].task.data.training if run.successful else None,
    "registration": run["register"].task.data.registration if run.successful else None,
    "evals": run["register"].task.data.evals if run.successful else None,
    "card": base64.b64decode(m.group(1)).decode() if m else "",
}, default=str))
"""


def _latest_run(proj: Path) -> dict:
    """The latest FinetuneFlow run of `proj`, read with the Metaflow client in a fresh process (Metaflow
    reads its datastore root at import, so one pytest process cannot switch between projects)."""
    proc = subprocess.run(
        [sys.executable, "-c", _RUN_INFO],
        cwd=proj,
        env=_env(proj),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("INFO="))[5:])


def test_flow_retry_champion_then_failed_run_resumes_under_a_stricter_gate(project):
    (project / "params" / "tiny_mdlm.yaml").write_text(yaml.safe_dump(_recipe(train_retries=1)))
    # The first train attempt dies right after its step-3 checkpoint; @retry must resume from it.
    env = with_fault_env(_env(project), fail_at=3)
    _flow(project, "run", env=env)
    run = _latest_run(project)
    assert run["successful"]
    data = run["data"]
    assert data["dvc_stage"] == "prepare" and len(data["content_hash"]) == 64
    training = run["training"]
    assert training["resumed"] is True
    steps = [
        json.loads(x)["step"]
        for x in (Path(project) / training["run_dir"] / "metrics.jsonl").read_text().splitlines()
    ]
    assert steps == [1, 2, 3, 4, 5, 6]  # resumed at 4: no step lost, none repeated
    reg = run["registration"]
    assert reg["version"] == 1 and reg["gate_promoted"] is True
    assert reg["lineage"]["data_content_hash"] == data["content_hash"]
    assert reg["lineage"]["metaflow_run"] == f"FinetuneFlow/{run['id']}"
    assert reg["lineage"]["torchx_app_handle"].startswith("local_cwd://")
    evals = run["evals"]
    assert "llada" in evals and {"exact_match_strict", "tokens_per_s", "nfe"} <= set(
        evals["llada"]["metrics"]
    )

    for needle in (
        "Training loss",
        "Evaluation",
        "Sample generations",
        "Lineage",
        data["content_hash"],
        "vegaChart",  # the loss curve, drawn by the card viewer
    ):
        assert needle in run["card"], needle

    # `dllmflow generate --checkpoint runs/<name>` finds this flow run's export (the newest flow run).
    from dllmflow.runs import resolve_checkpoint

    flow_dir = Path(project) / training["run_dir"]
    assert flow_dir.parent.parent.name == "runs"
    assert resolve_checkpoint(flow_dir.parent) == resolve_checkpoint(flow_dir)

    # A consumer with no access to the training dirs loads the champion and generates.
    shutil.rmtree(project / "runs")
    code = (
        "import json, mlflow; m = mlflow.pyfunc.load_model('models:/e2e-tiny@champion'); "
        "print('PRED=' + json.dumps(m.predict(['What is 2 + 3?'])))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=project.parent,
        env=_env(project),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    preds = json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("PRED="))[5:])
    assert len(preds) == 1 and isinstance(preds[0], str)

    # A second run under a stricter gate (a speed floor no CPU run reaches; registry.* is not a DVC
    # param) and without retries, whose train dies after its step-3 checkpoint: the flow fails with the
    # failing rank's error; `resume` reruns only from the failed step (start and prepare are cloned,
    # train resumes from the checkpoint). DVC skipped the unchanged data, and version 2 is registered
    # as candidate but NOT promoted. (One project for both: a flow run less than two separate tests.)
    strict = _recipe(train_retries=0)
    strict["registry"]["gate"]["min_tokens_per_s"] = 1e9
    (project / "params" / "tiny_mdlm.yaml").write_text(yaml.safe_dump(strict))
    failed = _flow(project, "run", env=with_fault_env(_env(project), fail_at=3), check=False)
    assert failed.returncode != 0
    out = failed.stdout + failed.stderr
    assert "injected failure" in out and "rank 0" in out  # the failing rank's error reaches the step

    resumed = _flow(project, "resume", env=_env(project))
    run2 = _latest_run(project)
    assert run2["successful"]
    log = resumed.stdout + resumed.stderr
    assert any("/prepare/" in line and "Cloning previously run task" in line for line in log.splitlines()), (
        log
    )
    assert not any("/prepare/" in line and "Task is starting" in line for line in log.splitlines())
    training2 = run2["training"]
    assert training2["resumed"] is True
    steps = [
        json.loads(x)["step"]
        for x in (Path(project) / training2["run_dir"] / "metrics.jsonl").read_text().splitlines()
    ]
    assert steps == [1, 2, 3, 4, 5, 6]
    assert run2["id"] != run["id"] and run2["data"]["reused"] is True
    reg2 = run2["registration"]
    assert reg2["version"] == 2 and reg2["gate_promoted"] is False
    assert (
        reg2["gate_reason"].startswith("tokens_per_s ")
        and "below the floor 1000000000.0" in reg2["gate_reason"]
    )
    assert f"rejected: {reg2['gate_reason']}" in run2["card"]
    code = (
        "import json; from mlflow import MlflowClient; c = MlflowClient(); "
        "v2 = c.get_model_version('e2e-tiny', '2'); "
        "print('REG=' + json.dumps({'champion': c.get_model_version_by_alias('e2e-tiny', 'champion').version, "
        "'candidate': c.get_model_version_by_alias('e2e-tiny', 'candidate').version, 'tags': v2.tags}))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=project,
        env=_env(project),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    aliases = json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("REG="))[4:])
    assert str(aliases["champion"]) == "1" and str(aliases["candidate"]) == "2"
    assert (
        aliases["tags"]["gate.decision"] == "rejected"
        and aliases["tags"]["gate.reason"] == reg2["gate_reason"]
    )


def test_bad_recipe_fails_before_any_step(project):
    bad = _recipe(train_retries=0)
    bad["train"]["lrr"] = 1
    (project / "params" / "tiny_mdlm.yaml").write_text(yaml.safe_dump(bad))
    proc = _flow(project, "run", env=_env(project), check=False)
    assert proc.returncode != 0
    assert "train.lrr" in proc.stdout + proc.stderr
    assert not (project / "runs").exists()


MODE_EVALS = {
    "scdd": {"scdd", "llada"},
    "hybrid": {"nemotron", "llada"},
    "idlm": {"idlm", "ar_control"},  # with eval.ar_control: the AR arm beside a curriculum
    "causal_blocks": {"llada2", "selfspec"},  # selfspec decodes them too (block_causal's llada2: unit tests)
    "block_diffusion": {"gemma"},
    "dflash": {"acceptance"},
    "ar": {"ar"},  # the AR control's mode on its own: trained, decoded greedily, registered like the rest
    "uno": {"selfspec", "ar_control"},  # the drafting adapter, trained on top of the AR control it drafts for
}


@pytest.mark.parametrize("mode", sorted(MODE_EVALS))
def test_every_mode_trains_evaluates_and_registers_through_the_flow(tmp_path, mode):
    """Each tiny recipe through FinetuneFlow: train, the evaluation matrix of its mode, registration.
    The I-DLM recipe runs a two-stage block_length curriculum [1, 2] from one flow run."""
    proj = tmp_path / "proj"
    (proj / "flows").mkdir(parents=True)
    (proj / "params").mkdir()
    shutil.copy(ROOT / "flows" / "finetune.py", proj / "flows" / "finetune.py")
    data = yaml.safe_load((ROOT / "params" / f"tiny_{mode}.yaml").read_text())
    data["dataset"]["limit"] = 32
    data["train"].update(max_steps=2, global_batch_size=4, local_batch_size=4, warmup_steps=0)
    data["checkpoint"] = {"every_steps": 2}
    data["eval"] = {"limit": 1, "max_new_tokens": 8, "steps": 8, "batch_size": 1}
    if mode == "causal_blocks":  # llada2 decodes the blocks it was trained on
        data["eval"]["block_size"] = data["dllm"]["block_size"]
    data["flow"] = {"train_retries": 0}
    data.setdefault("registry", {})["model_name"] = f"e2e-{mode}"
    if mode == "uno":
        data["eval"].update(samplers=["selfspec"], block_size=8, ar_control={})
    if mode == "idlm":
        data["dllm"]["block_length"] = [1, 2]
        data["eval"]["ar_control"] = {"max_em_gap": 0.5}
    (proj / "params" / "tiny_mdlm.yaml").write_text(yaml.safe_dump(data))

    _flow(proj, "run", env=_env(proj))
    run = _latest_run(proj)
    assert run["successful"]
    assert set(run["evals"]) == MODE_EVALS[mode]
    reg = run["registration"]
    assert reg["version"] == 1 and reg["model_name"] == f"e2e-{mode}"
    training = run["training"]
    if mode == "idlm":
        assert len(training["stages"]) == 2 and training["run_dir"].endswith("stage_1")
        stage1 = json.loads((proj / training["run_dir"] / "settings.json").read_text())
        assert stage1["dllm"]["block_length"] == 2
        assert stage1["model"]["pretrained_model_name_or_path"].endswith(
            "stage_0/checkpoints/LATEST/model/consolidated"
        )
        # the AR control: mode ar on the same rows for the same steps, beside the curriculum's two stages
        control = json.loads((proj / training["ar_control"]["run_dir"] / "settings.json").read_text())
        assert control["dllm"]["mode"] == "ar" and control["train"] == {**stage1["train"], "max_steps": 2}
        assert control["dataset"]["prepared_dir"] == stage1["dataset"]["prepared_dir"]
        side = reg["ar_control"]
        assert side["sampler"] == "idlm" and side["dllm"]["train_steps"] == 4  # 2 stages x 2 steps
        assert side["ar_control"]["train_steps"] == 2 and side["ar_control"]["train_tokens"] > 0
        assert side["dllm"]["latency_s_b1"] > 0 and side["ar_control"]["tokens_per_s_b16"] >= 0
        assert (
            run["evals"]["ar_control"]["protocol"]["prompts_sha256"]
            == run["evals"]["idlm"]["protocol"]["prompts_sha256"]
        )
        assert "dLLM vs AR control" in run["card"] and "AR control (ar)" in run["card"]
    if mode == "uno":  # the control first, then the adapter on its export; answers identical, and said so
        control_export = training["ar_control"]["consolidated_dir"]
        adapter_run = json.loads((proj / training["run_dir"] / "settings.json").read_text())
        assert adapter_run["model"]["pretrained_model_name_or_path"] == control_export
        side = reg["ar_control"]
        assert side["sampler"] == "selfspec" and side["identical"] == side["answers"] == 1
        assert "answers identical to the AR control: 1/1 (selfspec)" in run["card"]
