"""The agent of `ds-plugin launch`: torchrun (`torch.distributed.run`) itself, except that a rank that fails is
reported in one line rather than torchrun's error table and the agent's own traceback. The failed rank's output
(a one-line refusal from ds_plugin, or the script's traceback) is already above it. (torchrun's `@record` on its
`main`, which copies a rank's error file to `TORCHELASTIC_ERROR_FILE`, is not run: nothing here sets that.)

    python -m ds_plugin.deepspeed._agent <torchrun arguments>
"""

from __future__ import annotations

import signal
import sys


def _how(exitcode: int) -> str:
    if exitcode >= 0:
        return f"exit code {exitcode}"
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return f"signal {-exitcode}"


def main(argv: list[str]) -> int:
    """Run torchrun with `argv`; returns the exit code: the first failed rank's (128 + the number of a signal).

    Args:
        argv: torchrun's command line, without the program name.
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    try:
        run(parse_args(argv))
    except ChildFailedError as exc:
        rank, first = exc.get_first_failure()
        others = ", ".join(f"rank {r} ({_how(f.exitcode)})" for r, f in sorted(exc.failures.items()) if r != rank)
        why = "its output above says why"
        if first.exitcode == -signal.SIGKILL:
            why = "killed from outside (often the kernel's out-of-memory killer: see `dmesg`)"
        print(
            f"ds-plugin launch: rank {rank} (local rank {first.local_rank}) ended with {_how(first.exitcode)}, {why}"
            + (f"; the others: {others}" if others else ""),
            file=sys.stderr,
        )
        # A signal as a shell reports it (128 + its number).
        return first.exitcode if first.exitcode > 0 else 128 - first.exitcode if first.exitcode < 0 else 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
