"""Suite-wide pytest setup."""

import _break

_break.install()  # DS_PLUGIN_TEST_NOOP_STEP=1 makes every optimizer step a no-op (tests/_break.py)
