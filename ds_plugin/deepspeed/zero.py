"""`deepspeed.zero.Init` and `deepspeed.zero.GatheredParameters` on ds_plugin's engine.

`Init` builds the model's parameters on the meta device (`ds_plugin.zero.init.meta_init`); `initialize` then shards
the empty model and allocates only each rank's rows, running the model's own initialisation on them, so no rank holds
the whole model (DeepSpeed's zero.Init holds one module's at a time).

`GatheredParameters(params, modifier_rank=r)`: inside the block every parameter reads as its full tensor through
`.data` (DeepSpeed's idiom: `p.data.copy_(...)`, `p.data.cpu()`, `module.weight.data`); on leaving it, rank r's
values become the parameter on every rank (its shards at stages 2/3, the fp32 master and the compute copy at stages
0/1). With `modifier_rank=None` the block only reads, and changes are dropped, as in DeepSpeed. Operations on the
parameter itself rather than its `.data` (`p.copy_(...)`) still act on this rank's shard: use `.data`.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from ds_plugin.zero.init import meta_init

__all__ = ["GatheredParameters", "Init", "register_engine"]

# Engines built by `ds_plugin.deepspeed.initialize`: at stages 0/1 an edited compute parameter must reach its master.
_ENGINES: weakref.WeakSet = weakref.WeakSet()


def register_engine(engine: Any) -> None:
    """Let `GatheredParameters` find the fp32 masters of `engine`'s replicated (stage 0/1) parameters.

    Args:
        engine: a `ZeroEngine`.
    """
    _ENGINES.add(engine)


class Init(contextlib.ContextDecorator):
    """Build the model inside: its parameters live on the meta device until `initialize` shards and fills them.

    Args:
        module: DeepSpeed's "partition an already built module" form: not supported (build it inside the block).
        enabled: False: build as usual.
        kwargs: DeepSpeed's other arguments (config, dtype, remote_device, ...): accepted; the config given to
            `initialize` decides.
    """

    def __init__(self, module: nn.Module | None = None, enabled: bool = True, **kwargs: Any) -> None:
        if module is not None:
            raise ValueError(
                "zero.Init(module=...): partitioning a built model is not supported; build it inside "
                "`with deepspeed.zero.Init():` or pass it to initialize as it is"
            )
        self.enabled = enabled
        self._ctx: contextlib.AbstractContextManager | None = None

    def __enter__(self) -> Init:
        if self.enabled:
            self._ctx = meta_init()
            self._ctx.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._ctx is not None:
            self._ctx.__exit__(*exc)
            self._ctx = None


def _params(params: Any) -> list[torch.Tensor]:
    if params is None:
        return []
    if isinstance(params, torch.Tensor):
        return [params]
    return [p for p in params if isinstance(p, torch.Tensor)] if isinstance(params, Iterable) else []


_GATHERED_CLASSES: dict[type, type] = {}
_FULL: dict[int, torch.Tensor] = {}


def _gathered_class(cls: type) -> type:
    """A subclass of `cls` whose `.data` is the parameter's full tensor (set while inside GatheredParameters)."""
    if cls not in _GATHERED_CLASSES:

        def get(self: Any) -> torch.Tensor:
            return _FULL[id(self)]

        def put(self: Any, value: torch.Tensor) -> None:
            _FULL[id(self)].copy_(value)

        _GATHERED_CLASSES[cls] = type(f"Gathered{cls.__name__}", (cls,), {"data": property(get, put)})
    return _GATHERED_CLASSES[cls]


def _masters(param: torch.Tensor) -> list[tuple[Any, nn.Parameter]]:
    """(replicated state, master) of an engine's stage 0/1 compute parameter."""
    found = []
    for engine in list(_ENGINES):
        state = getattr(engine, "_replicated", None)
        if state is not None:
            master = state.master_of().get(id(param))
            if master is not None:
                found.append((state, master))
    return found


class GatheredParameters(contextlib.AbstractContextManager):
    """Full parameters inside the block; with `modifier_rank`, that rank's edits reach every rank on leaving it.

    A collective: every rank enters and leaves the block with the same parameters.

    Args:
        params: a parameter or an iterable of them (a module's `parameters()`).
        modifier_rank: the rank whose values are kept on leaving (None: read only).
        fwd_module: DeepSpeed's external-parameter registration; no effect.
        enabled: False: do nothing.
    """

    def __init__(self, params: Any, modifier_rank: int | None = None, fwd_module: Any = None, enabled: bool = True):
        self.params = _params(params) if enabled else []
        self.modifier_rank = modifier_rank
        self._swapped: list[tuple[torch.Tensor, type]] = []

    def __enter__(self) -> None:
        if any(p.device.type == "meta" for p in self.params):
            # Built inside zero.Init: there is nothing to gather yet, and values written now would be lost.
            raise ValueError(
                "GatheredParameters: the parameters are still on the meta device (zero.Init defers them to initialize, "
                "which materializes and shards them); load weights after initialize, or build the model with "
                "ds_plugin.load_pretrained"
            )
        with torch.no_grad():
            for p in self.params:
                if isinstance(p, DTensor) and id(p) not in _FULL:
                    _FULL[id(p)] = p.full_tensor().detach().clone()
                    self._swapped.append((p, type(p)))
                    p.__class__ = _gathered_class(type(p))
        return None

    def __exit__(self, *exc: Any) -> None:
        swapped, self._swapped = self._swapped, []
        with torch.no_grad():
            for p, cls in swapped:
                full = _FULL.pop(id(p))
                p.__class__ = cls
                if self.modifier_rank is not None and exc[0] is None:
                    new = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=self.modifier_rank)
                    p.to_local().copy_(new.to_local())
            if self.modifier_rank is None or exc[0] is not None or not dist.is_initialized():
                return
            for p in self.params:
                if isinstance(p, DTensor):
                    continue
                dist.broadcast(p.data, src=self.modifier_rank)
                for state, master in _masters(p):
                    master.to_local().copy_(state.localize(p.data.to(master.dtype), master))
