"""Model skeletons without weights or network, for the memory planner: `offline_skeletons()` makes
every `from_pretrained` build the skeleton of a local config (a config.json suffices; missing ones come
from the configs shipped with dllmflow, models/shipped_configs.py), and `local_config` finds that config.

    with offline_skeletons() as sources:     # sources: per model id, where its config came from
        model = build_model(settings, tokenizer)   # on the meta device: shapes only
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

from dllmflow.errors import UserError


def local_config(name: str, trust_remote_code: bool = False, **kwargs: Any):
    """`AutoConfig` from a local dir, the HF cache or (inside `offline_skeletons`) the config shipped
    with dllmflow (models/shipped_configs.py); a clear UserError when there is none."""
    from dllmflow.models.shipped_configs import resolve_config

    try:
        return resolve_config(name, trust_remote_code=trust_remote_code, **kwargs)
    except (OSError, ValueError) as e:
        raise UserError(
            f"{name!r}: no local config.json (the planner never downloads): fetch it first "
            f"(`hf download {name} config.json`) or point model.pretrained_model_name_or_path / "
            f"dflash.target_model_id at a local model dir ({str(e).splitlines()[0]})"
        ) from None


@contextlib.contextmanager
def offline_skeletons() -> Iterator[dict[str, str]]:
    """No network, and every `from_pretrained` returns the skeleton of the local config (weights need
    not exist: a config.json suffices), built with the same dtype / attention / config overrides.
    Configs missing locally come from the shipped ones; the dict yielded says, per model, from where."""
    import huggingface_hub.constants as hub

    # transformers gives each auto class its own copy of `from_pretrained` when that class is first
    # built: build them all now, so each is patched below and none built inside the block keeps it
    import transformers.models.auto.modeling_auto  # noqa: F401
    from transformers import PreTrainedModel
    from transformers.models.auto.auto_factory import _BaseAutoModelClass

    from dllmflow.models.shipped_configs import shipped_fallback

    def skeleton(cls, name, *args, **kwargs):
        config = kwargs.pop("config", None)
        trust = kwargs.pop("trust_remote_code", False)
        build = {k: kwargs.pop(k) for k in ("dtype", "attn_implementation") if k in kwargs}
        for unused in ("device_map", "low_cpu_mem_usage"):
            kwargs.pop(unused, None)
        if config is None:
            # what is left (gguf_file, family knobs such as block_size) is for the config
            config = local_config(name, trust, **kwargs)
        if issubclass(cls, _BaseAutoModelClass):
            return cls.from_config(config, trust_remote_code=trust, **build)
        return cls._from_config(config, **build)

    # every class holding its own `from_pretrained` (the auto classes each hold a copy) is patched
    owners = [PreTrainedModel, _BaseAutoModelClass]
    owners += [c for c in _subclasses(_BaseAutoModelClass) if "from_pretrained" in c.__dict__]
    saved = {c: c.__dict__["from_pretrained"] for c in owners}
    offline, env = hub.HF_HUB_OFFLINE, os.environ.get("HF_HUB_OFFLINE")
    hub.HF_HUB_OFFLINE, os.environ["HF_HUB_OFFLINE"] = True, "1"
    for c in owners:
        c.from_pretrained = classmethod(skeleton)
    try:
        with shipped_fallback() as sources:
            yield sources
    finally:
        for c, method in saved.items():
            c.from_pretrained = method
        hub.HF_HUB_OFFLINE = offline
        if env is None:
            os.environ.pop("HF_HUB_OFFLINE", None)
        else:
            os.environ["HF_HUB_OFFLINE"] = env


def _subclasses(cls: type) -> list[type]:
    out = []
    for sub in cls.__subclasses__():
        out += [sub, *_subclasses(sub)]
    return out
