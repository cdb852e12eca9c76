"""The registered model installs itself: a tiny model trained for 2 steps is registered and promoted,
then `mlflow models serve -m models:/<name>@champion --env-manager virtualenv` builds a fresh venv
from the model's own python_env.yaml / requirements.txt (this project's wheel logged with the model,
requirements.lock as constraints; packages from the package registry and pip's cache only) and
answers `/invocations` with generated text.

The consumer runs outside the checkout, with no PYTHONPATH: the scoring server's process runs the new
env's python, and `import dllmflow` in that env resolves inside the env (installed from the wheel, not
an editable link back here). Also checks the LoggedModel the version was registered from (its eval
metrics and the prepared dataset). The environment build dominates (221-276 s measured on 2 busy
cores, ~2 GB installed, torch and mlflow most of it); it prints its time (`-s`), asserting none.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from _prepared import prepare_tiny
from _services import BIN, stop, wait_until

from dllmflow.common.net import free_port
from dllmflow.settings import load_settings

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "params" / "tiny_mdlm.yaml"
MODEL = "installs-itself"
# In the default run (CI too): 2-5 min on 2 cores, the env build (pip installing torch and mlflow) dominating.
pytestmark = pytest.mark.slow

# Nothing of this project, nor of the developer's settings, reaches the consumer.
_DROP = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "DLLMFLOW_", "DLLM_", "MLFLOW_")


def _consumer_env(tracking_uri: str, env_root: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_DROP)}
    env["MLFLOW_TRACKING_URI"] = tracking_uri
    env["MLFLOW_ENV_ROOT"] = str(env_root)  # where the env manager builds the venv (found below)
    env["MLFLOW_DISABLE_TELEMETRY"] = "true"
    # MLflow's virtualenv manager gets the model's Python through pyenv.
    pyenv_bin = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "bin"
    env["PATH"] = os.pathsep.join([str(BIN), str(pyenv_bin), env.get("PATH", "")])
    return env


def _train_and_register(tmp: Path, uri: str):
    from dllmflow.runs import find_consolidated
    from dllmflow.tracking import mlflow_run, registry
    from dllmflow.training.trainer import run_training

    prepared = prepare_tiny(_Factory(tmp), RECIPE, limit=8, seq_length=128)
    settings = load_settings(
        RECIPE,
        dataset={"limit": 8, "seq_length": 128, "prepared_dir": str(prepared)},
        train={"max_steps": 2, "global_batch_size": 2, "local_batch_size": 2, "warmup_steps": 0},
        checkpoint={"every_steps": 2, "save_consolidated": "final"},
        registry={"tracking_uri": uri, "model_name": MODEL, "gate": {"min_accuracy": 0.0}},
    )
    run_dir = tmp / "run"
    run_training(settings, run_dir)
    evals = {
        "llada": {
            "metrics": {"exact_match_flexible": 0.25, "tokens_per_s": 10.0},
            "protocol": {"sampler": "llada", "sampler_settings": {"steps": 4, "max_new_tokens": 4}},
        }
    }
    run_id = mlflow_run.log_run(settings, run_dir, evals=evals, lineage={"metaflow_run": "I/1"})
    version = registry.register_model(
        settings, run_id, find_consolidated(run_dir), sampler="llada", sampler_settings={"steps": 4}
    )
    assert registry.apply_gate(settings, version, evals, "llada")["promoted"]
    return version


class _Factory:
    """`prepare_tiny` takes a tmp_path_factory; this one makes dirs under the test's own tmp_path."""

    def __init__(self, tmp: Path):
        self.tmp = tmp

    def mktemp(self, name: str) -> Path:
        path = self.tmp / name
        path.mkdir()
        return path


