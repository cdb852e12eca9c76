"""The torchx component `dllmflow.train`: entry point, in-process, CLI dry runs (Kubernetes, Slurm), local run.

Through the torchx CLI, which finds the component by the installed package's entry point; the dry runs
run outside the checkout, with the scheduler settings named by TORCHXCONFIG (infra/.torchxconfig):

  * the entry point: `torchx builtins` lists `dllmflow.train` next to torchx's own components;

  * in-process: the AppDef is `build_app`'s, with the component's arguments applied to `launch:`, the
    settings carried inline in its env ($DLLMFLOW_SETTINGS), and nothing written by the submitting machine;
  * `torchx run --dryrun -s kubernetes|slurm`: the Volcano job / sbatch script carry nnodes replicas,
    torchrun's nnodes / nproc_per_node / c10d rendezvous on the rank-0 host, GPUs, env, image, mounts;
  * `torchx run -s local_cwd` trains a tiny model for 2 steps (slow).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dllmflow.runs import read_metrics
from dllmflow.settings import SETTINGS_ENV, load_settings, load_settings_env
from dllmflow.training.component import train
from dllmflow.training.launch import rank0_endpoint

ROOT = Path(__file__).resolve().parents[2]
RECIPE = "params/tiny_mdlm.yaml"
TORCHXCONFIG = ROOT / "infra" / ".torchxconfig"
# world size 8 needs a global batch that 8 ranks x the local batch divide
BATCH = "train.global_batch_size=16,train.local_batch_size=2"


def torchx(*args: str, cwd: Path = ROOT, timeout: int = 300) -> subprocess.CompletedProcess:
    exe = str(Path(sys.executable).with_name("torchx"))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHXCONFIG": str(TORCHXCONFIG)}
    proc = subprocess.run([exe, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def scheduler_request(stdout: str) -> str:
    assert "=== SCHEDULER REQUEST ===" in stdout, stdout[-2000:]
    return stdout.split("=== SCHEDULER REQUEST ===", 1)[1]


def torchrun_flags(command: str) -> dict[str, str]:
    args = shlex.split(command[command.index("torchrun") :])
    return {a: args[i + 1] for i, a in enumerate(args) if a.startswith("--") and i + 1 < len(args)}


def test_entry_point_names_the_component_outside_the_checkout(tmp_path):
    from importlib.metadata import entry_points

    found = {ep.name: ep.value for ep in entry_points(group="torchx.components")}
    assert found.get("dllmflow") == "dllmflow.training.component", (
        f"torchx.components entry points {found}: the installed dllmflow metadata predates pyproject.toml's "
        "entry point; re-run `bash scripts/setup.sh`"
    )
    listed = torchx("builtins", cwd=tmp_path).stdout
    assert re.search(r"\. dllmflow\.train$", listed, re.M), listed
    # torchx's own components stay reachable next to ours
    assert re.search(r"\. dist\.ddp$", listed, re.M) and re.search(r"\. utils\.echo$", listed, re.M), listed


def test_component_is_build_app_with_the_cli_arguments(tmp_path):
    app = train(
        params=str(ROOT / RECIPE),
        nnodes=2,
        nproc_per_node=1,
        gpu=1,
        memMB=4000,
        env={"NCCL_DEBUG": "INFO"},
        run_dir=str(tmp_path / "run"),
        resume=True,
        set={"train.max_steps": "3", "train.local_batch_size": "4", "eval.samplers": "[llada]"},
    )
    (role,) = app.roles
    assert role.num_replicas == 2 and role.resource.gpu == 1 and role.resource.memMB == 4000
    assert role.env["NCCL_DEBUG"] == "INFO"
    flags = torchrun_flags(role.args[1])
    assert flags["--nnodes"] == "2" and flags["--rdzv_endpoint"] == rank0_endpoint()
    assert role.args[1].endswith(f"--run-dir {tmp_path / 'run'} --resume")
    # settings resolved once, from the recipe + overrides + the component's arguments, carried in the
    # AppDef: the submitting machine wrote no file a node would need
    assert not (tmp_path / "run").exists()
    written = load_settings_env(role.env[SETTINGS_ENV])
    assert written.train.max_steps == 3 and written.eval.samplers == ["llada"]
    assert written.launch.nnodes == 2 and written.launch.resources.gpu == 1
    assert written.run_dir == str(tmp_path / "run")
    # unset arguments keep the recipe's launch section; one node rendezvous on a local port
    single = train(params=str(ROOT / RECIPE), run_dir=str(tmp_path / "one"))
    assert single.roles[0].image == load_settings(ROOT / RECIPE).launch.image
    assert torchrun_flags(single.roles[0].args[1])["--rdzv_endpoint"] == "localhost:0"


def test_kubernetes_dryrun_is_a_volcano_job_with_one_task_per_node(tmp_path):
    out = torchx(
        "run", "--dryrun", "-s", "kubernetes", "dllmflow.train",
        "--params", str(ROOT / RECIPE), "--nnodes", "2", "--nproc_per_node", "4", "--gpu", "4", "--cpu", "16",
        "--memMB", "64000", "--image", "registry.example.com/dllmflow:1", "--env", "NCCL_DEBUG=INFO",
        "--mounts", "type=volume,src=dllmflow-runs,dst=/app/runs", "--run_dir", str(tmp_path / "run"),
        "--set", BATCH, cwd=tmp_path,
    ).stdout  # fmt: skip
    job = yaml.safe_load(scheduler_request(out))
    assert job["kind"] == "Job" and job["apiVersion"].startswith("batch.volcano.sh")
    assert job["spec"]["queue"] == "default"  # from infra/.torchxconfig (TORCHXCONFIG)
    tasks = job["spec"]["tasks"]
    assert [t["name"] for t in tasks] == ["trainer-0", "trainer-1"]  # replicas = nnodes
    for i, task in enumerate(tasks):
        pod = task["template"]["spec"]
        (container,) = pod["containers"]
        assert container["image"] == "registry.example.com/dllmflow:1"
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "4"
        assert container["resources"]["limits"]["cpu"] == "16000m"
        env = {e["name"]: e["value"] for e in container["env"]}
        assert env["NCCL_DEBUG"] == "INFO" and env["PYTHONUNBUFFERED"] == "1"
        flags = torchrun_flags(container["command"][2])
        assert (
            flags["--nnodes"] == "2"
            and flags["--nproc_per_node"] == "4"
            and flags["--rdzv_backend"] == "c10d"
        )
        # every node meets at replica 0's host (Volcano's env var; replica 0 itself uses localhost)
        host = "TORCHX_RANK0_HOST" if i == 0 else "VC_TRAINER_0_HOSTS"
        assert flags["--rdzv_endpoint"] == f"${{{host}:=localhost}}:29500"
        assert flags["--run-dir"] == str(tmp_path / "run")
        assert load_settings_env(env[SETTINGS_ENV]).launch.nproc_per_node == 4  # in the pod spec itself
        assert {"mountPath": "/app/runs", "name": "mount-0", "readOnly": False} in container["volumeMounts"]
        assert {"name": "mount-0", "persistentVolumeClaim": {"claimName": "dllmflow-runs"}} in pod["volumes"]
    assert not (tmp_path / "run").exists()


def test_slurm_dryrun_is_an_sbatch_script_with_one_hetjob_per_node(tmp_path):
    out = torchx(
        "run", "--dryrun", "-s", "slurm", "dllmflow.train",
        "--params", str(ROOT / RECIPE), "--nnodes", "2", "--nproc_per_node", "4", "--gpu", "4", "--cpu", "16",
        "--memMB", "64000", "--env", "NCCL_DEBUG=INFO", "--run_dir", str(tmp_path / "run"), "--set", BATCH,
        cwd=tmp_path,
    ).stdout  # fmt: skip
    script = scheduler_request(out)
    sbatch = re.findall(r"^#SBATCH --job-name=(\S+) (.*)$", script, re.M)
    assert [name for name, _ in sbatch] == ["trainer-0", "trainer-1"] and "#SBATCH hetjob" in script
    for _, opts in sbatch:
        assert "--gpus-per-task=4" in opts and "--cpus-per-task=16" in opts and "--mem=64000" in opts
        assert "--partition=gpu" in opts  # from infra/.torchxconfig (TORCHXCONFIG)
    sruns = [line for line in script.splitlines() if "torchrun" in line]
    assert len(sruns) == 2
    for line in sruns:
        assert "NCCL_DEBUG=INFO" in line
        words = shlex.split(line.rstrip(" :\\"))  # one het-group of the srun line
        flags = torchrun_flags(words[words.index("-c") + 1])
        assert flags["--nnodes"] == "2" and flags["--nproc_per_node"] == "4"
        assert flags["--rdzv_endpoint"] == "${SLURM_JOB_NODELIST_HET_GROUP_0:=localhost}:29500"
        assert flags["--run-dir"] == str(tmp_path / "run")
        carried = re.search(rf"{SETTINGS_ENV}=([A-Za-z0-9+/=]+)", line)
        assert carried and load_settings_env(carried.group(1)).launch.nproc_per_node == 4


@pytest.mark.slow
def test_local_cwd_run_trains(tmp_path):
    from dllmflow.data.prepare import prepare

    prep = tmp_path / "prepared"
    prepare(load_settings(ROOT / RECIPE, dataset={"limit": 16, "prepared_dir": str(prep)}))
    run = tmp_path / "run"
    overrides = f"dataset.limit=16,dataset.prepared_dir={prep},train.max_steps=2,train.local_batch_size=4"
    proc = torchx(
        "run", "-s", "local_cwd", "dllmflow.train", "--params", RECIPE,
        "--run_dir", str(run), "--set", overrides, timeout=600,
    )  # fmt: skip
    assert "SUCCEEDED" in proc.stderr + proc.stdout
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1, 2]
    assert (run / "checkpoints" / "LATEST" / "model" / "consolidated" / "config.json").is_file()
