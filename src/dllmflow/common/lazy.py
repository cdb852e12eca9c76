"""Objects named by "module:attr" strings, imported on first use: `load_object` and `LazyRegistry`.

    from dllmflow.common.lazy import LazyRegistry, load_object
    load_object("dllmflow.models.build:build_model")            # the function
    SAMPLERS = LazyRegistry("sampler", {"llada": "dllmflow.diffusion.samplers.llada:LLaDASampler"})
    SAMPLERS["llada"]                                           # imported here; SAMPLERS["x"] -> KeyError listing choices

Registries built on it (the mode specs, the samplers) stay cheap to import: a sampler's or a mode's
heavy imports happen only when it is used. Stdlib only.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from typing import Any


def load_object(path: str) -> Any:
    """Import "package.module:attr" and return the attribute."""
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


class LazyRegistry(Mapping[str, Any]):
    """A small explicit registry name -> "module:attr", imported on first use (the samplers use it)."""

    def __init__(self, kind: str, entries: dict[str, str]):
        self.kind = kind
        self._entries = dict(entries)
        self._loaded: dict[str, Any] = {}

    def __getitem__(self, name: str) -> Any:
        if name not in self._entries:
            raise KeyError(f"unknown {self.kind} {name!r}; choose one of: {', '.join(sorted(self._entries))}")
        if name not in self._loaded:
            self._loaded[name] = load_object(self._entries[name])
        return self._loaded[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries


__all__ = ["LazyRegistry", "load_object"]
