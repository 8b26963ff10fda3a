"""The argument parser of `ds-plugin` and of every benchmark: a mistake is one line on stderr and exit code 2.

argparse's own `error` prints the usage block and then the message, several lines once a benchmark has a dozen
flags. The `type=` checks here reject a bad value while the command line is parsed, naming the flag, so a
benchmark never starts minutes of work on a count of zero, a NaN timeout or an output file it cannot write.
"""

from __future__ import annotations

import argparse
import math
import os
import stat
from collections.abc import Callable, Iterable
from typing import NoReturn

__all__ = [
    "MAX_COUNT",
    "MAX_LOCAL_RANKS",
    "MAX_TIMEOUT_S",
    "ArgumentParser",
    "choice_list",
    "count",
    "existing_path",
    "number",
    "one_line",
    "output_dir",
    "output_file",
    "shown",
]

# The largest count or size any flag takes: torch dimensions, NCCL/gloo element counts and most kernels index
# with int32 somewhere, and a value past it is a typo, never a run anyone means to start.
MAX_COUNT = 2**31 - 1
# The CPU benchmarks start every rank as a process on this one machine: a thousand is already past any machine's
# cores, and a typo of 100000 would fork until the machine thrashes instead of failing.
MAX_LOCAL_RANKS = 1024
# A week: longer is a typo, and past a few hundred years `timedelta` and `Thread.join` overflow.
MAX_TIMEOUT_S = 7 * 24 * 3600.0


def one_line(text: object) -> str:
    """`text` as one printable line: line breaks and other control characters escaped as Python's repr does.

    A user's value is echoed in the message (a path with a newline in it, a terminal escape sequence); escaping
    keeps the message on one line and the terminal unchanged.
    """
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(text))


def shown(value: object, limit: int = 60) -> str:
    """`repr(value)`, cut to `limit` characters: a 4000-digit number is named, not printed whole."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but an error is the single line `PROG: error: MESSAGE (see PROG --help)` and exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {one_line(message)} (see {self.prog} --help)\n")


def count(minimum: int = 1, maximum: int = MAX_COUNT) -> Callable[[str], int]:
    """A `type=` for an integer in [minimum, maximum]."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:  # also a number past Python's 4300-digit limit for int()
            raise argparse.ArgumentTypeError(f"{shown(text)} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{shown(value)} is too small: give an integer of at least {minimum}")
        if value > maximum:
            raise argparse.ArgumentTypeError(f"{shown(value)} is too large: give an integer of at most {maximum}")
        return value

    return parse


def number(minimum: float, maximum: float, *, above_minimum: bool = False) -> Callable[[str], float]:
    """A `type=` for a finite float in [minimum, maximum] (or (minimum, maximum] with `above_minimum`)."""
    low = f"above {minimum:g}" if above_minimum else f"at least {minimum:g}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{shown(text)} is not a number") from None
        if not math.isfinite(value):  # NaN fails every comparison: it would pass `value < minimum` unnoticed
            raise argparse.ArgumentTypeError(f"{shown(text)} is not a finite number")
        if not (value > minimum if above_minimum else value >= minimum) or value > maximum:
            raise argparse.ArgumentTypeError(
                f"{shown(text)} is out of range: give a number {low} and at most {maximum:g}"
            )
        return value

    return parse


def choice_list(choices: Iterable[str]) -> Callable[[str], list[str]]:
    """A `type=` for a comma-separated, non-empty list of names from `choices` (spaces around names ignored)."""
    allowed = tuple(choices)

    def parse(text: str) -> list[str]:
        names = [n.strip() for n in text.split(",") if n.strip()]
        unknown = [n for n in names if n not in allowed]
        if unknown or not names:
            what = f"unknown {', '.join(map(shown, unknown))}" if unknown else "no name given"
            raise argparse.ArgumentTypeError(f"{what}; choose from {','.join(allowed)}")
        return names

    return parse


def _kind(path: str) -> str | None:
    """'dir', 'file' (anything else that exists) or None (missing); an unusable name is an ArgumentTypeError."""
    if not path:
        raise argparse.ArgumentTypeError("the path is empty")
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except (OSError, ValueError) as exc:  # a name too long, no permission; ValueError: a NUL byte in it
        raise argparse.ArgumentTypeError(f"{shown(path)}: {getattr(exc, 'strerror', None) or exc}") from None
    return "dir" if stat.S_ISDIR(st.st_mode) else "file"


def _check_parent(path: str) -> None:
    # The nearest existing ancestor must be a directory: the missing ones in between are created on write.
    parent = os.path.dirname(os.path.abspath(path))
    while _kind(parent) is None:
        parent = os.path.dirname(parent)
    if _kind(parent) != "dir":
        raise argparse.ArgumentTypeError(f"{shown(path)}: {parent} is not a directory")


def output_file(path: str) -> str:
    """A `type=` for a file to write: not a directory, below a directory (or one that can be created)."""
    if _kind(path) == "dir":
        raise argparse.ArgumentTypeError(f"{shown(path)} is a directory; give a file name")
    _check_parent(path)
    return path


def output_dir(path: str) -> str:
    """A `type=` for a directory to write into: an existing directory, or one that can be created."""
    if _kind(path) == "file":
        raise argparse.ArgumentTypeError(f"{shown(path)} exists and is not a directory")
    _check_parent(path)
    return path


def existing_path(path: str) -> str:
    """A `type=` for a file or directory that must exist."""
    if _kind(path) is None:
        raise argparse.ArgumentTypeError(f"{shown(path)}: no such file or directory")
    return path
