"""Run a callback right after a module finishes importing, without importing it: how ds_plugin hooks Lightning's
strategy registry and transformers' `TrainingArguments` / `Trainer` only in processes that load them.

Standard library only, so the lightest entry points (`import ds_plugin`, a `ds-plugin launch` rank) can use it.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

__all__ = ["after_import"]


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs `callback(module)` right after the module `name` finishes importing (one shot)."""

    def __init__(self, name: str, callback: Callable[[ModuleType], None]) -> None:
        self.name = name
        self.callback = callback

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != self.name:
            return None
        sys.meta_path.remove(self)  # one shot; the lookup below must not find this finder again
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            run_module = spec.loader.exec_module
            callback = self.callback

            def exec_module(module: ModuleType) -> None:
                run_module(module)
                callback(module)

            spec.loader.exec_module = exec_module
        return spec


def after_import(name: str, callback: Callable[[ModuleType], None]) -> None:
    """Call `callback(module)` now if the module `name` is imported, else right after it first is (idempotent per
    name and callback). For a module inside a package, the finder is consulted once the package is imported.

    Args:
        name: the module's full dotted name.
        callback: what to run on the module; an exception it raises propagates from the import that triggered it.
    """
    if name in sys.modules:
        callback(sys.modules[name])
    elif not any(isinstance(f, _AfterImport) and f.name == name and f.callback == callback for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(name, callback))
