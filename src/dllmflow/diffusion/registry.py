"""A small explicit registry: name -> "module:Class", imported on first use.

Lazy so that `import dllmflow.diffusion.strategies` stays cheap and a mode's heavy imports (a frozen
target, flex attention) happen only when that mode is used. An unknown name raises a `KeyError`
listing the choices.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from typing import Any


class LazyRegistry(Mapping[str, Any]):
    def __init__(self, kind: str, entries: dict[str, str]):
        self.kind = kind
        self._entries = dict(entries)
        self._loaded: dict[str, Any] = {}

    def __getitem__(self, name: str) -> Any:
        if name not in self._entries:
            raise KeyError(f"unknown {self.kind} {name!r}; choose one of: {', '.join(sorted(self._entries))}")
        if name not in self._loaded:
            module, _, attr = self._entries[name].partition(":")
            self._loaded[name] = getattr(importlib.import_module(module), attr)
        return self._loaded[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries
