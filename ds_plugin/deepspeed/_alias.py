"""`import deepspeed` in a script that `ds-plugin launch` runs where DeepSpeed is not installed: the modules of
DeepSpeed's API that ds_plugin covers load ds_plugin's (`deepspeed` is `ds_plugin.deepspeed`, `deepspeed.comm` its
`comm`, ...), so a DeepSpeed script runs without even its import lines changed. Any other `deepspeed.*` module
(`deepspeed.runtime.*`, `deepspeed.utils`, ...) is a `ModuleNotFoundError` in one line naming what is covered, so a
library's `try: import deepspeed.x except ImportError:` goes its own way.

Where DeepSpeed is installed nothing is aliased: libraries that find it import its internals.
`DS_PLUGIN_DEEPSPEED_ALIAS` set to 0 turns the alias off, to 1 on even there. Standard library only: the rank entry
installs it before the script imports anything.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import os
import sys
from types import ModuleType
from typing import Any

__all__ = ["COVERED", "ENV", "NotCovered", "install"]

ENV = "DS_PLUGIN_DEEPSPEED_ALIAS"
COVERED = ("comm", "zero", "checkpointing", "accelerator", "ops", "ops.adam")
"""The `deepspeed.*` modules a script may import (with `deepspeed` itself): each is `ds_plugin.deepspeed.<name>`."""


class NotCovered(ModuleNotFoundError):
    """A `deepspeed.*` module ds_plugin's DeepSpeed API does not cover."""


class _Loader(importlib.abc.Loader):
    """Hands the import system ds_plugin's module itself: `deepspeed.initialize is ds_plugin.deepspeed.initialize`."""

    def __init__(self, target: str) -> None:
        self.target = target
        self._spec: Any = None

    def create_module(self, spec: Any) -> ModuleType:
        module = importlib.import_module(self.target)
        self._spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = self._spec  # the import system set the alias's spec on it; the module keeps its own


class _Alias(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != "deepspeed" and not name.startswith("deepspeed."):
            return None
        rest = name.partition(".")[2]
        if rest and rest not in COVERED:
            covered = ", ".join(["deepspeed", *(f"deepspeed.{c}" for c in COVERED)])
            raise NotCovered(
                f"{name} is not part of ds_plugin's DeepSpeed API (covered: {covered}); the README's "
                '"DeepSpeed scripts" says what else is not, and why',
                name=name,
            )
        return importlib.util.spec_from_loader(name, _Loader("ds_plugin.deepspeed" + (f".{rest}" if rest else "")))


def wanted() -> bool:
    """Whether `import deepspeed` should load ds_plugin's API here: DeepSpeed not installed, or the variable says so."""
    setting = os.environ.get(ENV, "").strip().lower()
    if setting in ("0", "false", "off", "no"):
        return False
    if setting in ("1", "true", "on", "yes"):
        return True
    return importlib.util.find_spec("deepspeed") is None


def install() -> bool:
    """Alias `deepspeed` where `wanted()`; returns whether it did (idempotent)."""
    if any(isinstance(f, _Alias) for f in sys.meta_path):
        return True
    if not wanted():
        return False
    sys.meta_path.insert(0, _Alias())
    return True
