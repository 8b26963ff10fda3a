"""Suite-wide pytest setup: the test-only sabotage switch, and the `long` tier.

`long` tests are minutes-long end-to-end runs (the recipes, convergence runs, killed ranks). A bare
`python -m pytest -q` leaves them out so that the suite stays within 15 minutes on 2 cores; `python -m pytest -q -m
long` runs them (CI runs both). Naming a file, directory or test on the command line runs what it names, `long` or
not.
"""

from __future__ import annotations

import _break
import pytest

_break.install()  # DS_PLUGIN_TEST_NOOP_STEP=1 makes every optimizer step a no-op (tests/_break.py)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("markexpr") or config.args_source != pytest.Config.ArgsSource.TESTPATHS:
        return
    deselected = [item for item in items if item.get_closest_marker("long")]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = [item for item in items if not item.get_closest_marker("long")]
