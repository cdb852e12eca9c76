"""The Python environment a registered model installs itself into, so `mlflow models serve` with a
non-local env manager (`--env-manager virtualenv`) builds it on a machine that has no checkout of this
project:

    env = build_model_env(workdir)      # ModelEnv(pip_requirements=[...], artifacts={...})
    Model.log(..., pip_requirements=env.pip_requirements, artifacts={**mine, **env.artifacts})

* From a source tree (a checkout, an editable install, the Docker image): this project is built into
  a wheel at registration time (`pip wheel --no-deps`, ~2 s) and logged WITH the model under
  `artifacts/dllmflow-<source hash>/`; `requirements.txt` names it by that relative path (MLflow runs
  pip from a copy of the model directory). The source hash is in the path because MLflow names a
  restored environment after its requirements' text: the same path for other code would reuse an env
  holding the old code. `constraints.txt` (`-c`) holds the `requirements.lock` pins of every package
  that dllmflow and the runtime packages pull in (`dependency_closure`), so each installs at the
  version CI tested; the runtime packages the pyfunc imports are also listed by name, locked versions.
* Installed without its source (a wheel from an index): `dllmflow==<version>` plus the running
  environment's versions of those runtime packages.

torch: the lock pins `torch==2.13.0` with no index of its own (CPU machines find the CPU wheel through
their pip configuration, as `scripts/setup.sh` does). A consumer elsewhere chooses the build with pip's
own settings, e.g. `PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu`, which the env manager's
pip reads; the model does not hard-code an index.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import tomllib
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

from dllmflow.errors import UserError

PROJECT = "dllmflow"
# What the pyfunc imports at load and predict (its other deps come in through dllmflow's own metadata).
RUNTIME_PACKAGES = (
    "torch",
    "transformers",
    "tokenizers",
    "safetensors",
    "mlflow",
    "pydantic",
    "pydantic-settings",
)
WHEEL_ARTIFACT = "project_wheel"  # the artifact key; the pyfunc does not read it


@dataclass
class ModelEnv:
    pip_requirements: list[str]
    artifacts: dict[str, str] = field(default_factory=dict)
    source: str = "wheel"  # wheel | index


def source_root() -> Path | None:
    """The checkout this dllmflow is imported from (pyproject.toml naming it, next to src/dllmflow), or
    None when it is installed as a distribution without its source."""
    import dllmflow

    package = Path(dllmflow.__file__).resolve().parent
    root = package.parents[1]
    pyproject = root / "pyproject.toml"
    if package.parent.name != "src" or not pyproject.is_file():
        return None
    try:
        name = tomllib.loads(pyproject.read_text())["project"]["name"]
    except (tomllib.TOMLDecodeError, KeyError):
        return None
    return root if name == PROJECT else None


def build_model_env(workdir: str | os.PathLike) -> ModelEnv:
    """The model's pip requirements (and the wheel artifact they name), built under `workdir`."""
    root = source_root()
    if root is None:
        return ModelEnv(_installed_pins(), source="index")
    workdir = Path(workdir)
    wheel_dir = build_wheel(root, workdir)
    wheel = next(wheel_dir.glob(f"{PROJECT}-*.whl"))
    lock = root / "requirements.lock"
    constraints = []
    if lock.is_file():
        needed = _constrained(root)
        locked = _lock_lines(lock)
        constraints_file = workdir / "constraints.txt"
        constraints_file.write_text("".join(f"{locked[n]}\n" for n in sorted(locked) if n in needed))
        constraints = [f"-c {constraints_file}"]
    pins = _locked_pins(lock) if lock.is_file() else _installed_pins()[1:]
    # MLflow copies an artifact dir to artifacts/<its name>; pip resolves the path from the model dir.
    requirement = f"./artifacts/{wheel_dir.name}/{wheel.name}"
    return ModelEnv([*constraints, requirement, *pins], {WHEEL_ARTIFACT: str(wheel_dir)})


def build_wheel(root: Path, workdir: Path) -> Path:
    """A wheel of the project at `root`, built from a copy of what it packages (pyproject.toml, README,
    src/dllmflow) so the checkout gets no build/ or egg-info. Returns `workdir/dllmflow-<hash12>/`
    holding it, <hash12> the sha256 of those sources. Built once per process for the same sources (a
    `prefetch_wheel` in flight is waited for, not repeated)."""
    stage = workdir / "wheel-src"
    shutil.copytree(
        root / "src" / PROJECT,
        stage / "src" / PROJECT,
        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"),
    )
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        if (root / name).is_file():
            shutil.copy2(root / name, stage / name)
    out = workdir / f"{PROJECT}-{_tree_hash(stage)[:12]}"
    try:
        name, data = _built_once(out.name, stage)
    finally:
        shutil.rmtree(stage)
    out.mkdir(parents=True)
    (out / name).write_bytes(data)
    return out


