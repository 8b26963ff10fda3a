"""What may import what (the README's Architecture section), checked on the source of every package folder.

`RULES` is the one table: a folder (ending in "/") or a module file, the import prefixes its files must not import,
and the prefixes they may import all the same. Every import counts: module level, inside functions, relative ones
(resolved), `importlib.import_module("literal")`; `if TYPE_CHECKING:` blocks never run and are left out. A package
imported as such (`import ds_plugin.strategies`) is its `__init__` (`ds_plugin.strategies.__init__`). After the
static check, two real imports confirm what the source says.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]

LIGHTNING = ("lightning", "pytorch_lightning", "lightning_fabric")
FRAMEWORKS = (*LIGHTNING, "accelerate")
ADAPTERS = ("ds_plugin.strategies", "ds_plugin.accelerate")
ADAPTER_FOLDERS = ("ds_plugin/strategies/", "ds_plugin/accelerate/")
# the blockwise INT8/INT4 format: the bottom of quant/ and all kernels/ may import it
FORMAT = "ds_plugin.quant.comm.format"
STDLIB = "<stdlib>"  # in `allow`: any module of Python's standard library
EVERYTHING = ""  # in `forbid`: any import at all


@dataclasses.dataclass(frozen=True)
class Rule:
    scope: str
    """A folder ("ds_plugin/zero/": every file under it) or one module file, relative to the repository."""
    forbid: tuple[str, ...] = ()
    """Import prefixes (dotted, matched on whole components) the files in scope must not import."""
    allow: tuple[str, ...] = ()
    """Imports allowed even where a rule covering the file forbids them (the exceptions, each said why)."""
    exclude: tuple[str, ...] = ()
    """Folders inside `scope` this rule does not cover."""
    after_framework: bool = False
    """The `allow`ed imports run only inside a hook on a framework's own import, so the real import below (which
    checks that importing the core loads no framework) leaves them out."""
    why: str = ""


RULES: tuple[Rule, ...] = (
    Rule(
        "ds_plugin/",
        forbid=(*FRAMEWORKS, *ADAPTERS),
        exclude=ADAPTER_FOLDERS,
        why="the core never imports a framework nor an adapter",
    ),
    Rule(
        "ds_plugin/__init__.py",
        allow=("ds_plugin.strategies.registry", "ds_plugin.strategies.__init__"),
        why="`import ds_plugin` registers the strategy names (factories that load the adapter on first use) and "
        "lazily exposes `ds_plugin.strategies`",
    ),
    Rule(
        "ds_plugin/deepspeed/_rank_entry.py",
        allow=("ds_plugin.accelerate.bootstrap",),
        after_framework=True,
        why="a `ds-plugin launch` rank hands an HF script's TrainingArguments(deepspeed=...) to the Accelerate "
        "adapter, imported only once the script has loaded transformers' TrainingArguments",
    ),
    Rule("ds_plugin/zero/", forbid=ADAPTERS, why="the ZeRO algorithm never imports the adapters"),
    Rule("ds_plugin/strategies/", forbid=("ds_plugin.accelerate",), why="adapters never import each other"),
    Rule("ds_plugin/accelerate/", forbid=("ds_plugin.strategies", *LIGHTNING), why="adapters never import each other"),
    Rule(
        "ds_plugin/kernels/",
        forbid=("ds_plugin",),
        allow=(FORMAT, "ds_plugin.kernels.quant_linear_tilings"),
        why="kernels import only the quant format and the GEMM kernels' tilings",
    ),
    Rule(
        "ds_plugin/quant/comm/format.py",
        forbid=(EVERYTHING,),
        allow=("torch", STDLIB),
        why="the format is the bottom: it imports only torch",
    ),
    Rule(
        "ds_plugin/quant/comm/fused.py",
        forbid=("ds_plugin",),
        allow=(FORMAT, "ds_plugin.quant.cpu_compile"),
        why="the torch backend sits on the format and the compile rule only; it never reaches for the dispatch",
    ),
    Rule(
        "ds_plugin/quant/cpu_compile.py",
        forbid=(EVERYTHING,),
        allow=("torch", STDLIB),
        why="the compile rule serves the collectives and frozen storage alike: it imports only torch",
    ),
    Rule("ds_plugin/quant/__init__.py", forbid=("ds_plugin",), why="the quant package root imports nothing of ours"),
    Rule(
        "ds_plugin/quant/comm/",
        forbid=("ds_plugin.quant.frozen",),
        why="the collectives' formats know nothing of frozen-weight storage",
    ),
    Rule(
        "ds_plugin/quant/frozen/",
        forbid=("ds_plugin.quant.comm",),
        allow=(FORMAT,),
        why="frozen storage reuses only the format's block rule (INT8 codec, INT4 absmax), never the collectives",
    ),
    Rule(
        "ds_plugin/precision/fp8_linear.py",
        forbid=("ds_plugin.precision.fp8_all_gather",),
        why="FP8 layers know nothing of the FP8 all-gather built on them",
    ),
    Rule(
        "ds_plugin/precision/fp8_gathered.py",
        forbid=("ds_plugin.precision.fp8_linear",),
        why="the gathered FP8 weight does not depend on the layers that use it",
    ),
)

CYCLE_FREE = ("ds_plugin/quant/", "ds_plugin/kernels/", "ds_plugin/precision/")
"""Folders whose modules import each other without a cycle (through function-level imports too)."""


# ------------------------------------------------------------------ reading the imports


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts)  # a package is `pkg.__init__`


def _is_package(name: str, root: Path) -> bool:
    return (root.joinpath(*name.split(".")) / "__init__.py").is_file()


def _is_module(name: str, root: Path) -> bool:
    return root.joinpath(*name.split(".")).with_suffix(".py").is_file() or _is_package(name, root)


def _target(name: str, root: Path) -> str:
    """The graph node of an imported name: a package is its `__init__`."""
    return f"{name}.__init__" if _is_package(name, root) else name


def _without_type_checking(tree: ast.Module) -> ast.Module:
    tree.body = [
        node
        for node in tree.body
        if not (isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING")
    ]
    return tree


def imports(path: Path, root: Path) -> set[str]:
    """Every module `path` imports, anywhere in its body, with relative imports resolved.

    Args:
        path: a .py file under `root`.
        root: the directory the top-level package lives in.
    """
    name = _module_name(path, root)
    package = name.rsplit(".", 1)[0]  # `pkg.__init__` -> `pkg`; `pkg.mod` -> `pkg`
    found: set[str] = set()
    for node in ast.walk(_without_type_checking(ast.parse(path.read_text(), str(path)))):
        if isinstance(node, ast.Import):
            found.update(_target(alias.name, root) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            submodules = {f"{base}.{alias.name}" for alias in node.names}
            found |= {_target(m, root) for m in submodules if _is_module(m, root)} or {_target(base, root)}
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "import_module" and node.args:
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                found.add(_target(arg.value, root))
    return found - {name}


def _matches(name: str, prefix: str) -> bool:
    if prefix == EVERYTHING:
        return True
    if prefix == STDLIB:
        return name.split(".")[0] in sys.stdlib_module_names
    return name == prefix or name.startswith(f"{prefix}.")


def _covers(rule: Rule, rel: str) -> bool:
    inside = rel.startswith(rule.scope) if rule.scope.endswith("/") else rel == rule.scope
    return inside and not any(rel.startswith(folder) for folder in rule.exclude)


def violations(root: Path, rules: tuple[Rule, ...] = RULES) -> list[str]:
    """`file -> import (rule)` for every import a rule covering the file forbids and none allows.

    Args:
        root: the directory holding the `ds_plugin` package (the repository, or a test's synthetic tree).
        rules: the table.
    """
    out = []
    for path in sorted((root / "ds_plugin").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        covering = [r for r in rules if _covers(r, rel)]
        allowed = [p for r in covering for p in r.allow]
        for target in sorted(imports(path, root)):
            if any(_matches(target, p) for p in allowed):
                continue
            for rule in covering:
                if any(_matches(target, p) for p in rule.forbid):
                    out.append(f"{rel} -> {target} ({rule.scope}: {rule.why})")
                    break
    return out


# ------------------------------------------------------------------ the checks


def test_every_package_folder_follows_the_table() -> None:
    assert violations(REPO_ROOT) == []


def test_the_table_names_what_exists() -> None:
    # A renamed folder or module must be renamed here too, or its rule would silently check nothing.
    for rule in RULES:
        for scope in (rule.scope, *rule.exclude):
            assert (REPO_ROOT / scope).exists(), scope
    for prefix in (FORMAT, *ADAPTERS):
        assert _is_module(prefix, REPO_ROOT), prefix


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_checker_reports_an_adapter_importing_an_adapter_and_the_core_importing_a_framework(
    tmp_path: Path,
) -> None:
    _write(
        tmp_path,
        {
            "ds_plugin/__init__.py": "",
            "ds_plugin/config.py": "import json\n",
            "ds_plugin/zero/__init__.py": "",
            "ds_plugin/zero/plan.py": "from ds_plugin.config import json\n",
            "ds_plugin/strategies/__init__.py": "",
            "ds_plugin/strategies/_state.py": "import lightning\nfrom ds_plugin.zero import plan\n",
            "ds_plugin/accelerate/__init__.py": "",
            "ds_plugin/accelerate/plugin.py": "import accelerate\nfrom ds_plugin.zero.plan import x\n",
        },
    )
    assert violations(tmp_path) == []  # adapters may import their framework and the core
    # An adapter imports another adapter, through a relative import inside a function.
    _write(tmp_path, {"ds_plugin/accelerate/plugin.py": "def f():\n    from ..strategies import _state\n"})
    # The core imports a framework (module level) and an adapter (by importlib).
    _write(
        tmp_path,
        {
            "ds_plugin/zero/plan.py": "import lightning.pytorch as pl\n",
            "ds_plugin/config.py": "import importlib\nimportlib.import_module('ds_plugin.accelerate.plugin')\n",
        },
    )
    found = violations(tmp_path)
    assert [line.split(" (")[0] for line in found] == [
        "ds_plugin/accelerate/plugin.py -> ds_plugin.strategies._state",
        "ds_plugin/config.py -> ds_plugin.accelerate.plugin",
        "ds_plugin/zero/plan.py -> lightning.pytorch",
    ], found
    # A type-only import never runs: not a violation.
    _write(
        tmp_path,
        {"ds_plugin/zero/plan.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import accelerate\n"},
    )
    assert len(violations(tmp_path)) == 2


def _graph(folders: tuple[str, ...]) -> dict[str, set[str]]:
    files = [p for folder in folders for p in sorted((REPO_ROOT / folder).rglob("*.py"))]
    return {_module_name(p, REPO_ROOT): {t for t in imports(p, REPO_ROOT) if t.startswith("ds_plugin.")} for p in files}


def test_no_import_cycles() -> None:
    graph = _graph(CYCLE_FREE)
    assert graph
    done: set[str] = set()

    def visit(name: str, path: tuple[str, ...]) -> None:
        assert name not in path, " -> ".join((*path, name))
        if name in done:
            return
        for dep in graph.get(name, ()):
            visit(dep, (*path, name))
        done.add(name)

    for name in graph:
        visit(name, ())


def _run(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


def test_importing_the_whole_core_loads_no_framework() -> None:
    # The real import: also catches a framework pulled in by a third-party package the core imports. The adapter
    # modules the table lets the core (or the other adapter) import are imported too.
    allowed = sorted(
        {
            p
            for r in RULES
            if not r.after_framework
            for p in r.allow
            if p.startswith(ADAPTERS) and not p.endswith(".__init__")
        }
    )
    code = (
        "import importlib, pathlib, sys\n"
        f"for name in {allowed!r}:\n"
        "    importlib.import_module(name)\n"
        f"root = pathlib.Path({str(REPO_ROOT)!r})\n"
        "for p in sorted((root / 'ds_plugin').rglob('*.py')):\n"
        "    parts = p.relative_to(root).with_suffix('').parts\n"
        f"    if parts[1] in {tuple(f.split('/')[1] for f in ADAPTER_FOLDERS)!r}:\n"
        "        continue\n"
        "    importlib.import_module('.'.join(parts[:-1] if parts[-1] == '__init__' else parts))\n"
        f"bad = [m for m in sys.modules if m.split('.')[0] in {FRAMEWORKS!r}]\n"
        "assert not bad, bad\n"
    )
    result = _run(code)
    assert result.returncode == 0, result.stderr


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
def test_importing_the_kernels_loads_only_the_format() -> None:
    packages = [FORMAT.rsplit(".", i)[0] for i in range(FORMAT.count(".") - 1, -1, -1)]
    expected = sorted(p for p in packages if p.startswith("ds_plugin.quant"))  # the format and its packages
    code = (
        "import sys\n"
        "import ds_plugin.kernels.quant_triton\n"
        "loaded = sorted(m for m in sys.modules if m.startswith('ds_plugin.quant'))\n"
        f"assert loaded == {expected!r}, loaded\n"
    )
    result = _run(code)
    assert result.returncode == 0, result.stderr
