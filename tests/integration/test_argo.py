"""Argo compile: `argo-workflows create --only-json` of both flows against a local S3 (moto), no cluster.

Checks the WorkflowTemplate: the DAG of steps, the image, the train step's resources as placed by
`launch.scheduler` (local: the step runs the trainers and carries their GPUs; cluster: the step only
submits, the torchx job holds the GPUs), the retry on train, the foreach over samplers, `@project`, and
the schedule: none without `flow.schedule_cron` (Metaflow's bare `@schedule` would mean daily), exactly
the recipe's cron with one (Metaflow writes it to the `metaflow/cron` annotation, from which `create`
makes the CronWorkflow).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
BUCKET = "dllmflow-argo"
IMAGE = "registry.example.com/dllmflow:test"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def s3_env():
    """A moto S3 server in this process, its bucket, and the env that points Metaflow at it."""
    import boto3
    from moto.server import ThreadedMotoServer

    from dllmflow.training.launch import free_port

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    creds = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing", "region_name": "us-east-1"}
    boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}", **creds).create_bucket(Bucket=BUCKET)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DLLMFLOW_", "METAFLOW_"))}
    env.update(
        USERNAME="argo-tester",
        METAFLOW_DEFAULT_DATASTORE="s3",
        METAFLOW_DEFAULT_METADATA="local",
        METAFLOW_DATASTORE_SYSROOT_S3=f"s3://{BUCKET}/metaflow",
        METAFLOW_S3_ENDPOINT_URL=f"http://127.0.0.1:{port}",
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_DEFAULT_REGION="us-east-1",
        METAFLOW_KUBERNETES_NAMESPACE="ml-training",
        METAFLOW_KUBERNETES_CONTAINER_IMAGE=IMAGE,
    )
    yield env
    server.stop()


def first_json_object(text: str) -> dict:
    """The WorkflowTemplate in `--only-json` output, whatever lines Metaflow prints around it."""
    decoder = json.JSONDecoder()
    for start in (i for i, ch in enumerate(text) if ch == "{"):
        try:
            obj, _ = decoder.raw_decode(text, start)
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict) and obj.get("kind") == "WorkflowTemplate":
            return obj
    raise AssertionError(f"no WorkflowTemplate JSON in the output:\n{text[:2000]}")


def compile_flow(flow: str, recipe: dict, env: dict, tmp_path: Path, *top_options: str) -> dict:
    params = tmp_path / f"{recipe['name']}.yaml"
    params.write_text(yaml.safe_dump(recipe))
    cmd = [sys.executable, f"flows/{flow}", *top_options, "--config", "recipe", str(params)]
    cmd += ["--with", "kubernetes", "argo-workflows", "create", "--only-json"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return first_json_object(proc.stdout)


def recipe(path: str, **sections) -> dict:
    data = yaml.safe_load((ROOT / "params" / path).read_text())
    for name, values in sections.items():
        data[name] = {**data.get(name, {}), **values} if isinstance(values, dict) else values
    return data


def templates(wf: dict) -> dict[str, dict]:
    return {t["name"]: t for t in wf["spec"]["templates"]}


def dag_tasks(wf: dict, flow_name: str) -> dict[str, dict]:
    return {task["name"]: task for task in templates(wf)[flow_name]["dag"]["tasks"]}


def step_resources(wf: dict, step: str) -> dict:
    res = templates(wf)[step]["container"]["resources"]
    return {"requests": res["requests"], "limits": res["limits"] or {}}


def cron(wf: dict) -> str | None:
    raw = wf["metadata"]["annotations"].get("metaflow/cron")
    return json.loads(raw)["schedule"] if raw else None


def test_finetune_local_scheduler_without_cron(s3_env, tmp_path):
    wf = compile_flow("finetune.py", recipe("tiny_mdlm.yaml"), s3_env, tmp_path)

    meta = wf["metadata"]
    assert meta["name"] == "dllmflow.user.argo-tester.finetuneflow"  # @project(flow.project)
    assert meta["annotations"]["metaflow/project_name"] == "dllmflow"
    assert cron(wf) is None  # no @schedule at all: not even Metaflow's daily default

    tasks = dag_tasks(wf, "FinetuneFlow")
    assert list(tasks) == [
        "start", "prepare-plan", "prepare-plan-foreach-data-units", "prepare", "train",
        "train-foreach-samplers", "register", "end",
    ]  # fmt: skip
    # foreach over the data units: one prepare_unit task per unit the plan lists, joined by prepare
    assert (
        "prepare-plan.outputs.parameters.num-splits" in tasks["prepare-plan-foreach-data-units"]["withParam"]
    )
    assert [t["template"] for t in templates(wf)["prepare-plan-foreach-data-units"]["dag"]["tasks"]] == [
        "prepare-unit"
    ]
    # foreach over the samplers: one evaluate task per sampler the train step lists
    assert "train.outputs.parameters.num-splits" in tasks["train-foreach-samplers"]["withParam"]
    assert [t["template"] for t in templates(wf)["train-foreach-samplers"]["dag"]["tasks"]] == ["evaluate"]
    steps = {"start", "prepare-plan", "prepare-unit", "prepare", "train", "evaluate", "register", "end"}
    assert all(templates(wf)[s]["container"]["image"] == IMAGE for s in steps)

    train = templates(wf)["train"]
    assert train["retryStrategy"]["limit"] == 1  # flow.train_retries
    # local_cwd: the trainers run inside the step, which requests launch.resources (default: no GPU)
    res = step_resources(wf, "train")
    assert float(res["requests"]["cpu"]) == 2 and res["requests"]["memory"].startswith("8192")
    assert "nvidia.com/gpu" not in res["limits"]


def test_finetune_gpus_follow_the_trainers(s3_env, tmp_path):
    """Local scheduler: the step carries nnodes x the per-node GPUs. Cluster scheduler: the step only
    submits (flow.resources, no GPU) and the cron lands exactly as written."""
    two_nodes = {"nnodes": 2, "resources": {"cpu": 4, "gpu": 2, "memory_mb": 16000}}
    train = {"local_batch_size": 4}
    local = compile_flow(
        "finetune.py", recipe("tiny_mdlm.yaml", launch=two_nodes, train=train), s3_env, tmp_path
    )
    res = step_resources(local, "train")
    assert res["limits"]["nvidia.com/gpu"] == "4"
    assert float(res["requests"]["cpu"]) == 8 and res["requests"]["memory"].startswith("32000")
    assert cron(local) is None

    cluster = recipe(
        "tiny_mdlm.yaml",
        name="tiny_mdlm_k8s",
        launch={**two_nodes, "scheduler": "kubernetes"},
        train=train,
        flow={"schedule_cron": "0 3 * * *", "train_retries": 2, "resources": {"cpu": 3, "memory_mb": 6000}},
    )
    wf = compile_flow("finetune.py", cluster, s3_env, tmp_path, "--branch", "nightly")
    assert wf["metadata"]["name"] == "dllmflow.test.nightly.finetuneflow"  # @project's --branch
    assert cron(wf) == "0 3 * * *"
    res = step_resources(wf, "train")
    assert "nvidia.com/gpu" not in res["limits"]
    assert float(res["requests"]["cpu"]) == 3 and res["requests"]["memory"].startswith("6000")
    assert templates(wf)["train"]["retryStrategy"]["limit"] == 2


def test_shared_nothing_finetune_mounts_no_volume(s3_env, tmp_path):
    """The shared-nothing setup (infra/argo.md): prepared data and checkpoints in the bucket, trainers on a
    cluster scheduler with their settings in the pod spec. No step mounts a volume claim."""
    bucket = f"s3://{BUCKET}"
    shared_nothing = recipe(
        "tiny_mdlm.yaml",
        name="tiny_mdlm_shared_nothing",
        dataset={"remote_dir": f"{bucket}/prepared/tiny"},
        checkpoint={"remote_dir": f"{bucket}/runs/tiny"},
        launch={"scheduler": "kubernetes", "mounts": []},
    )
    wf = compile_flow("finetune.py", shared_nothing, s3_env, tmp_path)
    assert "persistentVolumeClaim" not in json.dumps(wf)
    volumes = [v for t in templates(wf).values() for v in t.get("volumes") or []]
    assert volumes and all(set(v) == {"name", "emptyDir"} for v in volumes), (
        volumes
    )  # Metaflow's pod scratch only
    assert {"prepare-plan", "prepare-unit", "prepare", "train", "evaluate"} <= set(templates(wf))


def test_regenerate_flow_compiles_with_and_without_cron(s3_env, tmp_path):
    plain = compile_flow("regenerate.py", recipe("tiny_dflash_regen.yaml"), s3_env, tmp_path)
    assert list(dag_tasks(plain, "RegenerateFlow")) == ["start", "regenerate", "end"]
    assert templates(plain)["regenerate"]["retryStrategy"]["limit"] == 1
    assert templates(plain)["regenerate"]["container"]["image"] == IMAGE
    assert plain["metadata"]["name"] == "dllmflow.user.argo-tester.regenerateflow"
    assert cron(plain) is None

    nightly = recipe(
        "tiny_dflash_regen.yaml",
        name="regen_nightly",
        flow={"schedule_cron": "30 1 * * 1-5", "project": "regen"},
    )
    wf = compile_flow("regenerate.py", nightly, s3_env, tmp_path, "--production")
    assert cron(wf) == "30 1 * * 1-5"
    assert wf["metadata"]["name"] == "regen.prod.regenerateflow"
