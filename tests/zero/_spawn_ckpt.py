"""Positional-argument form of the package's rank runner, as the checkpoint and comms-logger tests call it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ds_plugin.launch import run_ranks as _run_ranks


def _call(rank: int, world_size: int, *, target: Callable[..., Any], args: tuple) -> Any:
    return target(rank, world_size, *args)


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0) -> list[Any]:
    """Call `fn(rank, world_size, *args)` on `world_size` gloo ranks; return the results by rank."""
    return _run_ranks(_call, world_size, timeout=timeout, target=fn, args=args)
