"""One flow step as a "pod" of tests/e2e/test_shared_nothing.py: `python _pod.py request.json`, run by the
test with a cwd, HOME, TMPDIR and cache dirs of the pod's own. It calls what the flow's step calls
(workflow/data_steps.py, workflow/finetune.py, workflow/restore.py, training/launch.py) with the flow's
settings dict, and writes the step's small result (its artifact) as JSON to `request["result"]`.

    {"call": "plan"|"unit"|"join"|"prepare"|"train"|"evaluate"|"register"|"one_machine", "settings": {...}}

`train` submits the torchx AppDef through `launch` (launch.scheduler=kubernetes) to `ClusterRunner`, a
stand-in for the cluster: each replica is a pod of its own (its own dirs, the AppDef's command and env,
nothing else), as Kubernetes would run it; with "nodes_per_app" each submission (uno's AR control, then
its adapter) gets pods of its own. `unit` with "kill_after_puts": n dies by SIGKILL right after
its n-th upload to the bucket, as a pod killed mid-task.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any


class ClusterRunner:
    """The part of torchx's Runner that `training.launch.launch` uses (run, status, cancel), running
    each replica of the AppDef's role in a pod of its own (`pods`: {"root", "cwd", "env", "log"} each).
    A path of the submitting pod's disk (`here`: its root) in the AppDef (launch makes the run dir
    absolute) names the same path on each replica's own disk: its root instead of ours, on this machine."""

    def __init__(self, pods: list[dict[str, Any]], here: str) -> None:
        self.pods, self.here, self.procs = pods, here, []

    def run(self, app, scheduler: str, cfg: dict) -> str:
        from torchx.specs import macros

        (role,) = app.roles
        assert role.num_replicas == len(self.pods), (role.num_replicas, len(self.pods))
        for replica, pod in enumerate(self.pods):
            node = macros.Values(img_root="", app_id="e2e", replica_id=str(replica), rank0_env="RANK0_HOST")
            node_role = node.apply(role)
            flag, script = (a.replace(self.here, pod["root"]) for a in node_role.args)  # bash -c SCRIPT
            env = {k: _on_disk(k, v, self.here, pod["root"]) for k, v in node_role.env.items()}
            proc = subprocess.Popen(  # the replica writes its own log, on its own disk
                [node_role.entrypoint, flag, f"exec >{shlex.quote(pod['log'])} 2>&1; {script}"],
                cwd=pod["cwd"],
                env={**pod["env"], **env},  # the pod's image env, then the AppDef's
            )
            self.procs.append(proc)
        return f"{scheduler}://e2e/{app.name}"

    def status(self, handle: str):
        from torchx.specs import AppState, AppStatus

        codes = [p.poll() for p in self.procs]
        if any(c not in (None, 0) for c in codes):
            self.cancel(handle)
            return AppStatus(state=AppState.FAILED)
        return AppStatus(state=AppState.SUCCEEDED if all(c == 0 for c in codes) else AppState.RUNNING)

    def cancel(self, handle: str) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
                p.wait(timeout=60)


def _on_disk(key: str, value: str, here: str, there: str) -> str:
    """An AppDef env value with the paths of `here` on the disk `there` (the settings: encoded JSON)."""
    import base64
    import gzip

    from dllmflow.settings import SETTINGS_ENV

    if key != SETTINGS_ENV:
        return value.replace(here, there)
    text = gzip.decompress(base64.b64decode(value)).decode().replace(here, there)
    return base64.b64encode(gzip.compress(text.encode(), mtime=0)).decode("ascii")


def _kill_after_puts(n: int) -> None:
    """The pod dies (SIGKILL: no cleanup, no exception) right after its n-th upload to the store."""
    import dllmflow.data.remote as remote

    real, done = remote.remote_fs, [0]

    def remote_fs(url, **kwargs):
        fs, base = real(url, **kwargs)
        put_file = fs.put_file

        def counted(*args, **kw):
            put_file(*args, **kw)
            done[0] += 1
            if done[0] >= n:
                os.kill(os.getpid(), signal.SIGKILL)

        fs.put_file = counted
        return fs, base

    remote.remote_fs = remote_fs


def main(request: dict[str, Any]) -> Any:
    from dllmflow.workflow import data_steps, finetune
    from dllmflow.workflow.restore import restore_run_dir

    settings, call = request["settings"], request["call"]
    if call == "one_machine":  # the reference: one machine, its own prepared dir, nothing remote
        data = data_steps.prepare_data(settings)
        return {"data": data, "training": finetune.train(settings, request["run_dir"])}
    if call == "plan":
        return data_steps.plan_data(settings)
    if call == "unit":
        if request.get("kill_after_puts"):
            _kill_after_puts(request["kill_after_puts"])
        data_steps.prepare_unit(settings, request["planned"], request["k"])
        return None
    if call == "join":
        data = data_steps.join_data(settings, request["planned"])
        return {"data": data, "settings": data_steps.pin_published(settings, data)}
    if call == "prepare":  # the flow's data steps in one pod: plan, units and join, then pinned
        data = data_steps.prepare_data(settings)
        return {"data": data, "settings": data_steps.pin_published(settings, data)}
    if call == "train":  # the flow's train step, its torchx AppDef submitted to the cluster stand-in
        import torchx.runner

        # each submission gets the next `nodes_per_app` pods (fresh ones, as a cluster schedules a new app)
        per = request.get("nodes_per_app") or len(request["nodes"])
        apps = iter([request["nodes"][i : i + per] for i in range(0, len(request["nodes"]), per)])
        torchx.runner.get_runner = lambda: ClusterRunner(next(apps), request["root"])
        training = finetune.train(settings, request["run_dir"])
        return {"app_handle": training["app_handle"], "run_dir": training["run_dir"], "training": training}
    if call == "evaluate":
        restored = restore_run_dir(settings, request["run_dir"])
        result = finetune.evaluate_sampler(settings, request["run_dir"], request["sampler"])
        return {"restored": restored, "eval": result}
    if call == "register":
        restored = restore_run_dir(settings, request["run_dir"])
        registration = finetune.register(
            settings, request["run_dir"], request["evals"], data=request["data"], training=request["training"]
        )
        return {"restored": restored, "registration": registration}
    raise ValueError(f"unknown call {call!r}")


if __name__ == "__main__":
    req = json.loads(Path(sys.argv[1]).read_text())
    out = main(req)
    Path(req["result"]).write_text(json.dumps(out, default=str))
