"""Test environment: set before anything imports metaflow, mlflow or transformers (they read env at import).

Local Metaflow datastore in a temp dir, offline Hugging Face, no telemetry, the venv's bin on PATH (torchrun).
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_TMP = Path(tempfile.mkdtemp(prefix="dllmflow-tests-"))
_PID = os.getpid()
# Removed when this process (the pytest controller or an xdist worker) exits; a forked child leaves it.
atexit.register(lambda: os.getpid() == _PID and shutil.rmtree(_TMP, ignore_errors=True))

os.environ.setdefault("USERNAME", "dllmflow-tests")
os.environ.setdefault("METAFLOW_DEFAULT_DATASTORE", "local")
os.environ.setdefault("METAFLOW_DEFAULT_METADATA", "local")
os.environ["METAFLOW_DATASTORE_SYSROOT_LOCAL"] = str(_TMP / "metaflow")
# scripts/env.sh points MLflow at the checkout's mlflow.db (the developer's store): tests never write there.
# A test that needs a store of its own (a server, Postgres) sets its own URI; the rest log to this one.
os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{_TMP / 'mlflow.db'}"
os.environ.pop("MLFLOW_REGISTRY_URI", None)
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["MLFLOW_DISABLE_TELEMETRY"] = "true"
os.environ["DO_NOT_TRACK"] = "1"
os.environ["DVC_NO_ANALYTICS"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
# Never let a developer's own overrides leak into tests.
for _k in [k for k in os.environ if k.startswith("DLLMFLOW_")]:
    del os.environ[_k]


def pytest_addoption(parser):
    parser.addoption(
        "--update-golden", action="store_true", help="rewrite tests/golden/*.json from the current code"
    )


@pytest.fixture(autouse=True)
def _restore_environ():
    """A test (or a library it calls: `mlflow.set_tracking_uri` exports MLFLOW_TRACKING_URI) must not
    leave its environment to the next one, e.g. the URI of a server it already stopped."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(autouse=True, scope="module")
def _restore_module_environ():
    """The same for a module's own fixtures (registering a model calls `mlflow.set_registry_uri`, which
    exports MLFLOW_REGISTRY_URI): nothing leaks into the next module a pytest-xdist worker runs."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


# `make test` runs `pytest -n 2 --dist loadscope --no-loadscope-reorder` (pytest-xdist): most slow tests
# are one busy process (a flow step, a server, a generation), so two run side by side on 2 cores. The
# work unit is a whole module (its module-scoped fixtures, e.g. prepared data or a trained checkpoint,
# are built once), except the e2e tests: minutes each, they go one by one. Units are dispatched in
# collection order, so the e2e tests start first and the short unit-test modules fill the end.
_DISPATCH_ONE_BY_ONE = ("tests/e2e/",)


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist: unknown (and unused) without it
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadscope":
        return None  # xdist's own scheduler for the mode asked for
    from xdist.scheduler import LoadScopeScheduling

    class ModuleOrTestScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return nodeid if path.startswith(_DISPATCH_ONE_BY_ONE) else path

    return ModuleOrTestScheduling(config, log)
