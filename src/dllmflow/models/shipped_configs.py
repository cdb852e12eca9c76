"""Model configs shipped with dllmflow (config.json only, no weights) for the models the recipes name.

`dllmflow plan` must size a GPU recipe on a laptop with no hub access. Each shipped model has a dir
`models/configs/<org>__<name>/` holding its `config.json` and a `source.json` saying where the config
came from and how far it was checked (docs/memory_planner.md lists them). A config whose class is
remote code (LLaDA) also carries a `stand_in`: an in-library config of the same shapes, built instead
when the remote code is not local. The planner reads, in order: a local dir, the HF cache, these files.

    from dllmflow.models.shipped_configs import resolve_config, shipped_fallback
    with shipped_fallback() as sources:           # the planner: shipped configs allowed as a last resort
        config = resolve_config("Qwen/Qwen3-8B")  # AutoConfig; sources["Qwen/Qwen3-8B"] says from where
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from contextvars import ContextVar
from pathlib import Path
from typing import Any

from dllmflow.errors import UserError

CONFIG_DIR = Path(__file__).parent / "configs"
# name -> where its config came from, for the block that allowed the fallback (None: not allowed)
_SOURCES: ContextVar[dict[str, str] | None] = ContextVar("dllmflow_shipped_sources", default=None)


@contextlib.contextmanager
def shipped_fallback() -> Iterator[dict[str, str]]:
    """Inside: `resolve_config` / `config_dict` fall back to the shipped files; the dict yielded
    collects, per model name, where its config came from."""
    sources: dict[str, str] = {}
    token = _SOURCES.set(sources)
    try:
        yield sources
    finally:
        _SOURCES.reset(token)


def shipped_dir(name: str) -> Path | None:
    """The shipped dir of a hub id (`org/name`) or of a repo path a shipped model is exported to."""
    direct = CONFIG_DIR / name.replace("/", "__")
    if "/" in name and (direct / "config.json").is_file():
        return direct
    wanted = Path(name).as_posix().rstrip("/")
    for source in sorted(CONFIG_DIR.glob("*/source.json")):
        if wanted in json.loads(source.read_text()).get("local_exports", []):
            return source.parent
    return None


def planned_from_shipped(name: str) -> bool:
    """Inside `shipped_fallback`, a local path that is not there yet but whose config ships (a DVC
    export such as data/targets/smollm2-135m): builders plan it instead of refusing the missing dir."""
    return (
        _SOURCES.get() is not None and not Path(name).expanduser().exists() and shipped_dir(name) is not None
    )


def shipped_source(name: str) -> dict[str, Any]:
    d = shipped_dir(name)
    return json.loads((d / "source.json").read_text()) if d is not None else {}


def _record(name: str, where: str) -> None:
    sources = _SOURCES.get()
    if sources is not None:
        sources.setdefault(name, where)


def resolve_config(name: str, trust_remote_code: bool = False, **kwargs: Any):
    """`AutoConfig` of `name` from a local dir or the HF cache (never the network when offline), else,
    inside `shipped_fallback`, from the shipped config (its stand-in when the class is remote code).
    Raises OSError/ValueError as `AutoConfig` does when none of them has it."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(name, trust_remote_code=trust_remote_code, **kwargs)
    except (OSError, ValueError):
        d = shipped_dir(name) if _SOURCES.get() is not None else None
        if d is None:
            raise
    else:
        _record(name, f"local dir {name}" if Path(name).expanduser().is_dir() else "the HF cache")
        return config
    info = json.loads((d / "source.json").read_text())
    stand_in = info.get("stand_in")
    if stand_in is not None:
        # remote code is not local (else AutoConfig above would have read the cache): same shapes, our class
        config = AutoConfig.for_model(**{**stand_in, **kwargs})
        _record(name, f"shipped {d.name}/source.json stand-in ({config.model_type}): {info['source']}")
        return config
    config = AutoConfig.from_pretrained(d, **kwargs)
    _record(name, f"shipped {d.name}/config.json: {info['source']}")
    return config


def config_dict(name: str) -> dict[str, Any]:
    """The raw config.json of `name` (no class resolution, so no remote code runs): a local dir, the
    HF cache (downloaded when online), else, inside `shipped_fallback`, the shipped file."""
    local = Path(name).expanduser() / "config.json"
    if local.is_file():
        _record(name, f"local dir {name}")
        return json.loads(local.read_text())
    try:
        from huggingface_hub import hf_hub_download

        path = hf_hub_download(name, "config.json")
        _record(name, "the HF cache")
        return json.loads(Path(path).read_text())
    except Exception as e:  # noqa: BLE001 - hub errors are many classes; all mean "not available"
        d = shipped_dir(name) if _SOURCES.get() is not None else None
        if d is None:
            raise UserError(
                f"{name!r}: config.json not found (not a local dir, not in the HF cache: "
                f"{str(e).splitlines()[0] if str(e) else type(e).__name__})"
            ) from None
    _record(name, f"shipped {d.name}/config.json: {json.loads((d / 'source.json').read_text())['source']}")
    return json.loads((d / "config.json").read_text())