# dir name (source hash) -> Future of (wheel name, bytes): each source tree is built once per process.
_BUILDS: dict[str, Future] = {}
_BUILDS_LOCK = threading.Lock()


def _built_once(key: str, stage: Path) -> tuple[str, bytes]:
    with _BUILDS_LOCK:
        future, mine = _BUILDS.get(key), False
        if future is None:
            future, mine = Future(), True
            _BUILDS[key] = future
    if mine:
        try:
            future.set_result(_pip_wheel(stage))
        except BaseException as e:  # a failed build is not kept: the next caller builds (and reports) again
            with _BUILDS_LOCK:
                _BUILDS.pop(key, None)
            future.set_exception(e)
    return future.result()


def _pip_wheel(stage: Path) -> tuple[str, bytes]:
    out = stage.parent / f"{stage.name}-dist"
    # Without build isolation when the running env has setuptools: nothing is downloaded.
    isolation = ["--no-build-isolation"] if _has_setuptools() else []
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation, "-q", "-w", str(out), str(stage)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    try:
        wheel = next(out.glob(f"{PROJECT}-*.whl"), None)
        if proc.returncode != 0 or wheel is None:
            raise UserError(
                f"could not build the {PROJECT} wheel the registered model installs "
                f"({proc.stderr.strip()[-300:]}); check that pip and setuptools>=77 are installed"
            )
        return wheel.name, wheel.read_bytes()
    finally:
        shutil.rmtree(out, ignore_errors=True)


def prefetch_wheel() -> threading.Thread | None:
    """Start building this checkout's wheel in the background (None: installed without its sources),
    so that registration's other work (importing MLflow, logging the run: seconds) overlaps the ~2 s
    `pip wheel` subprocess; `build_model_env` then takes the result. A failure here is reported by that
    later build, which retries. Not a daemon thread: the process waits for it before exiting."""
    root = source_root()
    if root is None:
        return None

    def build() -> None:
        with tempfile.TemporaryDirectory(prefix="dllmflow-wheel-") as tmp:
            try:
                build_wheel(root, Path(tmp))
                _constrained(root)  # the installed metadata walk (~0.3 s), cached for build_model_env
            except Exception:  # noqa: BLE001 - build_model_env rebuilds and reports it
                pass

    thread = threading.Thread(target=build, name="dllmflow-wheel", daemon=False)
    thread.start()
    return thread


def _tree_hash(directory: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        digest.update(path.relative_to(directory).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


def _has_setuptools() -> bool:
    import importlib.util

    return importlib.util.find_spec("setuptools") is not None


def dependency_closure(requirements: list[str]) -> set[str]:
    """The normalised names of `requirements` and everything they require, transitively, as the
    packages installed here declare it (markers evaluated for this Python, no extras). A package not
    installed here ends its branch. The model's constraints keep only these lines of the lock: MLflow
    reports every constrained package the env lacks as a "mismatch" at each load (the lock also holds
    the dev tools)."""
    from importlib.metadata import PackageNotFoundError, requires

    from packaging.requirements import InvalidRequirement, Requirement

    seen: set[str] = set()
    todo = list(requirements)
    while todo:
        try:
            req = Requirement(todo.pop())
        except InvalidRequirement:
            continue
        name = _normalise(req.name)
        if name in seen or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
            continue
        seen.add(name)
        try:
            todo.extend(requires(req.name) or [])
        except PackageNotFoundError:
            continue
    return seen


@functools.lru_cache(maxsize=4)
def _constrained(root: Path) -> frozenset[str]:
    """The packages the model's constraints pin: what the project and the runtime packages pull in."""
    return frozenset(dependency_closure([*_declared(root), *RUNTIME_PACKAGES]))


def _declared(root: Path) -> list[str]:
    """The dependencies the project's pyproject.toml declares (what its wheel requires)."""
    return list(tomllib.loads((root / "pyproject.toml").read_text())["project"].get("dependencies", []))


def _lock_lines(lock: Path) -> dict[str, str]:
    """Normalised name -> `name==version` for each pin of requirements.lock."""
    lines = {}
    for line in lock.read_text().splitlines():
        name, sep, version = line.split("#")[0].strip().partition("==")
        if sep:
            lines[_normalise(name)] = f"{name.strip()}=={version.strip()}"
    return lines


def _locked_pins(lock: Path) -> list[str]:
    """`name==version` of RUNTIME_PACKAGES as requirements.lock pins them."""
    locked = _lock_lines(lock)
    return [locked[_normalise(p)] for p in RUNTIME_PACKAGES if _normalise(p) in locked]


def _installed_pins() -> list[str]:
    """This distribution and RUNTIME_PACKAGES at the versions installed here (local labels dropped)."""
    from importlib.metadata import PackageNotFoundError, version

    pins = []
    for pkg in (PROJECT, *RUNTIME_PACKAGES):
        try:
            pins.append(f"{pkg}=={version(pkg).split('+')[0]}")
        except PackageNotFoundError:
            continue
    return pins


def _normalise(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")
