"""Test-only: loaded at interpreter start by children whose PYTHONPATH starts with tests/_plugins
(`fault_hooks.with_fault_env`). When DLLM_TEST_FAIL_AT_STEP is set, every Trainer built in this
process gets `FailAfterStep`, registered from outside when `dllmflow.training.trainer` is first
imported (so processes that never train, e.g. the launcher or torchrun's agent, import nothing more).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys

from fault_hooks import hook_from_env

TRAINER_MODULE = "dllmflow.training.trainer"


def _register(module) -> None:
    """Wrap Trainer.__init__ so that every Trainer also runs the test's hook."""
    trainer_cls = module.Trainer
    original = trainer_cls.__init__

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.hooks.append(hook_from_env())

    trainer_cls.__init__ = __init__


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the real loader of the trainer module to patch it once loaded."""

    def find_spec(self, name, path, target=None):
        if name != TRAINER_MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_register(module):
            exec_module(module)
            _register(module)

        spec.loader.exec_module = exec_and_register
        return spec


if hook_from_env() is not None:
    sys.meta_path.insert(0, _AfterImport())
