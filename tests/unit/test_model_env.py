"""`dllmflow.tracking.model_env`, what a registered model installs: the wheel built from the sources
(named by their hash, so MLflow never reuses an env built for other code), the pins of a project
installed without its sources, and the dependency closure that trims the lock into the constraints.
The model directory it produces is checked in tests/integration/test_registry.py; the env it builds
in tests/integration/test_pyfunc_install.py."""

from __future__ import annotations

import zipfile
from pathlib import Path

from dllmflow.tracking import model_env

ROOT = Path(__file__).resolve().parents[2]


def _project(root: Path, body: str) -> Path:
    (root / "src" / "dllmflow").mkdir(parents=True)
    (root / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools>=77"]\nbuild-backend = "setuptools.build_meta"\n'
        '[project]\nname = "dllmflow"\nversion = "0.0.1"\n'
    )
    (root / "src" / "dllmflow" / "__init__.py").write_text(body)
    return root


def _wheel_text(wheel_dir: Path) -> str:
    (wheel,) = wheel_dir.glob("dllmflow-0.0.1-*.whl")
    return zipfile.ZipFile(wheel).read("dllmflow/__init__.py").decode()


def test_the_wheel_dir_is_named_by_the_sources_and_the_checkout_stays_clean(tmp_path):
    project = _project(tmp_path / "proj", "X = 1\n")
    first = model_env.build_wheel(project, tmp_path / "a")
    again = model_env.build_wheel(project, tmp_path / "b")
    assert first.name == again.name and _wheel_text(again) == "X = 1\n"
    (project / "src" / "dllmflow" / "__init__.py").write_text("X = 2\n")
    changed = model_env.build_wheel(project, tmp_path / "c")
    assert changed.name != first.name and _wheel_text(changed) == "X = 2\n"
    assert sorted(p.name for p in project.iterdir()) == ["pyproject.toml", "src"]  # no build/, egg-info
    assert sorted(p.name for p in (project / "src").iterdir()) == ["dllmflow"]


def _counting_builds(monkeypatch) -> list[Path]:
    calls, real = [], model_env._pip_wheel
    monkeypatch.setattr(model_env, "_pip_wheel", lambda stage: (calls.append(stage), real(stage))[1])
    return calls


def test_a_prefetched_wheel_is_built_once_and_taken_by_the_registration(tmp_path, monkeypatch):
    project = _project(tmp_path / "proj", "X = 3\n")
    monkeypatch.setattr(model_env, "source_root", lambda: project)
    calls = _counting_builds(monkeypatch)
    thread = model_env.prefetch_wheel()
    out = model_env.build_wheel(project, tmp_path / "reg")  # waits for the build in flight
    thread.join()
    assert len(calls) == 1 and _wheel_text(out) == "X = 3\n"
    assert not list(tmp_path.glob("reg/wheel-src*"))  # the staged sources are gone


def test_a_failed_prefetch_is_not_kept_the_registration_builds_again_and_reports_it(tmp_path, monkeypatch):
    import pytest

    from dllmflow.errors import UserError

    project = _project(tmp_path / "proj", "X = 4\n")
    (project / "pyproject.toml").write_text("[project\nname = ")  # not TOML: pip cannot build it
    monkeypatch.setattr(model_env, "source_root", lambda: project)
    calls = _counting_builds(monkeypatch)
    model_env.prefetch_wheel().join()  # fails quietly
    with pytest.raises(UserError, match="could not build the dllmflow wheel"):
        model_env.build_wheel(project, tmp_path / "reg")
    assert len(calls) == 2


def test_without_its_sources_the_model_pins_the_installed_distribution(tmp_path, monkeypatch):
    from importlib.metadata import version

    monkeypatch.setattr(model_env, "source_root", lambda: None)
    env = model_env.build_model_env(tmp_path)
    assert env.source == "index" and env.artifacts == {}
    assert env.pip_requirements[0] == f"dllmflow=={version('dllmflow')}"
    assert "torch==2.13.0" in env.pip_requirements and "mlflow==3.17.2" in env.pip_requirements
    assert not any(r.startswith("-c") or r.endswith(".whl") for r in env.pip_requirements)


def test_the_dependency_closure_follows_requirements_and_their_markers():
    closure = model_env.dependency_closure(["mlflow"])
    assert {"mlflow", "mlflow-skinny", "mlflow-tracing", "sqlalchemy"} <= closure  # pinned in the lock
    assert "pytest" not in model_env.dependency_closure(["torch", "transformers"])
    assert model_env.dependency_closure(["pytest; python_version < '3'"]) == set()
    assert model_env.dependency_closure(["Pydantic_Settings"]) >= {"pydantic-settings", "pydantic"}


def test_this_checkout_is_the_source_root():
    assert model_env.source_root() == ROOT
