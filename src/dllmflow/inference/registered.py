"""What `dllmflow serve` serves for a registered model: resolve `models:/<name>@<alias>` or
`models:/<name>/<version>` through the MLflow registry to the version's checkpoint and recorded
generation (downloaded once into a cache), which `inference/serve_cli.py` then serves as a local dir.

    dllmflow serve --model models:/dllmflow-tiny-addition@champion --tracking-uri sqlite:///mlflow.db

    served = resolve_registered("models:/dllmflow-tiny-addition@champion")   # a dllm_engine.ServedModel

A URI that does not parse, a model, version or alias the registry does not hold, or a version that is not
a dllmflow model (no `checkpoint` and `generation` artifacts, as `tracking/registry.py` logs them) is one
line naming it and exit 2, before any port opens. So is a version recorded with `trust_remote_code:
true` when the caller did not pass `--trust-remote-code`: a registered checkpoint's code runs only with
the consent of whoever starts the server. The tracking server is `--tracking-uri`, else
$MLFLOW_TRACKING_URI, else MLflow's default. Downloads go to `$DLLMFLOW_MODEL_CACHE` (default
`~/.cache/dllmflow/models`), one dir per tracking URI, model and version, reused when complete.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

from dllmflow.errors import UserError
from dllmflow.inference.dllm_engine import ServedModel

_URI = re.compile(r"^models:/(?P<name>[^/@]+)(?:@(?P<alias>[^/@]+)|/(?P<version>\d+))$")
_COMPLETE = ".dllmflow-complete"


def parse_model_uri(uri: str) -> tuple[str, str | None, str | None]:
    """`models:/<name>@<alias>` or `models:/<name>/<version>` -> (name, alias, version)."""
    m = _URI.match(uri)
    if m is None:
        raise UserError(
            f"--model {uri}: not a registry URI; use models:/<name>@<alias> or models:/<name>/<version>"
        )
    return m["name"], m["alias"], m["version"]


def resolve_registered(
    uri: str,
    tracking_uri: str | None = None,
    cache_dir: str | None = None,
    *,
    trust_remote_code: bool = False,
) -> ServedModel:
    """The registered version `uri` names, downloaded (cached) -> what to serve, with its lineage.
    `trust_remote_code`: the caller's consent (`--trust-remote-code`); a version recorded with
    `trust_remote_code: true` is refused without it, and the record never turns it on."""
    import mlflow
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    name, alias, version = parse_model_uri(uri)
    tracking_uri = tracking_uri or mlflow.get_tracking_uri()
    client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
    what = f"alias {alias!r} of model {name!r}" if alias else f"version {version} of model {name!r}"
    try:
        mv = (
            client.get_model_version_by_alias(name, alias)
            if alias
            else client.get_model_version(name, version)
        )
    except MlflowException as e:
        reason = str(e).strip().splitlines()[0]
        raise UserError(f"--model {uri}: no {what} in the registry at {tracking_uri} ({reason})") from None
    local = _download(client, tracking_uri, name, str(mv.version), cache_dir)
    checkpoint, generation = _dllmflow_artifacts(local, uri)
    gen = json.loads(generation.read_text())
    if gen.get("sampler") == "acceptance":
        raise UserError(f"--model {uri}: a DFlash draft decodes only with its target; it is not served here")
    check_recorded_trust(gen, trust_remote_code, f"--model {uri}", "pass --trust-remote-code")
    setting = mv.tags.get("setting")
    lineage: dict[str, Any] = {
        "name": name,
        "version": int(mv.version),
        "alias": alias,
        "aliases": list(getattr(mv, "aliases", []) or []),
        "run_id": mv.run_id,
        "setting": json.loads(setting) if setting else gen.get("setting"),
        "source": uri,
        "tracking_uri": tracking_uri,
    }
    return ServedModel(
        checkpoint=checkpoint,
        sampler=gen.get("sampler"),
        sampler_settings=dict(gen.get("sampler_settings") or {}),
        mode=gen.get("mode"),
        lineage=lineage,
        trust_remote_code=trust_remote_code,
    )


def check_recorded_trust(generation: dict[str, Any], trusted: bool, what: str, how: str) -> None:
    """UserError when the registered `generation` was recorded with `trust_remote_code: true` and the
    caller did not consent (`how` says how to): the record asks, only the caller decides. `dllmflow serve`
    and the registered pyfunc (`tracking/pyfunc.py`) both ask it."""
    if generation.get("trust_remote_code") and not trusted:
        raise UserError(
            f"{what}: this version was registered with trust_remote_code (its checkpoint runs its own "
            f"Python code); {how} to allow it, only for a model you trust"
        )


def _download(client: Any, tracking_uri: str, name: str, version: str, cache_dir: str | None) -> Path:
    """The model version's files in the cache (downloaded into a temp dir, then renamed into place)."""
    import mlflow
    from mlflow.exceptions import MlflowException

    root = Path(cache_dir or os.environ.get("DLLMFLOW_MODEL_CACHE") or Path.home() / ".cache/dllmflow/models")
    key = hashlib.sha256(tracking_uri.encode()).hexdigest()[:12]
    dest = root / key / name / f"v{version}"
    if (dest / _COMPLETE).is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".v{version}-", dir=dest.parent))
    try:
        mlflow.set_registry_uri(tracking_uri)
        mlflow.set_tracking_uri(tracking_uri)
        mlflow.artifacts.download_artifacts(artifact_uri=f"models:/{name}/{version}", dst_path=str(tmp))
        (tmp / _COMPLETE).write_text("")
        shutil.rmtree(dest, ignore_errors=True)
        tmp.rename(dest)
    except MlflowException as e:
        reason = str(e).strip().splitlines()[0]
        raise UserError(f"--model models:/{name}/{version}: cannot download its files ({reason})") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _dllmflow_artifacts(model_dir: Path, uri: str) -> tuple[Path, Path]:
    """(checkpoint dir, generation.json) of a downloaded pyfunc model, as `registry.register_model`
    logs them (MLmodel's python_function artifacts)."""
    import yaml

    try:
        mlmodel = yaml.safe_load((model_dir / "MLmodel").read_text()) or {}
    except (OSError, yaml.YAMLError):
        mlmodel = {}
    artifacts = (mlmodel.get("flavors", {}).get("python_function", {}) or {}).get("artifacts", {}) or {}
    paths = {k: model_dir / v["path"] for k, v in artifacts.items() if isinstance(v, dict) and "path" in v}
    checkpoint, generation = paths.get("checkpoint"), paths.get("generation")
    if checkpoint is None or generation is None or not (checkpoint / "config.json").is_file():
        raise UserError(
            f"--model {uri}: not a dllmflow model (no `checkpoint` and `generation` artifacts in its "
            "pyfunc); register dLLMs with `dllmflow register` or the fine-tune flow"
        )
    return checkpoint, generation
