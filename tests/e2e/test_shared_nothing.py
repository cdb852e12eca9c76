"""Shared-nothing end to end (issue #52) on a moto S3 server started by the test: every flow step and each of
two trainer nodes is a "pod", a process (tests/e2e/_pod.py) with a working dir, HOME, TMPDIR and cache dir
of its own, given only the flow's settings dict, the previous steps' small results (Metaflow artifacts) and
the bucket. The settings hold relative paths (`dataset.prepared_dir`, the flow run dir), so each pod
resolves them on its own disk, as pods under Kubernetes do. The steps call what flows/finetune.py's steps
call: plan_data, prepare_unit (one pod per unit), join_data + pin_published, the train step's `launch` of
the torchx AppDef (launch.scheduler=kubernetes) on a cluster stand-in that runs each replica in its own
pod, then restore_run_dir + evaluate_sampler, and restore_run_dir + register.

  * every path a pod wrote lies in its own dirs: an audit hook in each of its Python processes logs what
    they write (tests/e2e/_write_audit), every other pod's dirs are unchanged across it, and so are the
    files of the checkout that git does not track;
  * the losses equal those of a one-machine run of the same recipe (its own prepared dir, nothing
    remote; 1 node x 2 ranks through the flow's finetune.train), bit for bit;
  * a prepare unit killed (SIGKILL) after its first upload and retried in a fresh pod gives the same
    published manifest hash as the one-machine prepare.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dllmflow.common.net import free_port
from dllmflow.runs import RunLayout, read_metrics
from dllmflow.settings import load_settings
from dllmflow.workflow.finetune import flow_run_dir
from integration._services import moto_s3

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "params" / "tiny_addition.yaml"
POD = Path(__file__).with_name("_pod.py")
AUDIT = Path(__file__).with_name("_write_audit")
BUCKET = "dllmflow"
pytestmark = pytest.mark.slow
# what a pod may write outside its dirs: the null device only
OUTSIDE_OK = ("/dev/null",)
CACHES = ("__pycache__", ".pytest_cache", ".ruff_cache", ".import_linter_cache", ".git")


def _settings(remote: bool, nnodes: int, nproc: int) -> dict:
    """The tiny addition recipe, 4 steps, one sampler on 4 problems; with `remote`, the shared-nothing
    setup: data and checkpoints in the bucket, trainers on a cluster scheduler (one rank per node)."""
    s = load_settings(
        RECIPE,
        dataset={
            "task_rows": 3000,  # 8,100 source records: 3 prepare units (a `limit` would make it one)
            "prepared_dir": "data/prepared/e2e",  # relative: each pod's own disk
            "remote_dir": f"s3://{BUCKET}/prepared/e2e" if remote else None,
        },
        train={
            "max_steps": 4,
            "global_batch_size": 8,
            "local_batch_size": 4,
            "warmup_steps": 1,
            "log_every": 1,
        },
        checkpoint={"every_steps": 2, "remote_dir": f"s3://{BUCKET}/runs/e2e" if remote else None},
        distributed={"strategy": "ddp", "backend": "gloo"},
        launch={
            "scheduler": "kubernetes" if remote else "local_cwd",
            "nnodes": nnodes,
            "nproc_per_node": nproc,
            **({"rdzv_backend": "static", "rdzv_endpoint": f"127.0.0.1:{free_port()}"} if remote else {}),
        },
        eval={
            "samplers": ["llada"],
            "limit": 4,
            "batch_size": 4,
            "sweep": None,
            "untrained_baseline": False,
            "ar_baseline": False,
            "ar_control": None,
        },  # fmt: skip
        registry={"model_name": "e2e-shared-nothing", "gate": {"tolerance": 0.0, "min_accuracy": 0.0}},
    )
    return s.to_dict()


class Pods:
    """Pod dirs under one base: `<base>/<name>/{work,home,tmp,cache}` (+ its request, artifact and log),
    each pod's audit log under `<base>/.audit/<name>/`."""

    def __init__(self, base: Path, s3_env: dict[str, str]) -> None:
        self.base, self.s3_env = base, s3_env

    def root(self, name: str) -> Path:
        return self.base / name

    def spec(self, name: str) -> dict:
        """A fresh pod: its dirs, and the environment its image and the cluster give it."""
        root = self.root(name)
        assert not root.exists(), root
        for d in ("work", "home", "tmp", "cache"):
            (root / d).mkdir(parents=True)
        # Not inherited: this process's own settings, nor the cache dirs torch writes into os.environ once a
        # compile ran in it (TORCHINDUCTOR_CACHE_DIR=/tmp/torchinductor_<user>, another pod's then)
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("DLLMFLOW_", "DLLM_", "MLFLOW_", "METAFLOW_", "TORCHINDUCTOR_", "TRITON_"))
        }
        env.update(self.s3_env)
        env.update(
            HOME=str(root / "home"), TMPDIR=str(root / "tmp"), XDG_CACHE_HOME=str(root / "cache"),
            HF_HOME=str(root / "cache" / "hf"), MLFLOW_TRACKING_URI=f"sqlite:///{root / 'work' / 'mlflow.db'}",
            METAFLOW_DATASTORE_SYSROOT_LOCAL=str(root / "work"), PYTHONDONTWRITEBYTECODE="1", OMP_NUM_THREADS="1",
            PYTHONPATH=str(AUDIT), DLLM_TEST_WRITE_LOG=str(self.base / ".audit" / name),
        )  # fmt: skip
        return {"root": str(root), "cwd": str(root / "work"), "env": env, "log": str(root / "log.txt")}

    def run(self, name: str, call: str, settings: dict, *, pods: tuple[str, ...] = (), **args) -> tuple:
        """Run one step as pod `name` (and `pods`, e.g. the trainer nodes it submits to); check that each
        of them wrote only into its own dirs. Returns (returncode, its artifact or None)."""
        spec = self.spec(name)
        nodes = {p: self.spec(p) for p in pods}
        request = {"call": call, "settings": settings, "root": spec["root"], **args}
        request["result"] = str(self.root(name) / "artifact.json")
        if nodes:
            request["nodes"] = list(nodes.values())
        (self.root(name) / "request.json").write_text(json.dumps(request))
        mine = {name, *pods}
        before = _snapshot(self.base, skip=mine)
        with open(spec["log"], "w") as log:
            proc = subprocess.run(
                [sys.executable, str(POD), str(self.root(name) / "request.json")],
                cwd=spec["cwd"], env=spec["env"], stdout=log, stderr=subprocess.STDOUT, timeout=600,
            )  # fmt: skip
        after = _snapshot(self.base, skip=mine)
        changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
        assert changed == [], f"{name} changed what is not its own: {changed[:5]}"
        for pod in mine:
            assert self.outside(pod) == [], f"{pod} wrote outside its dirs"
        artifact = self.root(name) / "artifact.json"
        return proc.returncode, json.loads(artifact.read_text()) if artifact.is_file() else None

    def written(self, pod: str) -> list[str]:
        """Every path the pod's Python processes wrote (the audit hook's log)."""
        logs = sorted((self.base / ".audit" / pod).glob("*.log"))
        assert logs, f"no audit log for {pod}: is tests/e2e/_write_audit on its PYTHONPATH?"
        return [line.split("\t", 1)[1] for log in logs for line in log.read_text().splitlines()]

    def outside(self, pod: str) -> list[str]:
        own = str(self.root(pod)) + os.sep
        return sorted({p for p in self.written(pod) if not p.startswith(own) and p not in OUTSIDE_OK})

    def log(self, name: str) -> str:
        return (self.root(name) / "log.txt").read_text()[-4000:]


