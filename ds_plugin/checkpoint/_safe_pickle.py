"""The restricted unpickler for DCP's `.metadata` (see the pickle guard in `ds_plugin.checkpoint.guard`).

DCP writes `.metadata` with `pickle`; a crafted one could run code when unpickled. `MetadataUnpickler` builds only
what DCP's metadata legitimately holds: DCP's metadata classes (their Enum members also in the
`getattr(Class, "NAME")` form that Python 3.11.0-3.11.4 write), `torch.Size`, dtypes, layouts and paths.
"""

from __future__ import annotations

import enum
import importlib
import pickle
from typing import Any

import torch

__all__ = ["MetadataUnpickler"]

_PATH_MODULES = {"pathlib", "pathlib._local"}
_PATH_NAMES = {"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"}
_ALLOWED = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # looks a layout up by name
    ("collections", "OrderedDict"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.distributed.checkpoint.filesystem", "_StoragePrefix"),
}
_DCP_METADATA = "torch.distributed.checkpoint.metadata"  # plain dataclasses and enums only


def _enum_member(cls: Any, name: Any) -> enum.Enum:
    """Stands in for `builtins.getattr` in `.metadata`: resolves only `AllowedEnum.MEMBER`.

    Python 3.11.0-3.11.4 pickle an Enum member as `getattr(EnumClass, "NAME")` (other versions pickle the class
    and the value), so DCP metadata written there holds a `getattr` call. A general `getattr` would hand a
    forger any attribute of an allowed class (`Path.write_text`, a function's `__globals__`), so this one
    answers only with a member of an Enum class that DCP's metadata module defines.
    """
    if not (isinstance(cls, type) and issubclass(cls, enum.Enum) and cls.__module__ == _DCP_METADATA):
        raise pickle.UnpicklingError(f"getattr on {cls!r} is not allowed in DCP metadata (only on its Enum classes)")
    if not isinstance(name, str) or name not in cls.__members__:
        raise pickle.UnpicklingError(f"getattr({cls.__name__}, {name!r}) is not allowed in DCP metadata: not a member")
    return cls.__members__[name]


class MetadataUnpickler(pickle._Unpickler):
    """Builds only what DCP's `.metadata` legitimately holds; anything else is refused before it is imported.

    The pure-Python unpickler, so that BUILD can be checked too: BUILD sets attributes on the object below it, and
    on an allowed class (an Enum, a DCP dataclass, `Path`) that would change the class for the whole process, e.g.
    add a fake Enum "member". Metadata only ever BUILDs the instances it creates.
    """

    dispatch = dict(pickle._Unpickler.dispatch)

    def _load_build(self) -> None:
        target = self.stack[-2] if len(self.stack) > 1 else None
        if isinstance(target, type):
            raise pickle.UnpicklingError(f"setting attributes of {target.__name__} is not allowed in DCP metadata")
        pickle._Unpickler.load_build(self)

    dispatch[pickle.BUILD[0]] = _load_build

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED or (module in _PATH_MODULES and name in _PATH_NAMES):
            return super().find_class(module, name)
        if (module, name) == ("builtins", "getattr"):
            return _enum_member
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module == _DCP_METADATA:
            obj = getattr(importlib.import_module(module), name, None)
            if isinstance(obj, type) and obj.__module__ == module:  # a class defined there, not a re-export
                return obj
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in DCP metadata")
