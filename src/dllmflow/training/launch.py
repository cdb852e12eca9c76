"""`dllmflow train`: write settings.json, launch `python -m dllmflow.training.main` under torchrun via torchx, wait.

    dllmflow train --params params/tiny_mdlm.yaml [more.yaml ...] [--resume | --overwrite] [--set train.lr=1e-4 ...]
    # run dir: --run-dir, else the recipe's run_dir, else runs/<name>/cli (beside the flow's runs/<name>/flow-<id>)

    from dllmflow.training.launch import launch
    result = launch(settings, run_dir="runs/x")      # raises UserError naming the failing rank

`build_app` is the one AppDef builder, in the style of `torchx.components.dist.ddp`: one role with
`launch.nnodes` replicas, each running torchrun with `launch.nproc_per_node` workers and a c10d
rendezvous (a free port on 127.0.0.1 for local schedulers unless `launch.rdzv_endpoint` is set; the
rank-0 host for cluster schedulers). The settings ride in the AppDef itself ($DLLMFLOW_SETTINGS, with
`--run-dir`): no node reads a settings.json another machine wrote, so none needs a shared volume for it. The torchx CLI component (`dllmflow.train`, in
training/component.py) wraps it. The scheduler is always named (`launch.scheduler`, default
local_cwd), never torchx's default (local_docker). Scheduler settings come from `launch.scheduler_args`,
then the .torchxconfig the torchx CLI would read ($TORCHXCONFIG, e.g. infra/.torchxconfig; else
~/.torchxconfig and ./.torchxconfig).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shlex
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dllmflow.common.cli_args import add_flag
from dllmflow.common.net import free_port
from dllmflow.errors import UserError
from dllmflow.runs import RunLayout, cli_run_dir
from dllmflow.settings.loader import parse_overrides  # re-exported: component.py, bench, tests
from dllmflow.training.live import RUN_ID_ENV, create_run, end_run, tracking_env
from dllmflow.training.main import FAIL_MARKER

ROLE = "trainer"
CLUSTER_RDZV_PORT = 29500


@dataclass
class LaunchResult:
    app_handle: str
    state: str | None  # torchx AppState name (SUCCEEDED, FAILED, ...), None when not waited on
    log_dir: Path | None
    run_dir: Path


class _Raw(str):
    """An argument left unquoted in the bash command line (so bash expands its ${...})."""


def is_local_scheduler(name: str) -> bool:
    """local_cwd, local_docker: the trainers run on the submitting machine (in the flow's train step)."""
    return name.startswith("local")


def check_scheduler(name: str) -> None:
    from torchx.schedulers import get_scheduler_factories

    if name not in get_scheduler_factories():
        raise UserError(
            f"launch.scheduler={name!r} is not a torchx scheduler; choose one of "
            f"{', '.join(sorted(get_scheduler_factories()))}"
        )


def rank0_endpoint(port: int = CLUSTER_RDZV_PORT) -> str:
    """host:port of replica 0 as each scheduler names it (every torchx scheduler sets the variable)."""
    from torchx.specs import macros

    return f"$${{{macros.rank0_env}:=localhost}}:{port}"  # expanded by bash on each node


def rdzv_endpoint(settings) -> str:
    lc = settings.launch
    if lc.rdzv_endpoint:
        return lc.rdzv_endpoint
    if lc.nnodes == 1:
        return "localhost:0"  # torchrun picks a free port itself
    if is_local_scheduler(lc.scheduler):
        return f"127.0.0.1:{free_port()}"
    return rank0_endpoint()


def build_mounts(settings) -> list:
    """`launch.mounts` ('type=volume,src=runs,dst=/app/runs', ...) as torchx mounts."""
    from torchx.specs import parse_mounts

    try:
        return parse_mounts([opt for mount in settings.launch.mounts for opt in mount.split(",")])
    except (KeyError, ValueError) as e:
        raise UserError(
            f"launch.mounts: {e}; write each mount as 'type=volume,src=<claim>,dst=/app/runs' "
            "or 'type=bind,src=/host/path,dst=/app/runs'"
        ) from None


def build_app(
    settings,
    run_dir: str | os.PathLike,
    resume: bool = False,
    endpoint: str | None = None,
    overwrite: bool = False,
    mlflow_run_id: str | None = None,
    entry: str = "dllmflow.training.main",
    tether_to: int | None = None,
):
    """The torchx AppDef that runs the trainer on `launch.nnodes` x `launch.nproc_per_node` processes.
    `endpoint` overrides the rendezvous endpoint `rdzv_endpoint(settings)` picks; with `mlflow_run_id`,
    rank 0 logs metrics live into that MLflow run (training/live.py). `entry`: the module torchrun runs
    (dllmflow.rl for GRPO). `tether_to`: the pid of the process starting a local replica: torchrun then
    gets SIGTERM when it dies (`training/tether.py`), so a killed `dllmflow train` takes its ranks along."""
    from torchx import specs

    from dllmflow.settings import SETTINGS_ENV, settings_env_value

    lc = settings.launch
    endpoint = _Raw(endpoint or rdzv_endpoint(settings))
    cmd = [
        "torchrun",
        "--nnodes", str(lc.nnodes),
        "--nproc_per_node", str(lc.nproc_per_node),
        "--rdzv_backend", lc.rdzv_backend,
        "--rdzv_endpoint", endpoint,
        "--rdzv_id", specs.macros.app_id,
        "--max_restarts", str(lc.max_restarts),
        "--tee", "3",
    ]  # fmt: skip
    if lc.rdzv_backend == "static":
        cmd += ["--node_rank", specs.macros.replica_id]
    cmd += ["-m", entry, "--run-dir", str(run_dir)]  # the settings travel in the env, not a shared file
    cmd += ["--resume"] if resume else ["--overwrite"] if overwrite else []
    if tether_to is not None:  # `exec`: the tether replaces bash, so its parent is the launcher itself
        cmd = ["exec", sys.executable, "-m", "dllmflow.training.tether", str(tether_to), "--", *cmd]
    # shlex-quote everything but the endpoint, which may hold a ${RANK0_HOST} for bash to expand
    script = " ".join(arg if isinstance(arg, _Raw) else shlex.quote(arg) for arg in cmd)
    env = {"LOGLEVEL": os.environ.get("LOGLEVEL", "WARNING"), "PYTHONUNBUFFERED": "1", **lc.env}
    env.update(tracking_env(settings, mlflow_run_id))
    env[SETTINGS_ENV] = settings_env_value(settings.with_run_dir(run_dir))
    res = lc.resources
    return specs.AppDef(
        name=f"dllmflow-{settings.name}",
        roles=[
            specs.Role(
                name=ROLE,
                image=lc.image,
                entrypoint="bash",
                args=["-c", script],
                num_replicas=lc.nnodes,
                resource=specs.Resource(cpu=res.cpu, gpu=res.gpu, memMB=res.memory_mb),
                env=env,
                port_map={"c10d": CLUSTER_RDZV_PORT},
                max_retries=0,
                mounts=build_mounts(settings),
            )
        ],
    )


def launch(
    settings,
    run_dir: str | os.PathLike | None = None,
    resume: bool = False,
    wait: bool = True,
    stream: bool = True,
    overwrite: bool = False,
    mlflow_run_id: str | None = None,
    entry: str = "dllmflow.training.main",
) -> LaunchResult:
    """Write RUN/settings.json, submit the app on `launch.scheduler`, wait (echoing the trainers' stdout
    for local schedulers when `stream`); raise UserError naming the failing rank on failure. The
    settings.json records `run_dir` as the run dir (what the trainers write to). A fresh run into a run
    dir holding checkpoints is refused before anything is written (`resume` or `overwrite`)."""
    from torchx.runner import get_runner
    from torchx.specs import AppState

    lc = settings.launch
    if run_dir is not None:
        settings = settings.with_run_dir(run_dir)
    layout = RunLayout(settings.resolved_run_dir.absolute())
    run_dir = layout.root
    from dllmflow.common.outputs import hold_dir_lock
    from dllmflow.training.run_dir import check_fresh_run

    # Before settings.json of the run there is replaced: refuse a fresh run over checkpoints, an
    # --overwrite of a dir that is not a run dir, and a run dir another writer holds (rank 0 then
    # holds the lock for the whole training).
    check_fresh_run(layout, resume, overwrite)
    with hold_dir_lock(run_dir, "dllmflow train (launching)"):
        settings.write_json(layout.settings_json)
    local = is_local_scheduler(lc.scheduler)
    cfg: dict[str, Any] = dict(lc.scheduler_args)
    # Scheduler settings a user edits to leave this machine (queue, namespace, partition, ...):
    # `launch.scheduler_args` win over the .torchxconfig the torchx CLI reads: $TORCHXCONFIG if set, else
    # ~/.torchxconfig and ./.torchxconfig (named here: torchx's default list holds the cwd at its import).
    from torchx.runner.config import apply as apply_torchxconfig

    check_scheduler(lc.scheduler)
    apply_torchxconfig(lc.scheduler, cfg, dirs=[str(Path.home()), os.getcwd()])
    log_dir = None
    if local:
        log_dir = Path(cfg.setdefault("log_dir", str(layout.logs_dir)))
        # torchrun must be on PATH for the local schedulers: use the one next to this interpreter.
        bindir = os.path.dirname(sys.executable)
        if bindir not in os.environ.get("PATH", "").split(os.pathsep):
            os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
    # a local replica is this process's child: tethered, it stops when this process is killed (kill -9)
    tether = os.getpid() if local and wait else None
    app = build_app(settings, run_dir, resume, overwrite=overwrite, mlflow_run_id=mlflow_run_id, entry=entry,
                    tether_to=tether)  # fmt: skip
    runner = get_runner()
    try:
        handle = runner.run(app, scheduler=lc.scheduler, cfg=cfg)
    except (ValueError, KeyError) as e:
        raise UserError(f"launch.scheduler={lc.scheduler!r}: cannot submit ({e})") from e
    # this attempt's logs only: earlier attempts of the run dir keep theirs beside them
    app_logs = app_log_dir(log_dir, handle)
    if not wait:
        return LaunchResult(handle, None, app_logs, run_dir)
    with stop_on_signals() as stopped:
        try:
            status = wait_and_stream(runner, handle, app_logs if stream else None)
        except RunStopped:
            runner.cancel(handle)  # SIGTERM to the replicas: torchrun stops the ranks
            raise RunStopped(stopped.signum, f"{stopped.name}: the run was cancelled ({handle}); its last "
                             f"complete checkpoint stays in {run_dir}: continue with --resume") from None  # fmt: skip
    state = status.state if status is not None else AppState.UNKNOWN
    if state != AppState.SUCCEEDED:
        raise UserError(describe_failure(handle, AppState(state).name, app_logs, status))
    return LaunchResult(handle, AppState(state).name, app_logs, run_dir)


def app_log_dir(log_dir: Path | None, handle: str) -> Path | None:
    """Where a local scheduler writes THIS app's logs: <log_dir>/<session>/<app id>."""
    from torchx.specs import parse_app_handle

    if log_dir is None:
        return None
    parsed = parse_app_handle(handle)
    return log_dir / parsed.session_name / parsed.app_id


class RunStopped(KeyboardInterrupt):
    """The launcher got SIGINT/SIGTERM while waiting: the app is cancelled; the CLI prints this one
    line and exits 128 + the signal (no traceback)."""

    def __init__(self, signum: int, message: str = ""):
        super().__init__(message)
        self.exit_code = 128 + signum


@dataclass
class _Stop:
    signum: int = 0
    name: str = ""


@contextlib.contextmanager
def stop_on_signals() -> Iterator[_Stop]:
    """SIGINT and SIGTERM raise RunStopped inside the block (torchx's handlers raise an exception with a
    traceback); the previous handlers come back after it."""
    import signal
    import threading

    stopped = _Stop()

    def stop(signum, frame):
        stopped.signum, stopped.name = signum, signal.Signals(signum).name
        raise RunStopped(signum)

    if threading.current_thread() is not threading.main_thread():  # only the main thread takes signals
        yield stopped
        return
    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stopped
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def wait_and_stream(runner, handle: str, log_dir: Path | None, poll_s: float = 1.0):
    """Poll until the app is terminal, printing new lines of each replica's stdout log (local schedulers;
    `log_dir`: the app's own, `app_log_dir`)."""
    offsets: dict[Path, int] = {}

    def echo() -> None:
        for log in sorted(log_dir.glob(f"{ROLE}/*/stdout.log")) if log_dir else []:
            data = log.read_bytes()
            end = data.rfind(b"\n") + 1  # only complete lines
            if end > offsets.get(log, 0):
                sys.stdout.write(data[offsets.get(log, 0) : end].decode(errors="replace"))
                sys.stdout.flush()
                offsets[log] = end

    while True:
        status = runner.status(handle)
        echo()
        if status is None or status.is_terminal():
            return status
        time.sleep(poll_s)


_FAIL_RE = re.compile(r"\[rank (\d+)\] " + re.escape(FAIL_MARKER) + r" (.*)")
# A rank that dies takes its peers' collectives down with it: those errors are consequences, not causes.
_COLLATERAL = re.compile(
    r"Connection (closed|reset) by peer|Broken pipe|timed out|NCCL communicator was aborted", re.I
)


def describe_failure(handle: str, state: str, log_dir: Path | None, status: Any = None) -> str:
    """One message with the failing rank(s) (root cause first), their error and where the logs are."""
    failures: dict[int, str] = {}
    tail: list[str] = []
    for log in sorted(log_dir.rglob("stderr.log")) if log_dir and log_dir.is_dir() else []:
        text = log.read_text(errors="replace").splitlines()
        for line in text:
            if m := _FAIL_RE.search(line):
                failures.setdefault(int(m.group(1)), m.group(2).strip())
        if not tail and any("Error" in line for line in text):
            tail = [line for line in text if line.strip()][-8:]
    lines = [f"training {state} ({handle})"]
    causes = {r: e for r, e in failures.items() if not _COLLATERAL.search(e)} or failures
    for rank, err in sorted(causes.items()):
        lines.append(f"rank {rank} failed: {err}")
    others = sorted(set(failures) - set(causes))
    if others:
        lines.append(f"then rank(s) {', '.join(map(str, others))} stopped (lost their peers)")
    if not failures:
        if tail:
            lines.append("last error lines:\n    " + "\n    ".join(tail))
        elif status is not None and getattr(status, "msg", ""):
            lines.append(str(status.msg))
    if log_dir:
        lines.append(f"logs: {log_dir}")
    return "\n".join(lines)


# ---- CLI ------------------------------------------------------------------------------------------


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--params", nargs="+", required=True, metavar="YAML", help="recipe(s); later ones override"
    )
    how = parser.add_mutually_exclusive_group()
    how.add_argument("--resume", action="store_true", help="continue from RUN/checkpoints/LATEST")
    how.add_argument(
        "--overwrite",
        action="store_true",
        help="delete RUN's old checkpoints and metrics, then train from step 0",
    )
    add_flag(
        parser,
        "--run-dir",
        default=None,
        help="override run_dir (default: the recipe's run_dir, else runs/<name>/cli, beside the flow's runs)",
    )
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override a field, e.g. train.lr=1e-4"
    )


