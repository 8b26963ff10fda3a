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


class _Then(importlib.abc.Loader):
    """The module's own loader, then the finder's callback; the module keeps its own loader (`__loader__`)."""

    def __init__(self, loader: Any, finder: _AfterImport) -> None:
        self.loader, self.finder = loader, finder

    def create_module(self, spec: Any) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        module.__loader__ = self.loader
        if module.__spec__ is not None:
            module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        self.finder.fire(module)

    def __getattr__(self, name: str) -> Any:  # get_source, resource readers, ...: the module's own loader answers
        if name in ("loader", "finder"):  # not set yet (a copy being made): no lookup through itself
            raise AttributeError(name)
        return getattr(self.loader, name)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs `callback(module)` once, right after the module `name` finishes importing.

    A lookup that does not import (`importlib.util.find_spec(name)`, as `lightning_utilities` probes) leaves it
    armed: it fires only when the module has run, and stays in `sys.meta_path` inert after that (removing it outside
    the import lock could make another thread's import skip a finder). The module's spec gets a loader of its own
    (`_Then`), so a loader object that serves other modules too (a zip importer) is never changed.
    """

    def __init__(self, name: str, callback: Callable[[ModuleType], None]) -> None:
        self.name, self.callback = name, callback
        self._looking = self._fired = False

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != self.name or self._looking or self._fired:
            return None
        self._looking = True  # the lookup below must not find this finder again
        try:
            spec = importlib.util.find_spec(name)
        finally:
            self._looking = False
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _Then(spec.loader, self)
        return spec

    def armed_for(self, name: str, callback: Callable[[ModuleType], None]) -> bool:
        return not self._fired and self.name == name and self.callback == callback

    def fire(self, module: ModuleType) -> None:
        if not self._fired:
            self._fired = True
            self.callback(module)


def after_import(name: str, callback: Callable[[ModuleType], None]) -> None:
    """Call `callback(module)` now if the module `name` is imported (every call), else once, right after it first
    is (registered once per name and callback). For a module inside a package, the finder is consulted once the
    package is imported.

    Args:
        name: the module's full dotted name.
        callback: what to run on the module; an exception it raises propagates from the import that triggered it.
    """
    if name in sys.modules:
        callback(sys.modules[name])
    elif not any(isinstance(f, _AfterImport) and f.armed_for(name, callback) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(name, callback))
