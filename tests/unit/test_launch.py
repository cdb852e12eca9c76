"""The torchx component (`build_app`) and the failure message, without launching."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from dllmflow.settings import SETTINGS_ENV, SettingsError, load_settings, load_settings_env
from dllmflow.training.launch import build_app, describe_failure, parse_overrides


def _cmd(app) -> list[str]:
    (role,) = app.roles
    assert role.entrypoint == "bash" and role.args[0] == "-c"
    return shlex.split(role.args[1])


def _flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def test_single_node_app_runs_the_entry_point_under_torchrun(tmp_path):
    s = load_settings(launch={"nproc_per_node": 2, "env": {"FOO": "bar"}, "resources": {"cpu": 3}})
    app = build_app(s, tmp_path, resume=True)
    cmd = _cmd(app)
    assert cmd[0] == "torchrun" and _flag(cmd, "--nnodes") == "1" and _flag(cmd, "--nproc_per_node") == "2"
    assert _flag(cmd, "--rdzv_endpoint") == "localhost:0"
    assert cmd[-5:] == ["-m", "dllmflow.training.main", "--run-dir", str(tmp_path), "--resume"]
    role = app.roles[0]
    assert role.num_replicas == 1 and role.env["FOO"] == "bar" and role.resource.cpu == 3
    # the settings ride in the AppDef (no shared settings.json): exactly these, recording this run dir
    carried = load_settings_env(role.env[SETTINGS_ENV])
    assert carried.to_dict() == s.with_run_dir(tmp_path).to_dict()
    assert carried.train.max_steps == s.train.max_steps and Path(carried.resolved_run_dir) == tmp_path


def test_carried_settings_that_are_not_the_launchers_fail_in_one_line():
    import base64
    import gzip

    with pytest.raises(SettingsError, match=r"\$DLLMFLOW_SETTINGS is not set"):
        load_settings_env(None)
    with pytest.raises(SettingsError, match=r"\$DLLMFLOW_SETTINGS: not settings written by the launcher"):
        load_settings_env("not base64 !")
    bad = base64.b64encode(gzip.compress(b'{"train": {"lr": "fast"}}')).decode()
    with pytest.raises(SettingsError, match=r"train\.lr"):
        load_settings_env(bad)


def test_multi_node_app_uses_one_rendezvous_endpoint(tmp_path):
    s = load_settings(launch={"nnodes": 2, "nproc_per_node": 1, "max_restarts": 3})
    app = build_app(s, tmp_path)
    cmd = _cmd(app)
    host, port = _flag(cmd, "--rdzv_endpoint").split(":")
    assert host == "127.0.0.1" and int(port) > 0  # a free local port: both "nodes" run on this machine
    assert _flag(cmd, "--max_restarts") == "3" and _flag(cmd, "--rdzv_backend") == "c10d"
    assert app.roles[0].num_replicas == 2 and "--resume" not in cmd

    fixed = build_app(load_settings(launch={"nnodes": 2, "rdzv_endpoint": "head:29400"}), tmp_path)
    assert _flag(_cmd(fixed), "--rdzv_endpoint") == "head:29400"


def test_failure_message_names_the_root_cause_rank_first(tmp_path):
    logs = tmp_path / "logs" / "torchx" / "app" / "trainer"
    for replica, line in (
        (
            0,
            "[default0]:[rank 0] dllmflow.training.main failed: RuntimeError: [pair.cc:553] Connection closed by peer",
        ),
        (1, "[default0]:[rank 1] dllmflow.training.main failed: ValueError: bad batch in row 7"),
    ):
        (logs / str(replica)).mkdir(parents=True)
        (logs / str(replica) / "stderr.log").write_text(f"Traceback ...\n{line}\n")
    msg = describe_failure("local_cwd://torchx/app", "FAILED", tmp_path / "logs")
    lines = msg.splitlines()
    assert lines[1] == "rank 1 failed: ValueError: bad batch in row 7"
    assert "rank(s) 0 stopped" in lines[2] and lines[-1] == f"logs: {tmp_path / 'logs'}"


def test_set_overrides_parse_like_yaml_values():
    assert parse_overrides(["train.lr=1e-4", "launch.nnodes=2", "name=abc", "eval.samplers=[llada]"]) == {
        "train.lr": 1e-4, "launch.nnodes": 2, "name": "abc", "eval.samplers": ["llada"],
    }  # fmt: skip


def test_torchxconfig_sections_reach_the_scheduler_cfg():
    """infra/.torchxconfig holds the settings a user edits to leave the machine; its keys are valid
    run options of each scheduler (torchx warns about unknown ones)."""
    from torchx.runner.config import apply
    from torchx.schedulers import get_scheduler_factories

    root = Path(__file__).resolve().parents[2]
    for scheduler in ("local_cwd", "kubernetes", "slurm"):
        cfg: dict = {}
        apply(scheduler, cfg, dirs=[str(root / "infra")])
        assert cfg, scheduler
        opts = get_scheduler_factories()[scheduler](session_name="t").run_opts()
        assert set(cfg) <= {name for name, _ in opts}, (scheduler, cfg)


def test_run_dir_flag_is_the_run_dir_recorded_in_settings_json(tmp_path, monkeypatch):
    """`dllmflow train --run-dir X`: settings.json (and so metrics and MLflow params) names X, where the
    trainers write (their --run-dir, and the run dir the settings they carry record)."""
    import json

    import torchx.runner

    from dllmflow.training import launch as launch_mod

    submitted = []

    class FakeRunner:
        def run(self, app, scheduler, cfg):
            submitted.append(app)
            return "local_cwd://fake/app"

    monkeypatch.setattr(torchx.runner, "get_runner", lambda: FakeRunner())
    monkeypatch.chdir(tmp_path)
    s = load_settings(name="rd")
    assert s.run_dir is None
    result = launch_mod.launch(s, run_dir="elsewhere/x", wait=False)
    written = tmp_path / "elsewhere" / "x" / "settings.json"
    assert result.run_dir == written.parent
    assert json.loads(written.read_text())["run_dir"] == "elsewhere/x"
    assert _flag(_cmd(submitted[0]), "--run-dir") == str(written.parent)
    carried = load_settings_env(submitted[0].roles[0].env[SETTINGS_ENV])
    assert carried.to_dict() == json.loads(written.read_text())  # what the trainers get is what was recorded
    # already the recorded run dir (the flow's case): recorded as it was
    flow = load_settings(name="rd", run_dir="runs/rd/flow-1")
    launch_mod.launch(flow, run_dir=Path("runs/rd/flow-1").absolute(), wait=False)
    assert json.loads((tmp_path / "runs/rd/flow-1/settings.json").read_text())["run_dir"] == "runs/rd/flow-1"


def test_the_cli_trains_beside_the_flows_runs_of_the_same_recipe(tmp_path, monkeypatch):
    """README: run a recipe's flow, then `dllmflow train --params` of the same recipe. The CLI's default run
    dir is runs/<name>/cli, beside the flow's runs/<name>/flow-<id> (not runs/<name>, which holds them and is
    no run dir): no refusal, the flow's run untouched, and the recipe dir resolves to the newer export."""
    import argparse
    import contextlib
    import json
    import os

    import torchx.runner

    from dllmflow import runs
    from dllmflow.training import launch as launch_mod

    class FakeRunner:
        def run(self, app, scheduler, cfg):
            return "local_cwd://fake/app"

    monkeypatch.setattr(torchx.runner, "get_runner", lambda: FakeRunner())
    real_launch = launch_mod.launch
    monkeypatch.setattr(launch_mod, "launch", lambda *a, **k: real_launch(*a, **{**k, "wait": False}))
    monkeypatch.setattr(launch_mod, "owned_run", lambda *a, **k: contextlib.nullcontext(None))
    monkeypatch.delenv("DLLMFLOW_RUN_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("name: rd\n")
    # the flow's run of the recipe: runs/rd/flow-7, finished
    flow = runs.RunLayout(runs.flow_run_dir("runs/rd", "7"))
    load_settings(name="rd", run_dir=str(flow.root)).write_json(flow.settings_json)
    export = runs.export_dir(flow.step_dir(2))
    export.mkdir(parents=True)
    (export / "config.json").write_text("{}")
    runs.write_latest(flow.checkpoints, flow.step_dir(2).name)
    before = sorted(p.relative_to(flow.root) for p in flow.root.rglob("*"))

    args = argparse.Namespace(params=[str(recipe)], set=[], run_dir=None, resume=False, overwrite=False)
    assert launch_mod.cli_main(args) == 0
    cli = runs.RunLayout(Path("runs/rd/cli"))
    assert json.loads(cli.settings_json.read_text())["run_dir"] == "runs/rd/cli"
    assert sorted(p.relative_to(flow.root) for p in flow.root.rglob("*")) == before
    # the recipe dir resolves to the newest run with an export: the flow's, until the CLI's is written
    assert (
        runs.resolve_checkpoint("runs/rd")
        == flow.root / runs.CHECKPOINTS / runs.LATEST / "model" / "consolidated"
    )
    cli_export = runs.export_dir(cli.step_dir(1))
    cli_export.mkdir(parents=True)
    (cli_export / "config.json").write_text("{}")
    runs.write_latest(cli.checkpoints, cli.step_dir(1).name)
    os.utime(flow.step_dir(2), (1_000, 1_000))
    assert runs.resolve_checkpoint("runs/rd") == cli.latest_export
    # a recipe (or --run-dir) naming its run dir is used as is
    args.set = ["run_dir=mine"]
    assert launch_mod.cli_main(args) == 0 and (tmp_path / "mine" / "settings.json").is_file()


def _submitted_cfg(monkeypatch, settings) -> dict:
    """The scheduler cfg `launch` hands torchx (a stand-in runner records it; nothing is submitted)."""
    import torchx.runner

    from dllmflow.training import launch as launch_mod

    cfgs = []

    class RecordingRunner:
        def run(self, app, scheduler, cfg):
            cfgs.append(dict(cfg))
            return f"{scheduler}://fake/app"

    monkeypatch.setattr(torchx.runner, "get_runner", lambda: RecordingRunner())
    launch_mod.launch(settings, run_dir="run", wait=False)
    return cfgs[0]


def test_launch_reads_the_torchxconfig_the_torchx_cli_reads(tmp_path, monkeypatch):
    """No .torchxconfig is read from the checkout: $TORCHXCONFIG names one (infra/.torchxconfig),
    else ~/.torchxconfig and ./.torchxconfig, as for `torchx run`; launch.scheduler_args win."""
    root = Path(__file__).resolve().parents[2]
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    monkeypatch.delenv("TORCHXCONFIG", raising=False)
    k8s = load_settings(
        name="cfg", launch={"scheduler": "kubernetes", "scheduler_args": {"namespace": "mine"}}
    )
    assert _submitted_cfg(monkeypatch, k8s) == {"namespace": "mine"}  # nothing found, nothing invented

    monkeypatch.setenv("TORCHXCONFIG", str(root / "infra" / ".torchxconfig"))
    cfg = _submitted_cfg(monkeypatch, k8s)
    assert cfg["queue"] == "default" and cfg["service_account"] == "dllmflow-trainer"  # from the file
    assert cfg["namespace"] == "mine"  # launch.scheduler_args win over the file's ml-training

    monkeypatch.delenv("TORCHXCONFIG")
    (work / ".torchxconfig").write_text("[kubernetes]\nqueue = cwdq\n")
    (home / ".torchxconfig").write_text("[kubernetes]\npriority_class = homepc\n")
    cfg = _submitted_cfg(monkeypatch, k8s)
    assert cfg == {"namespace": "mine", "queue": "cwdq", "priority_class": "homepc"}


def test_torchx_component_is_registered_by_entry_point():
    """`torchx run dllmflow.train` works from any directory: pyproject declares the component module in
    torchx's entry point group, and torchx's linter accepts `train` there (else torchx hides it)."""
    import tomllib

    from torchx.specs.file_linter import validate

    from dllmflow.training import component

    root = Path(__file__).resolve().parents[2]
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    group = project["entry-points"]["torchx.components"]
    assert group["dllmflow"] == "dllmflow.training.component" == component.__name__
    # registering a group hides torchx's builtins unless they are registered too
    assert {group[k] for k in ("dist", "utils")} == {"torchx.components.dist", "torchx.components.utils"}
    assert validate(component.__file__, "train") == []
    # torchx offers every function of the module: `train` is the only one
    import inspect

    assert [n for n, _ in inspect.getmembers(component, inspect.isfunction)] == ["train"]


def test_a_failure_is_reported_from_this_attempts_logs_only(tmp_path):
    """The run dir's logs hold every attempt (<logs>/<session>/<app id>/...): a failed `train` names
    this attempt's cause, not an earlier attempt's (describe_failure read them all, the oldest first)."""
    from dllmflow.training.launch import app_log_dir
    from dllmflow.training.main import FAIL_MARKER

    logs = tmp_path / "logs"
    for app, cause in (
        ("a-old", "ValueError: the earlier attempt's"),
        ("b-new", "RuntimeError: this attempt's"),
    ):
        replica = logs / "torchx" / app / "trainer" / "0"
        replica.mkdir(parents=True)
        (replica / "stderr.log").write_text(f"[default0]:[rank 0] {FAIL_MARKER} {cause}\n")
    handle = "local_cwd://torchx/b-new"
    assert app_log_dir(logs, handle) == logs / "torchx" / "b-new"
    msg = describe_failure(handle, "FAILED", app_log_dir(logs, handle))
    assert msg.splitlines()[1] == "rank 0 failed: RuntimeError: this attempt's" and "earlier" not in msg
