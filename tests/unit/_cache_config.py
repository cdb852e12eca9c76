"""A cache-capable llada for tests written before the samplers' Fast-dLLM caches land: `LLaDASampler`
takes `cache: none | prefix | dual` as it will once `samplers/llada.py` declares it (then this is a
no-op). The sampler ignores the field here: these tests check the plumbing, not the cache."""

from __future__ import annotations

from typing import Literal


def with_llada_cache(monkeypatch) -> None:
    from dllmflow.diffusion.samplers.llada import LLaDAConfig, LLaDASampler

    if "cache" in LLaDAConfig.model_fields:
        return

    class CachedLLaDAConfig(LLaDAConfig):
        cache: Literal["none", "prefix", "dual"] = "none"

    monkeypatch.setattr(LLaDASampler, "config_cls", CachedLLaDAConfig)
