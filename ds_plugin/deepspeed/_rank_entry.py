"""One rank of `ds-plugin launch`: run the script as `deepspeed`'s launcher does, `--local_rank=<i>` first.

torchrun starts `python -m ds_plugin.deepspeed._rank_entry [--no-local-rank] [--module] script args...` per rank;
this puts `--local_rank=$LOCAL_RANK` right after the script name (where DeepSpeed's launcher puts it) and runs the
script as `__main__`.
"""

from __future__ import annotations

import os
import runpy
import sys


def main(argv: list[str]) -> None:
    """Run the script named in `argv` as `__main__` with DeepSpeed's `--local_rank` argument.

    Args:
        argv: `[--no-local-rank] [--module] script args...`.
    """
    local_rank_arg = True
    as_module = False
    while argv and argv[0] in ("--no-local-rank", "--module"):
        flag = argv.pop(0)
        local_rank_arg = local_rank_arg and flag != "--no-local-rank"
        as_module = as_module or flag == "--module"
    script, args = argv[0], argv[1:]
    if local_rank_arg:
        args = [f"--local_rank={os.environ.get('LOCAL_RANK', '0')}", *args]
    sys.argv = [script, *args]
    if as_module:
        runpy.run_module(script, run_name="__main__", alter_sys=True)
    else:
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
        runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
