"""`ds_plugin._after_import.after_import`: a callback once a module has run, whatever looks the module up first."""

from __future__ import annotations

import importlib
import importlib.util
import sys

from ds_plugin._after_import import _AfterImport, after_import


def test_callbacks_run_after_the_import_and_a_lookup_does_not_use_them_up(tmp_path, monkeypatch) -> None:
    (tmp_path / "ds_plugin_probe_mod.py").write_text("VALUE = 7\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "ds_plugin_probe_mod", raising=False)
    seen: list[tuple[str, int]] = []

    def first(module):
        seen.append(("first", module.VALUE))

    def second(module):
        seen.append(("second", module.VALUE))

    try:
        after_import("ds_plugin_probe_mod", first)
        after_import("ds_plugin_probe_mod", second)
        after_import("ds_plugin_probe_mod", first)  # registered once per name and callback
        # A lookup without an import (lightning_utilities probes packages this way) runs nothing and keeps them.
        assert importlib.util.find_spec("ds_plugin_probe_mod") is not None and seen == []
        module = importlib.import_module("ds_plugin_probe_mod")
        assert sorted(seen) == [("first", 7), ("second", 7)]
        # The module keeps its own loader; the finders are spent, so a reload runs nothing again.
        assert type(module.__loader__).__name__ == "SourceFileLoader" and module.__spec__.loader is module.__loader__
        assert all(f._fired for f in sys.meta_path if isinstance(f, _AfterImport) and f.name == "ds_plugin_probe_mod")
        importlib.reload(module)
        assert len(seen) == 2
        after_import("ds_plugin_probe_mod", second)  # already imported: at once
        assert seen[-1] == ("second", 7)
    finally:
        sys.meta_path[:] = [
            f for f in sys.meta_path if not isinstance(f, _AfterImport) or f.name != "ds_plugin_probe_mod"
        ]
        sys.modules.pop("ds_plugin_probe_mod", None)
