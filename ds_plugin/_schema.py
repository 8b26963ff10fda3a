"""The machinery behind `ds_plugin.config`: typed fields, a strict parser and its inverse.

Every config section is a frozen dataclass whose fields carry their rules in `metadata` (made by `option`).
`parse_section` walks a plain dict against such a class and either returns an instance or raises one
`ConfigError` whose message starts with the dotted path of the offending key. Anything that is not a
`ConfigError` escaping from here is a bug: the parser is fuzzed with random JSON to hold that line.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import math
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, Literal, Union, get_args, get_origin

AUTO = "auto"


class ConfigError(ValueError):
    """A config that cannot be used. The message names the dotted key path and how to fix it."""


def option(
    default: Any = dataclasses.MISSING,
    *,
    doc: str,
    key: str | None = None,
    aliases: tuple[str, ...] = (),
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    auto: bool = False,
    ignored: str | None = None,
    ignored_values: tuple[Any, ...] | None = None,
    factory: Callable[[], Any] | None = None,
    omit_none: bool = False,
) -> Any:
    """A dataclass field with the rules the parser enforces.

    Args:
        default: the DeepSpeed default.
        doc: one line for `check-config` and the docs.
        key: the DeepSpeed JSON key when it differs from the field name.
        aliases: older key names DeepSpeed still accepts for this field.
        ge / gt / le: numeric bounds.
        auto: whether the value "auto" is allowed (resolved later from the framework).
        ignored: why the key has no effect here; set keys with a reason are reported as ignored.
        ignored_values: report the key only when set to one of these (None: any value). For a switch whose
            other value is exactly what happens anyway, e.g. a feature not built yet turned off.
        factory: default factory for nested sections.
        omit_none: leave the key out of `emit_section`'s output while it is None (an optional block).
    """
    meta = {
        "doc": doc,
        "key": key,
        "aliases": aliases,
        "ge": ge,
        "gt": gt,
        "le": le,
        "auto": auto,
        "ignored": ignored,
        "ignored_values": ignored_values,
        "omit_none": omit_none,
    }
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def json_key(f: dataclasses.Field) -> str:
    return f.metadata.get("key") or f.name


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    return {
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "a list",
        dict: "an object",
    }.get(type(value), type(value).__name__)


def _describe(tp: Any) -> str:
    if tp is bool:
        return "true or false"
    if tp is int:
        return "an integer"
    if tp is float:
        return "a number"
    if tp is str:
        return "a string"
    if get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if get_origin(tp) is tuple:
        return "a list"
    if get_origin(tp) is dict or dataclasses.is_dataclass(tp):
        return "an object"
    return str(tp)


def _is_union(tp: Any) -> bool:
    return get_origin(tp) in (Union, types.UnionType)


def _convert(value: Any, tp: Any, path: str) -> Any:
    """Check `value` against the annotation `tp`; returns the converted value or raises ConfigError."""
    if _is_union(tp):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(value, arg, path)
            except ConfigError as exc:
                errors.append(_describe(arg))
                last = exc
        if len(errors) == 1:
            raise last
        raise ConfigError(f"{path}: expected {' or '.join(errors)}, got {_type_name(value)} {value!r:.60}")
    if get_origin(tp) is Literal:
        if isinstance(value, str | int) and not isinstance(value, bool) and value in get_args(tp):
            return value
        raise ConfigError(f"{path}: {value!r:.60} is not {_describe(tp)}")
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        # JSON writers spell large sizes as 5e8; accept integral floats as DeepSpeed does.
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and math.isfinite(value) and value.is_integer():
            return int(value)
    elif tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            if not math.isfinite(value):
                raise ConfigError(f"{path}: {value!r} is not a finite number")
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    elif get_origin(tp) is dict:
        # A free-form block (an optimizer's or scheduler's params): its section's __post_init__ checks the keys.
        if isinstance(value, Mapping):
            for k in value:
                if not isinstance(k, str):
                    raise ConfigError(f"{path}: keys must be strings, got {k!r:.40}")
            return copy.deepcopy(dict(value))
    elif get_origin(tp) is tuple:
        if isinstance(value, list | tuple):
            (item_tp, _) = get_args(tp)
            return tuple(_convert(v, item_tp, f"{path}[{i}]") for i, v in enumerate(value))
    elif dataclasses.is_dataclass(tp):
        return parse_section(tp, value, path)
    else:  # pragma: no cover - a field annotated with a type the parser does not know is a programming error
        raise TypeError(f"unsupported annotation {tp!r} at {path}")
    raise ConfigError(f"{path}: expected {_describe(tp)}, got {_type_name(value)} {value!r:.60}")


def _check_bounds(value: Any, meta: Mapping[str, Any], path: str) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool):
        return
    if meta["ge"] is not None and value < meta["ge"]:
        raise ConfigError(f"{path}: {value} is below the minimum {meta['ge']:g}")
    if meta["gt"] is not None and value <= meta["gt"]:
        raise ConfigError(f"{path}: {value} must be greater than {meta['gt']:g}")
    if meta["le"] is not None and value > meta["le"]:
        raise ConfigError(f"{path}: {value} is above the maximum {meta['le']:g}")


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def unknown_key_error(key: str, path: str, valid: list[str]) -> ConfigError:
    """The one-line error for a key that no section knows, with the closest valid key."""
    full = _join(path, key)
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    if close:
        return ConfigError(f"{full}: unknown key; did you mean {_join(path, close[0])!r}?")
    shown = ", ".join(sorted(valid)[:12]) + (", ..." if len(valid) > 12 else "")
    return ConfigError(f"{full}: unknown key; valid keys here: {shown}")


def parse_section(cls: type, data: Any, path: str, ignored_out: dict[str, tuple[Any, str]] | None = None) -> Any:
    """Build the dataclass `cls` from `data`, validating every key.

    Args:
        cls: a frozen dataclass whose fields were made with `option`. It may define `IGNORED_KEYS`
            (DeepSpeed keys accepted but without effect here: key -> reason), `_legacy(data, path)`
            (rewrites old key spellings into current ones before parsing) and `AUTO_IS_DEFAULT = True` (as
            DeepSpeed's pydantic sections, which drop "auto" values: any field written "auto" takes its default).
        data: the JSON object for this section.
        path: dotted path of the section, for messages ("" for the top level).
        ignored_out: collects `dotted key -> (value, reason)` for keys that are accepted but do nothing.
    """
    where = path or "config"
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}: expected an object, got {_type_name(data)} {data!r:.60}")
    for k in data:
        if not isinstance(k, str):
            raise ConfigError(f"{where}: keys must be strings, got {k!r:.40}")
    legacy = getattr(cls, "_legacy", None)
    if legacy is not None:
        data = legacy(dict(data), path)
    ignored_out = {} if ignored_out is None else ignored_out
    hints = typing.get_type_hints(cls)
    by_key: dict[str, dataclasses.Field] = {}
    fields = [f for f in dataclasses.fields(cls) if not f.metadata.get("internal")]
    for f in fields:
        by_key[json_key(f)] = f
        for alias in f.metadata.get("aliases", ()):
            by_key[alias] = f
    ignored_keys: Mapping[str, str] = getattr(cls, "IGNORED_KEYS", {})
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        full = _join(path, key)
        f = by_key.get(key)
        if f is None:
            if key in ignored_keys:
                ignored_out[full] = (value, ignored_keys[key])
                continue
            raise unknown_key_error(key, path, [json_key(g) for g in fields] + list(ignored_keys))
        if f.name in kwargs:
            raise ConfigError(f"{full}: given twice (as {json_key(f)!r} and its alias)")
        meta = f.metadata
        auto_is_default = value == AUTO and not meta.get("auto") and getattr(cls, "AUTO_IS_DEFAULT", False)
        if (meta.get("auto") and value == AUTO) or auto_is_default:
            if not auto_is_default:
                kwargs[f.name] = AUTO
            if meta.get("ignored") and meta.get("ignored_values") is None:
                ignored_out[_join(path, json_key(f))] = (AUTO, meta["ignored"])  # no effect, whoever fills it
            continue
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp) or (_is_union(tp) and any(dataclasses.is_dataclass(a) for a in get_args(tp))):
            sub = tp if dataclasses.is_dataclass(tp) else next(a for a in get_args(tp) if dataclasses.is_dataclass(a))
            converted = None if value is None and _is_union(tp) else parse_section(sub, value, full, ignored_out)
        else:
            converted = _convert(value, tp, full)
        _check_bounds(converted, meta, full)
        only = meta.get("ignored_values")
        if meta.get("ignored") and (only is None or converted in only):
            # Under the canonical key: `to_deepspeed` writes ignored values back where they are reported, and an
            # alias there would sit beside the field's own canonical key and fail as "given twice" on re-reading.
            ignored_out[_join(path, json_key(f))] = (converted, meta["ignored"])
        kwargs[f.name] = converted
    try:
        return cls(**kwargs)
    except ConfigError as exc:
        # __post_init__ checks raise with a path relative to the section; prefix the section path.
        msg = str(exc)
        raise ConfigError(msg if not path or msg.startswith(path) else f"{path}.{msg}") from None


def written_fields(cls: type, data: Mapping[str, Any]) -> frozenset[str]:
    """The field names of `cls` that the keys of `data` (canonical or alias) set; unknown and ignored keys are left out.

    Args:
        cls: a dataclass made with `option` fields.
        data: the section's JSON object, already valid for `parse_section`.
    """
    by_key = {}
    for f in dataclasses.fields(cls):
        if not f.metadata.get("internal"):
            by_key.update(dict.fromkeys((json_key(f), *f.metadata.get("aliases", ())), f.name))
    return frozenset(by_key[k] for k in data if k in by_key)


def emit_section(obj: Any) -> dict[str, Any]:
    """The inverse of `parse_section`: a JSON-ready dict with the canonical DeepSpeed key names."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        if f.metadata.get("internal"):
            continue
        value = getattr(obj, f.name)
        if value is None and f.metadata.get("omit_none"):
            continue  # an optional block the user did not write stays out of the written-back config
        if dataclasses.is_dataclass(value):
            value = emit_section(value)
        elif isinstance(value, dict):
            value = copy.deepcopy(value)
        elif isinstance(value, tuple):
            value = list(value)
        out[json_key(f)] = value
    return out


def field_docs(cls: type, path: str = "") -> list[tuple[str, Any, str]]:
    """(dotted key, default, doc) for every field, nested sections included; used by docs and tests."""
    rows = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.metadata.get("internal"):
            continue
        full = _join(path, json_key(f))
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            rows.extend(field_docs(tp, full))
        else:
            rows.append((full, f.default, f.metadata.get("doc", "")))
    return rows
