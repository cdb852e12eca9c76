"""Production settings of the flows: cron validation, train step resource placement, run tags, mounts.

`dllmflow.workflow.deploy` and the `flow:` / `launch:` sections; the compiled Argo template is checked in
tests/integration/test_argo.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from dllmflow.errors import UserError
from dllmflow.settings import SettingsError, load_settings
from dllmflow.training.launch import build_app
from dllmflow.workflow.deploy import run_tags, train_step_resources

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "cron", ["0 3 * * *", "0 3 * * ? *", "*/15 0-6 1,15 JAN-MAR MON-FRI", "0 0 ? * SUN *", "@daily"]
)
def test_cron_forms_argo_and_metaflow_accept(cron):
    assert load_settings(flow={"schedule_cron": cron}).flow.schedule_cron == cron


@pytest.mark.parametrize(
    "cron, needle",
    [
        ("0 3 * *", "has 4 fields"),
        ("61 * * * *", "minute '61' is not in 0-59"),
        ("0 3 32 * *", "day of month '32'"),
        ("0 3 * 13 *", "month '13'"),
        ("0 ? * * *", "bad hour field"),
        ("daily", "has 1 fields"),
    ],
)
def test_invalid_cron_fails_at_parse_naming_the_field(cron, needle):
    with pytest.raises(SettingsError, match="flow.schedule_cron") as err:
        load_settings(flow={"schedule_cron": cron})
    assert needle in str(err.value)


def test_project_name_follows_metaflow_rules():
    with pytest.raises(SettingsError, match="flow.project.*a-z, 0-9 and '_'"):
        load_settings(flow={"project": "My-Project"})


def test_local_scheduler_puts_the_trainers_resources_on_the_step():
    s = load_settings(launch={"nnodes": 2, "resources": {"cpu": 4, "gpu": 2, "memory_mb": 10000}})
    assert train_step_resources(s) == {"cpu": 8, "memory": 20000, "gpu": 4}
    # no GPU anywhere: no gpu key (an explicit gpu=0 would still ask Kubernetes for nvidia.com/gpu: 0)
    assert train_step_resources(load_settings()) == {"cpu": 2, "memory": 8192}
    # flow.resources still wins where it asks for more (the step also runs the launcher)
    big = load_settings(flow={"resources": {"cpu": 32, "gpu": 0, "memory_mb": 1000}})
    assert train_step_resources(big) == {"cpu": 32, "memory": 8192}


def test_cluster_scheduler_step_only_submits():
    s = load_settings(
        launch={"scheduler": "kubernetes", "resources": {"cpu": 64, "gpu": 8, "memory_mb": 512000}},
        flow={"resources": {"cpu": 1, "memory_mb": 2048}},
    )
    assert train_step_resources(s) == {"cpu": 1, "memory": 2048}
    with pytest.raises(UserError, match="flow.resources.gpu=8 .* launch.resources.gpu"):
        train_step_resources(load_settings(launch={"scheduler": "slurm"}, flow={"resources": {"gpu": 8}}))


def test_unknown_scheduler_lists_the_choices():
    with pytest.raises(
        UserError, match="launch.scheduler='k8s' is not a torchx scheduler; choose one of .*kubernetes"
    ):
        train_step_resources(load_settings(launch={"scheduler": "k8s"}))


def test_run_tags():
    s = load_settings(ROOT / "params" / "tiny_mdlm.yaml").to_dict()
    assert run_tags(s) == ["mode:mdlm", "recipe:tiny_mdlm"]
    assert run_tags(s, {"content_hash": "0123456789abcdef"})[-1] == "data:0123456789ab"


def test_launch_mounts_reach_the_role(tmp_path):
    s = load_settings(
        launch={"mounts": ["type=volume,src=runs,dst=/app/runs", "type=bind,src=/data,dst=/data,readonly"]}
    )
    (role,) = build_app(s, tmp_path).roles
    assert [(type(m).__name__, m.dst_path) for m in role.mounts] == [
        ("VolumeMount", "/app/runs"),
        ("BindMount", "/data"),
    ]
    assert role.mounts[1].read_only
    with pytest.raises(UserError, match="launch.mounts"):
        build_app(load_settings(launch={"mounts": ["src=runs,dst=/app/runs"]}), tmp_path)


_LEAN_FLOW = """
import atexit, gc
from metaflow import Config, FlowSpec, step
from dllmflow.workflow.deploy import deployment


@deployment(config="recipe")
class LeanFlow(FlowSpec):
    recipe = Config("recipe", default="RECIPE",
                    parser="dllmflow.workflow.finetune.parse_params_config")

    @step
    def start(self):  # reported at exit, i.e. after what runs once the step body returned
        atexit.register(lambda: open("OUT/start", "w").write(str(gc.get_freeze_count())))
        self.next(self.end)

    @step
    def end(self):
        atexit.register(lambda: open("OUT/end", "w").write(str(gc.get_freeze_count())))
        raise RuntimeError("a failed step is left alone")


if __name__ == "__main__":
    LeanFlow()
"""


def test_each_step_freezes_the_gc_once_it_succeeded_so_its_process_exits_fast(tmp_path):
    """`lean_exit` (added by @deployment to every step): after a successful step the process's objects
    are frozen (its exit then skips the final collections); a failed step's are not."""
    import os
    import subprocess
    import sys

    flow = tmp_path / "lean_flow.py"
    flow.write_text(
        _LEAN_FLOW.replace("RECIPE", str(ROOT / "params" / "tiny_addition.yaml")).replace(
            "OUT", str(tmp_path)
        )
    )
    env = {**os.environ, "METAFLOW_DATASTORE_SYSROOT_LOCAL": str(tmp_path), "USERNAME": "test"}
    run = subprocess.run(
        [sys.executable, str(flow), "run"], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert run.returncode != 0 and "a failed step is left alone" in run.stderr + run.stdout
    assert int((tmp_path / "start").read_text()) > 1000  # the step's process: torch-free, still thousands
    assert int((tmp_path / "end").read_text()) == 0
