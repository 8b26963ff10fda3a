"""One rank of `ds-plugin launch`: run the script as `deepspeed`'s launcher does, `--local_rank=<i>` first.

torchrun starts `python -m ds_plugin.deepspeed._rank_entry [--no-local-rank] [--module] script args...` per rank;
this puts `--local_rank=$LOCAL_RANK` right after the script name (where DeepSpeed's launcher puts it) and runs the
script as `__main__`. An HF script started the DeepSpeed way (`run_clm.py --deepspeed ds_config.json`) trains on
the engine: once transformers loads `TrainingArguments`, one built with `deepspeed=...` switches the rank to ds_plugin's
Accelerate path (`_hf_trainer_on_the_engine`); nothing is imported for that before then. Where
DeepSpeed is not installed, the script's `import deepspeed` loads ds_plugin's DeepSpeed API (`_alias.py`). A config
the script's ds_plugin calls refuse, or a `deepspeed.*` module ds_plugin does not cover, ends the rank in one line.
"""

from __future__ import annotations

import os
import runpy
import sys
from types import ModuleType

from ds_plugin._after_import import after_import
from ds_plugin.deepspeed import _alias


def _bind_cores() -> None:
    """`--bind_cores_to_rank`: this rank's equal slice of the launcher's cores, and as many OpenMP threads."""
    listed = os.environ.get("DS_PLUGIN_BIND_CORES")  # launcher.BIND_CORES_ENV (not imported: this stays light)
    if not listed:
        return
    cores = [int(c) for c in listed.split(",")]
    ranks, rank = int(os.environ.get("LOCAL_WORLD_SIZE", "1")), int(os.environ.get("LOCAL_RANK", "0"))
    per_rank = len(cores) // ranks
    mine = cores[rank * per_rank : (rank + 1) * per_rank]
    os.sched_setaffinity(0, mine)
    os.environ["OMP_NUM_THREADS"] = str(per_rank)  # before the script imports torch, which reads it once


def _hf_trainer_on_the_engine(training_args: ModuleType) -> None:
    """Once transformers has loaded `TrainingArguments`: the first one built with `deepspeed=...` switches this rank
    to ds_plugin's Accelerate path (`python -m ds_plugin.accelerate`'s hooks) and is then built through them; until
    then nothing of Accelerate or the adapter is imported, and arguments without it stay transformers' own."""
    cls = training_args.TrainingArguments
    original = cls.__post_init__

    def __post_init__(self: object) -> None:
        if cls.__post_init__ is not __post_init__ or not getattr(self, "deepspeed", None):
            return original(self)
        cls.__post_init__ = original  # the adapter hooks the class itself from here on
        from ds_plugin.accelerate.bootstrap import switch_on_for_launch  # the HF Trainer needs Accelerate anyway

        switch_on_for_launch()
        return cls.__post_init__(self)

    cls.__post_init__ = __post_init__


def _run(script: str, args: list[str], as_module: bool) -> None:
    sys.argv = [script, *args]
    if as_module:
        runpy.run_module(script, run_name="__main__", alter_sys=True)
    else:
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
        runpy.run_path(script, run_name="__main__")


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
    _bind_cores()
    if local_rank_arg:
        args = [f"--local_rank={os.environ.get('LOCAL_RANK', '0')}", *args]
    after_import("transformers.training_args", _hf_trainer_on_the_engine)
    _alias.install()
    try:
        _run(script, args, as_module)
    except Exception as exc:
        schema = sys.modules.get("ds_plugin._schema")  # loaded if ds_plugin raised it
        if isinstance(exc, _alias.NotCovered) or (schema is not None and isinstance(exc, schema.ConfigError)):
            sys.exit(f"ds_plugin: {exc}")
        raise


if __name__ == "__main__":
    main(sys.argv[1:])