def _server_processes(session: int) -> list[tuple[list[str], dict[str, str], str]]:
    """(argv, environ, cwd) of every process of the server's session (it was started in its own)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.getsid(int(pid)) != session:
                continue
            proc = Path("/proc") / pid
            argv = proc.joinpath("cmdline").read_bytes().decode().split("\0")
            environ = dict(
                item.split("=", 1)
                for item in proc.joinpath("environ").read_bytes().decode().split("\0")
                if "=" in item
            )
            found.append((argv, environ, os.readlink(proc / "cwd")))
        except (OSError, ProcessLookupError):
            continue
    return found


@pytest.mark.timeout(1500)
def test_champion_serves_from_an_env_it_builds_itself(tmp_path, monkeypatch):
    from mlflow import MlflowClient

    monkeypatch.chdir(tmp_path)  # MLflow's artifact root on SQLite is ./mlruns
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    version = _train_and_register(tmp_path, uri)

    # The version comes from its LoggedModel, which carries the run's eval metrics and the dataset.
    client = MlflowClient(uri)
    model_id = version.source.removeprefix("models:/")
    logged = client.get_logged_model(model_id)
    assert version.source == f"models:/{logged.model_id}" and logged.source_run_id == version.run_id
    assert {m.key for m in logged.metrics} >= {"eval/llada/exact_match_flexible"}
    run = client.get_run(version.run_id)
    assert [d.dataset.digest for d in run.inputs.dataset_inputs]
    shutil.rmtree(tmp_path / "run")  # the consumer has no training dirs

    consumer = tmp_path / "consumer"  # not the checkout, nothing of it on any path
    consumer.mkdir()
    envs = tmp_path / "envs"
    env = _consumer_env(uri, envs)
    port = free_port()
    log = tmp_path / "serve.log"
    t0 = time.monotonic()
    cmd = [str(BIN / "mlflow"), "models", "serve", "-m", f"models:/{MODEL}@champion"]
    cmd += ["--env-manager", "virtualenv", "-h", "127.0.0.1", "-p", str(port), "-w", "1"]
    server = _start_in(consumer, cmd, env, log)
    try:
        wait_until(lambda: _ping(port), server, "mlflow models serve (virtualenv)", 1200, log)
        built_s = time.monotonic() - t0
        print(f"\n[pyfunc-install] env built and server up in {built_s:.0f} s")

        reply = httpx.post(
            f"http://127.0.0.1:{port}/invocations",
            json={"inputs": ["What is 2 + 3?"], "params": {"steps": 4, "max_new_tokens": 4}},
            timeout=300,
        )
        assert reply.status_code == 200, reply.text
        predictions = reply.json()["predictions"]
        assert len(predictions) == 1 and isinstance(predictions[0], str), predictions

        # The server runs the env's python, from the consumer's dir, with no PYTHONPATH.
        (venv,) = [p for p in (envs).iterdir() if (p / "bin" / "python").exists()]
        procs = _server_processes(server.pid)
        served = [p for p in procs if p[0] and p[0][0].startswith(str(venv))]
        assert served, f"no server process runs {venv}/bin/python: {[p[0][:2] for p in procs]}"
        for argv, environ, cwd in served:
            assert "PYTHONPATH" not in environ and not cwd.startswith(str(ROOT)), (argv, cwd)
        # ... where dllmflow is the wheel's copy, installed in the env.
        probe = subprocess.run(
            [str(venv / "bin" / "python"), "-c", _WHERE],
            cwd=consumer,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert probe.returncode == 0, probe.stderr[-2000:]
        where = json.loads(probe.stdout.strip().splitlines()[-1])
        assert where["file"].startswith(str(venv / "lib")), where
        assert not where["editable"], where
    finally:
        stop(server)


_WHERE = (
    "import dllmflow, json, importlib.metadata as m; "
    "d = m.distribution('dllmflow'); u = d.read_text('direct_url.json') or '{}'; "
    "print(json.dumps({'file': dllmflow.__file__, "
    "'editable': json.loads(u).get('dir_info', {}).get('editable', False)}))"
)


def _start_in(cwd: Path, cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    out = open(log, "w")  # noqa: SIM115 - lives as long as the server
    return subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
    )


def _ping(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/ping", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
