"""The directory moves under `ds_plugin.checkpoint.io`'s crash safety (see "Crash safety" there).

A checkpoint NAME is written as `.NAME.partial-<id>` and put in place by a rename, or, over an existing NAME, by an
atomic exchange (Linux `renameat2(RENAME_EXCHANGE)`) or else two renames through `.NAME.old-<id>`.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any

__all__ = [
    "TEMPORARY",
    "exchange",
    "fsync_dir",
    "interrupted_swap",
    "leftovers",
    "remove",
    "temporary",
    "temporary_of",
]

# The temporary siblings of a checkpoint NAME while it is saved. A save's id is 12 hex digits; clearing accepts any,
# as older versions did, so that whatever a crashed save left goes.
TEMPORARY = re.compile(r"\.(?P<name>.+)\.(?P<kind>partial|old)-(?P<id>[^./]+)")
_SAVE_ID = re.compile(r"[0-9a-f]{12}")


def temporary(final: Path, kind: str, tag: str) -> Path:
    """`.NAME.partial-<tag>` (the save being written) or `.NAME.old-<tag>` (the old NAME, while being replaced)."""
    return final.parent / f".{final.name}.{kind}-{tag}"


def temporary_of(path: Path) -> str | None:
    """The NAME whose save `path` is a temporary directory of (named as saves name them), else None."""
    m = TEMPORARY.fullmatch(path.name)
    return m["name"] if m and _SAVE_ID.fullmatch(m["id"]) else None


def leftovers(final: Path) -> list[Path]:
    """The temporary siblings that saves of `final` left behind (`.NAME.partial-*`, `.NAME.old-*`)."""
    try:
        found = [p for p in final.parent.iterdir() if (m := TEMPORARY.fullmatch(p.name)) and m["name"] == final.name]
    except OSError:
        return []
    return sorted(found, key=lambda p: p.name)


def interrupted_swap(final: Path, marker: str) -> Path | None:
    """Where the previous checkpoint of `final` is when a two-rename swap died between its renames, else None.

    That is a `.NAME.old-*` that still has its marker while NAME is missing. A finished swap deletes the old
    directory's marker before the rest, so a crash while deleting it cannot bring it back. The `.NAME.partial-*`
    of the interrupted save is not needed: something else may have cleared it (`ds_plugin.checkpoint.layout` does).
    """
    if final.exists() or final.is_symlink():
        return None
    olds = [p for p in leftovers(final) if TEMPORARY.fullmatch(p.name)["kind"] == "old" and (p / marker).is_file()]
    # One at most, as the next save to NAME restores it; should there be more, the newest is the one NAME last was.
    return max(olds, key=lambda p: (p / marker).stat().st_mtime, default=None)


def remove(path: Path, *, ignore_errors: bool = True) -> None:
    """Delete a file, link or directory tree; by default what cannot be deleted stays for the next save to retry.

    Args:
        path: what to delete; a symlink (Lightning's `save_last="link"`) loses the link, not its target.
        ignore_errors: False to raise what the deletion hit (a missing `path` is never an error).
    """
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    elif path.is_dir():
        shutil.rmtree(path, ignore_errors=ignore_errors)


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (a rename into it) durable, where the platform allows."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


_AT_FDCWD, _RENAME_EXCHANGE = -100, 2
# renameat2's answers for "no atomic exchange here": an old kernel or libc, a filesystem without the flag, a
# seccomp filter. The two-rename fallback then runs (a real permission problem fails there too, with its error).
_NO_EXCHANGE = {errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM}


@functools.cache
def _renameat2() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # glibc < 2.28, or a libc without the wrapper
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def exchange(a: Path, b: Path) -> bool:
    """Swap two existing entries in one atomic step; False where the platform or filesystem cannot."""
    fn = _renameat2()
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in _NO_EXCHANGE:
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))
