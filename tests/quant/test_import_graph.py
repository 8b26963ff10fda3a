"""The layering of the quantization and precision modules: one definition of the blockwise format at the bottom,
backends above it, one dispatch above them, frozen-weight storage beside the collectives (reading only their
format), and no import cycles (checked on the source, then on a real import)."""

import ast
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
PACKAGES = (
    "ds_plugin/quant",
    "ds_plugin/quant/comm",
    "ds_plugin/quant/frozen",
    "ds_plugin/kernels",
    "ds_plugin/precision",
)


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO_ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """The ds_plugin modules `path` imports anywhere in its body (module level or inside functions).

    ``importlib.import_module`` calls with a literal name count too; ``if TYPE_CHECKING:`` blocks do not run, so
    they are left out; ``from package import submodule`` counts as importing the submodule (the package's
    ``__init__`` is its own node).
    """
    found = set()
    for node in ast.walk(_without_type_checking(ast.parse(path.read_text()))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            submodules = {f"{node.module}.{alias.name}" for alias in node.names}
            found |= {name for name in submodules if _exists(name)} or {node.module}
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "import_module" and node.args:
            # importlib.import_module("ds_plugin...."): the lazy imports count too.
            if isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                found.add(node.args[0].value)
    return {name for name in found if name.startswith("ds_plugin.") and _exists(name)}


def _without_type_checking(tree: ast.Module) -> ast.Module:
    tree.body = [
        node
        for node in tree.body
        if not (isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING")
    ]
    return tree


def _exists(name: str) -> bool:
    path = REPO_ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _graph() -> dict[str, set[str]]:
    files = [p for pkg in PACKAGES for p in sorted((REPO_ROOT / pkg).glob("*.py"))]
    return {_module_name(p): _imports(p) - {_module_name(p)} for p in files}


def test_format_is_the_bottom_and_kernels_import_only_it():
    graph = _graph()
    assert graph["ds_plugin.quant.comm.format"] == set()
    for name, deps in graph.items():
        if name.startswith("ds_plugin.kernels."):
            assert deps <= {"ds_plugin.quant.comm.format"}, (name, deps)
    # The torch backend sits on the format only; it never reaches for the dispatch.
    assert graph["ds_plugin.quant.comm.fused"] == {"ds_plugin.quant.comm.format"}


def test_collectives_and_frozen_storage_stay_apart():
    graph = _graph()
    assert graph["ds_plugin.quant"] == set()  # the parent holds the shared interpreter switch and imports nothing
    for name, deps in graph.items():
        if name.startswith("ds_plugin.quant.comm"):
            assert not {d for d in deps if d.startswith("ds_plugin.quant.frozen")}, (name, deps)
        if name.startswith("ds_plugin.quant.frozen"):
            # Frozen INT8 reuses the collectives' block rule; nothing else of theirs.
            assert {d for d in deps if d.startswith("ds_plugin.quant.comm")} <= {"ds_plugin.quant.comm.format"}, name


def test_no_import_cycles():
    graph = _graph()
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


def test_fp8_modules_import_one_way():
    graph = _graph()
    assert "ds_plugin.precision.fp8_all_gather" not in graph["ds_plugin.precision.fp8_linear"]
    assert "ds_plugin.precision.fp8_linear" not in graph["ds_plugin.precision.fp8_gathered"]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
def test_importing_the_kernels_loads_only_the_format():
    code = (
        "import sys\n"
        "import ds_plugin.kernels.quant_triton\n"
        "loaded = sorted(m for m in sys.modules if m.startswith('ds_plugin.quant'))\n"
        "assert loaded == ['ds_plugin.quant', 'ds_plugin.quant.comm', 'ds_plugin.quant.comm.format'], loaded\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
