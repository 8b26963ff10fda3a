"""Reading a DeepSpeed config file (.json, or .yaml with YAML 1.2 floats) into plain data, with one-line errors."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

from ds_plugin._schema import ConfigError

__all__ = ["read_config_file"]


def _yaml_loader() -> type:
    """PyYAML's safe loader, plus YAML 1.2 floats: PyYAML reads `2.0e8` (no exponent sign) as a string."""

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?(?:[eE][-+]?[0-9]+)$|^[-+]?\.[0-9_]+(?:[eE][-+]?[0-9]+)?$"),
        list("-+0123456789."),
    )
    return Loader


def read_config_file(path: Path) -> Any:
    """The contents of a DeepSpeed .json or .yaml config file, unparsed; unreadable files are a `ConfigError`."""
    try:
        text = path.read_text()
    except (OSError, ValueError) as exc:  # ValueError: a NUL in the name, or bytes that are not UTF-8
        reason = getattr(exc, "strerror", None) or str(exc).splitlines()[0]
        shown = repr(str(path))  # a very long path keeps its start and its file name
        shown = shown if len(shown) <= 100 else f"{shown[:30]}...{shown[-67:]}"
        raise ConfigError(f"{shown}: cannot read the config ({reason})") from None
    if path.suffix.lower() in (".yaml", ".yml"):
        try:
            return yaml.load(text, Loader=_yaml_loader())
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: not valid YAML ({str(exc).splitlines()[0]})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})") from None
