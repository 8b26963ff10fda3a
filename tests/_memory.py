"""The tests' one reading of this process's resident memory (Linux: /proc/self/statm)."""

from __future__ import annotations

import os


def resident_bytes() -> int:
    """Bytes of this process's memory resident in RAM now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