def cli_main(args: argparse.Namespace) -> int:
    from dllmflow.settings import load_settings
    from dllmflow.training.run_dir import check_overwritable

    settings = load_settings(*args.params, **parse_overrides(args.set))
    run_dir = args.run_dir or settings.run_dir or cli_run_dir(settings.resolved_run_dir)
    # a run dir that is not ours is refused before an MLflow run is opened for it
    check_overwritable(RunLayout(settings.with_run_dir(run_dir).resolved_run_dir))
    with owned_run(settings, {"dllmflow.source": "train"}) as run_id:
        result = launch(
            settings, run_dir=run_dir, resume=args.resume, overwrite=args.overwrite, mlflow_run_id=run_id
        )
    print(f"training {result.state}: {result.run_dir}" + (f" (MLflow run {run_id})" if run_id else ""))
    return 0


@contextlib.contextmanager
def owned_run(settings, tags: dict[str, str]) -> Iterator[str | None]:
    """The MLflow run id a CLI launch (`dllmflow train`, `dllmflow rl`) logs into: the one handed down in
    the env (a flow's), else a new run with `tags` that this launch owns and marks FINISHED or FAILED at
    the end. None when tracking is off or the store is unreachable: training never waits for MLflow
    (`dllmflow register` can still record the run afterwards)."""
    given = os.environ.get(RUN_ID_ENV)
    run_id = given or _open_run(settings, tags)
    status = "FAILED"
    try:
        yield run_id
        status = "FINISHED"
    finally:
        if run_id and not given:
            try:
                end_run(settings, run_id, status)
            except Exception as e:  # the training result stands; only its MLflow status is stale
                print(f"warning: could not mark MLflow run {run_id} {status}: {e}", file=sys.stderr)


def _open_run(settings, tags: dict[str, str]) -> str | None:
    if not settings.registry.live_tracking:
        return None
    from dllmflow.training.live import resolve_tracking_uri

    try:
        return create_run(settings, tags={"dllmflow.mode": settings.dllm.mode, **tags})
    except Exception as e:
        print(
            f"warning: MLflow tracking at {resolve_tracking_uri(settings)} unavailable ({type(e).__name__}: "
            f"{str(e)[:200]}); training without live tracking",
            file=sys.stderr,
        )
        return None