def _snapshot(base: Path, skip: set[str] = frozenset()) -> dict[str, tuple[int, int]]:
    """Every file and dir under `base` but the skipped pods' and the audit logs: (size, mtime_ns)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(base):
        rel = Path(dirpath).relative_to(base)
        if rel == Path("."):
            dirnames[:] = [d for d in dirnames if d not in skip and d != ".audit"]
        for name in dirnames + filenames:
            st = os.lstat(os.path.join(dirpath, name))
            out[str(rel / name)] = (st.st_size if name in filenames else 0, st.st_mtime_ns)
    return out


def _untracked(root: Path) -> dict[str, tuple[int, int]]:
    """The checkout's files git does not track (where a stray relative write would land: runs/, data/,
    mlflow.db, .metaflow/ ...), caches aside."""
    tracked = set(
        subprocess.run(["git", "ls-files"], cwd=root, capture_output=True, text=True).stdout.split("\n")
    )
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in CACHES]
        for name in filenames:
            rel = os.path.relpath(os.path.join(dirpath, name), root)
            if rel not in tracked:
                st = os.lstat(os.path.join(dirpath, name))
                out[rel] = (st.st_size, st.st_mtime_ns)
    return out


def _losses(run_dir: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in read_metrics(run_dir / "metrics.jsonl")]


def test_every_step_and_node_shares_nothing_but_the_bucket(tmp_path):
    checkout_before = _untracked(ROOT)
    with moto_s3(BUCKET, log=tmp_path / "moto.log") as s3:
        pods = Pods(tmp_path / "pods", s3.env)
        run_dir = str(flow_run_dir(_settings(False, 1, 2), "1"))  # relative: runs/tiny_addition/flow-1
        assert not Path(run_dir).is_absolute()

        # 0) the reference: one machine, its own prepared dir, 1 node x 2 ranks, nothing remote
        rc, ref = pods.run("one_machine", "one_machine", _settings(False, 1, 2), run_dir=run_dir)
        assert rc == 0, pods.log("one_machine")
        reference = _losses(pods.root("one_machine") / "work" / run_dir)
        assert [step for step, _ in reference] == [1, 2, 3, 4]

        # 1) prepare: the plan, one pod per unit (unit 1 killed after its first upload, then retried in a
        # fresh pod, as Metaflow's @retry reschedules it), the join publishes and pins the set
        settings = _settings(True, 2, 1)
        rc, planned = pods.run("plan", "plan", settings)
        assert rc == 0, pods.log("plan")
        staging = planned["remote_staging"].removeprefix(f"s3://{BUCKET}/")
        units = list(range(len(planned["plan"]["source"]["units"])))
        assert units == [0, 1, 2]
        for k in units:
            if k == 1:
                before = set(s3.keys(staging))
                rc, _ = pods.run("unit1-killed", "unit", settings, planned=planned, k=1, kill_after_puts=1)
                assert rc == -9, pods.log("unit1-killed")
                partial = set(s3.keys(staging)) - before  # one shard of unit 1 up, its record not
                assert len(partial) == 1 and "shard-" in partial.pop()
                assert f"{staging}/.units/unit-000001.json" not in s3.keys(staging)
            rc, _ = pods.run(f"unit{k}", "unit", settings, planned=planned, k=k)
            assert rc == 0, pods.log(f"unit{k}")
        rc, joined = pods.run("join", "join", settings, planned=planned)
        assert rc == 0, pods.log("join")
        data, settings = joined["data"], joined["settings"]
        assert data["content_hash"] == ref["data"]["content_hash"]  # the retried unit changed nothing
        assert (
            data["published"]["content_hash"] == settings["dataset"]["content_hash"] == data["content_hash"]
        )
        assert not s3.keys(staging)

        # 2) train: the step submits the AppDef; each node is a pod with only the AppDef's command and env
        rc, training = pods.run("train", "train", settings, pods=("node0", "node1"), run_dir=run_dir)
        assert rc == 0, pods.log("train") + pods.log("node0") + pods.log("node1")
        assert training["training"]["consolidated_dir"] is None  # the export is on the nodes and the bucket
        assert _losses(pods.root("node0") / "work" / run_dir) == reference  # rank 0's own disk
        assert not (pods.root("node1") / "work" / run_dir / "metrics.jsonl").exists()
        for node in ("node0", "node1"):  # each fetched the pinned set into its own prepared dir
            manifest = pods.root(node) / "work" / "data" / "prepared" / "e2e" / "manifest.json"
            assert json.loads(manifest.read_text())["content_hash"] == data["content_hash"]

        # 3) evaluate and register, each on a pod without the trainers' disks: restored from the bucket
        rc, evaluated = pods.run("evaluate", "evaluate", settings, run_dir=run_dir, sampler="llada")
        assert rc == 0, pods.log("evaluate")
        assert evaluated["restored"]["bytes"] > 0
        assert _losses(pods.root("evaluate") / "work" / run_dir) == reference
        eval_file = RunLayout(pods.root("evaluate") / "work" / run_dir).eval_file("llada")
        assert str(eval_file) in pods.written("evaluate")  # the audit sees the pod's own writes
        rc, registered = pods.run(
            "register", "register", settings, run_dir=run_dir, evals={"llada": evaluated["eval"]}, data=data,
            training=training["training"],  # what the train step returned, as the flow passes it on
        )  # fmt: skip
        assert rc == 0, pods.log("register")
        lineage = registered["registration"]["lineage"]
        assert (
            lineage["data_content_hash"] == data["content_hash"]
            and registered["registration"]["version"] == 1
        )
    checkout_after = _untracked(ROOT)
    changed = sorted(
        k
        for k in checkout_before.keys() | checkout_after.keys()
        if checkout_before.get(k) != checkout_after.get(k)
    )
    assert changed == [], f"the checkout's untracked files changed: {changed[:5]}"


def test_uno_adapter_trainers_fetch_the_control_from_the_bucket(tmp_path):
    """uno with `eval.ar_control` shares nothing either: the control trains on pods of its own, the train
    step restores its export from the bucket for its checks, and the adapter's trainer (a fresh pod, no
    control on its disk) fetches it from the control's prefix (`model.remote_dir`), verified, and trains
    on exactly those weights."""
    from dllmflow.models.drafting_adapter import read_drafter_info, weights_digest
    from dllmflow.runs import find_consolidated

    with moto_s3(BUCKET, log=tmp_path / "moto.log") as s3:
        pods = Pods(tmp_path / "pods", s3.env)
        settings = load_settings(
            ROOT / "params" / "tiny_uno.yaml",
            dataset={
                "limit": 64,
                "prepared_dir": "data/prepared/e2e_uno",
                "remote_dir": f"s3://{BUCKET}/prepared/e2e_uno",
            },
            train={"max_steps": 2, "global_batch_size": 4, "local_batch_size": 4, "warmup_steps": 1, "log_every": 1},
            checkpoint={"every_steps": 2, "remote_dir": f"s3://{BUCKET}/runs/e2e_uno"},
            launch={
                "scheduler": "kubernetes", "nnodes": 1, "nproc_per_node": 1,
                "rdzv_backend": "static", "rdzv_endpoint": f"127.0.0.1:{free_port()}",
            },
            eval={"ar_control": {"enabled": True}},
        ).to_dict()  # fmt: skip
        run_dir = str(flow_run_dir(settings, "1"))
        rc, prepared = pods.run("prepare", "prepare", settings)
        assert rc == 0, pods.log("prepare")
        settings = prepared["settings"]
        rc, _ = pods.run(
            "train", "train", settings, pods=("control0", "adapter0"), run_dir=run_dir, nodes_per_app=1
        )
        assert rc == 0, pods.log("train") + pods.log("control0") + pods.log("adapter0")

        control = Path(run_dir) / "ar_control"
        trained = find_consolidated(pods.root("control0") / "work" / control)  # where the control trained
        fetched = find_consolidated(pods.root("adapter0") / "work" / control)  # the adapter pod's copy
        restored = find_consolidated(pods.root("train") / "work" / control)  # the train step's checks
        digest = weights_digest(trained)
        assert weights_digest(fetched) == weights_digest(restored) == digest
        here = str(pods.root("adapter0") / "work" / control / "checkpoints")
        assert any(p.startswith(here) and p.endswith(".safetensors") for p in pods.written("adapter0"))
        adapter = find_consolidated(pods.root("adapter0") / "work" / run_dir)
        assert read_drafter_info(adapter)["base_digest"] == digest  # the adapter drafts for those weights
        assert [s for s, _ in _losses(pods.root("adapter0") / "work" / run_dir)] == [1, 2]
