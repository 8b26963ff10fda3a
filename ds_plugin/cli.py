"""The `ds-plugin` command: env, check-config, estimate, export, launch, bench (the last from a checkout only).

Every user mistake ends in one line on stderr and exit code 2; never a traceback. Mistakes in the command line
fail while it is parsed (`ds_plugin._argparse`), mistakes in the files it names raise `UsageError`,
`ConfigError` or `CheckpointError`, and `main` prints those. Any other exception is a bug in ds_plugin and
keeps its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from ds_plugin._argparse import MAX_COUNT, ArgumentParser, count, existing_path, number, one_line, output_dir, shown
from ds_plugin.config import ConfigError

# The harnesses live in the repository's top-level `benchmarks/` package, which the wheel does not ship: they need
# network namespaces, DeepSpeed or bitsandbytes, and a user's machine check needs none of them.
BENCHMARKS = {
    "zero-memory": "benchmarks.zero_memory",
    "lora-memory": "benchmarks.lora_memory",
    "peers": "benchmarks.peers",
    "comm": "benchmarks.comm",
    "slow-link": "benchmarks.slow_link",
    "fp8": "benchmarks.fp8",
    "kernels": "benchmarks.kernels",
    "kernel-resources": "benchmarks.kernel_resources",
    "quantize": "benchmarks.quantize",
    "big-model": "benchmarks.big_model",
    "export": "benchmarks.export_memory",
    "generate": "benchmarks.generate",
}
NO_CHECKOUT = (
    "needs the repository checkout (benchmarks/ is not installed): run it from a clone installed with "
    "`pip install -e .`"
)


class UsageError(Exception):
    """A bad command line or input file: printed as one line, exit code 2."""


def _user_errors() -> tuple[type[Exception], ...]:
    # CheckpointError lives beside torch, which `env`, `check-config` and `estimate` never import; it can only
    # have been raised once its module is loaded, so look it up then instead of importing it for every command.
    checkpoint = sys.modules.get("ds_plugin.checkpoint.guard")
    return (ConfigError, UsageError) + ((checkpoint.CheckpointError,) if checkpoint is not None else ())


def _exit_code(exc: SystemExit) -> int:
    """What the interpreter would exit with for `exc`: `main` returns it instead of raising."""
    if exc.code is None or isinstance(exc.code, int):
        return exc.code or 0
    print(exc.code, file=sys.stderr)
    return 1


def _cmd_env(args: argparse.Namespace) -> int:
    from ds_plugin.env import collect_env, format_env

    # A report reaches no network: importing bitsandbytes (0.50) on a CPU with AVX512-bf16 would look a kernel up on
    # the Hugging Face Hub. This process only, and only unless the user set it.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    report = collect_env()
    print(json.dumps(report, indent=2) if args.json else format_env(report))
    return 0


def _accelerate_config(path: str, data: Any) -> tuple[Any, dict[str, str], str] | None:
    """For an Accelerate config file (`data`, read from `path`): the DeepSpeed config it makes, its keys without
    effect and how to launch it; None for any other file."""
    from ds_plugin._accelerate_yaml import accelerate_type, deepspeed_config_block, deepspeed_section

    kind = accelerate_type(data)
    if kind is None:
        return None
    block = deepspeed_section(data, path)
    if block is None:
        raise UsageError(
            f"{path}: an Accelerate config with distributed_type {kind}, not DEEPSPEED: it has no DeepSpeed settings "
            "to check; give a DeepSpeed JSON, a preset, or an Accelerate config of type DEEPSPEED"
        )
    config, ignored = deepspeed_config_block(block)
    launch = (
        f"accelerate launch --config_file {path} -m ds_plugin.accelerate your_script.py (on CPU, or without DeepSpeed "
        "installed, add --multi_gpu)"
    )
    return config, {f"deepspeed_config.{k}": why for k, why in ignored.items()}, launch


def _cmd_check_config(args: argparse.Namespace) -> int:
    from ds_plugin._config_file import read_config_file
    from ds_plugin.config import from_deepspeed
    from ds_plugin.presets import PRESETS, get_preset

    launch, accelerate_ignored = None, {}
    try:
        if args.file in PRESETS:
            cfg = get_preset(args.file)
        else:
            data = read_config_file(Path(args.file))
            accelerate = _accelerate_config(args.file, data)
            if accelerate is not None:
                data, accelerate_ignored, launch = accelerate
            cfg = from_deepspeed(data)
    except RecursionError:
        # json and PyYAML parse nested containers recursively: a file nested thousands deep is hostile input.
        raise UsageError(f"{args.file}: nested too deeply to read; is it a DeepSpeed config?") from None
    if args.world_size is not None:
        from ds_plugin.zero.plan import resolve_plan

        # The launch's own resolution, without a framework: "auto" values a framework fills take DeepSpeed's defaults.
        world = args.world_size
        cfg = resolve_plan(cfg, world_size=world, ranks_per_node=args.ranks_per_node or world, check_only=True).config
    print(json.dumps(cfg.to_deepspeed(include_ignored=False), indent=2))
    ignored = {**accelerate_ignored, **cfg.ignored_keys()}
    if ignored:
        print(f"\nignored keys ({len(ignored)}): accepted, but they have no effect here")
        for key, reason in ignored.items():
            print(f"  {key}: {reason}")
    unresolved = cfg.unresolved()
    if unresolved:
        print(f'\n"auto" values resolved at launch from the framework: {", ".join(unresolved)}')
    if launch is not None:
        print(
            f"\nOK: {args.file} is a valid Accelerate DeepSpeed config (ZeRO stage {cfg.stage}); run it with",
            file=sys.stderr,
        )
        print(f"  {launch}", file=sys.stderr)
        return 0
    print(f"\nOK: {args.file} is a valid config (ZeRO stage {cfg.stage})", file=sys.stderr)
    return 0


def _cmd_estimate(args: argparse.Namespace) -> int:
    from ds_plugin.estimate import ModelShape, estimate, format_table, load_hf_config, shape_from_hf_config

    if (args.params is None) == (args.model_config is None):
        raise UsageError("give exactly one of --params N or --model-config config.json")
    if args.model_config is not None:
        path = args.model_config
        try:
            cfg = load_hf_config(path)
        except (OSError, ValueError, RecursionError) as exc:  # ValueError: not JSON, or not UTF-8
            reason = getattr(exc, "strerror", None) or str(exc)
            raise UsageError(f"--model-config {path}: cannot read it ({reason})") from None
        _check_hf_config(cfg, path)
        try:
            shape = shape_from_hf_config(cfg)
        except ValueError as exc:  # no size keys
            raise UsageError(f"--model-config {path}: {exc}") from None
    else:
        shape = ModelShape(params=int(args.params), hidden_size=args.hidden_size, num_layers=args.num_layers)
    try:
        result = estimate(
            shape,
            args.world_size,
            nodes=args.nodes,
            lora_rank=args.lora_rank,
            frozen_format=args.frozen_format,
            lora_targets=[t.strip() for t in args.lora_targets.split(",") if t.strip()],
            frozen_group_size=args.frozen_group_size,
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    print(json.dumps(result, indent=2) if args.json else format_table(result))
    return 0


# The integer sizes `shape_from_hf_config` does arithmetic with: a string, a float, zero or a 400-digit number in
# a hand-edited config.json would otherwise end in a TypeError, ZeroDivisionError or float OverflowError.
_HF_SIZE_KEYS = (
    "hidden_size", "n_embd", "d_model", "num_hidden_layers", "n_layer", "num_layers", "vocab_size",
    "num_attention_heads", "n_head", "num_key_value_heads", "head_dim", "intermediate_size", "n_inner", "ffn_dim",
    "n_positions", "max_position_embeddings",
)  # fmt: skip


def _check_hf_config(cfg: object, path: str) -> None:
    """Refuse a config.json that is not an object of positive integer sizes, naming the key."""
    if not isinstance(cfg, dict):
        raise UsageError(f"--model-config {path}: holds a JSON {type(cfg).__name__}, not an object of config keys")
    for key in _HF_SIZE_KEYS:
        value = cfg.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_COUNT:
            raise UsageError(
                f"--model-config {path}: {key} is {shown(value)}; it must be an integer from 1 to {MAX_COUNT}"
            )


def _cmd_export(args: argparse.Namespace) -> int:
    from ds_plugin.export import export_summary

    try:
        print(export_summary(args.ckpt_dir, args.out_dir, dtype=args.dtype))
    except OSError as exc:  # a file that vanished, no permission, a full disk: not a bug, one line
        where = f"{exc.filename}: " if exc.filename else ""
        raise UsageError(f"{where}{exc.strerror or exc}") from None
    return 0


def checkout_root() -> Path | None:
    """The repository checkout this ds_plugin runs from (an editable install or PYTHONPATH), else None.

    A wheel puts ds_plugin in site-packages, where no `benchmarks/` package of this repository sits beside it.
    """
    root = Path(__file__).resolve().parents[1]
    if (root / "benchmarks" / "__init__.py").is_file() and (root / "pyproject.toml").is_file():
        return root
    return None


def load_benchmark(name: str) -> ModuleType:
    """The module of benchmark `name` (a key of `BENCHMARKS`), imported from the checkout's `benchmarks/`.

    Args:
        name: the benchmark's name on the command line, e.g. ``"zero-memory"``.

    Raises:
        UsageError: ds_plugin is not running from a checkout, so there are no benchmarks to import.
    """
    root = checkout_root()
    if root is None:
        raise UsageError(NO_CHECKOUT)
    # The checkout goes first so that no other top-level `benchmarks` module shadows it; processes the harness
    # spawns inherit sys.path.
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    module = importlib.import_module(BENCHMARKS[name])
    if not Path(module.__file__ or "").resolve().is_relative_to(root / "benchmarks"):
        raise UsageError(f"`benchmarks` was imported from {module.__file__}, not from the checkout at {root}")
    return module


def _cmd_bench(args: argparse.Namespace, rest: list[str]) -> int:
    module = load_benchmark(args.name)
    try:
        return int(module.main(rest) or 0)
    except SystemExit as exc:  # the benchmark's parser refused `rest` (or printed --help)
        return _exit_code(exc)


def _cmd_launch(args: argparse.Namespace) -> int:
    from ds_plugin.deepspeed.launcher import LaunchError, run_launch

    try:
        return run_launch(args)
    except LaunchError as exc:
        raise UsageError(str(exc)) from None


def build_parser() -> ArgumentParser:
    """The `ds-plugin` parser; `ds-plugin bench NAME` hands the rest of the line to the benchmark's own parser."""
    from ds_plugin.estimate import FROZEN_FORMATS

    parser = ArgumentParser(prog="ds-plugin", description="ZeRO and ZeRO++ on FSDP2: tools")
    # Not `required=True`: argparse would report a missing command before an unknown flag (`ds-plugin --jsn`);
    # `_parse` says which was given first.
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=ArgumentParser)

    p = sub.add_parser("env", help="versions, GPUs, and which kernels and backends run here")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_env, parser=p)

    p = sub.add_parser("check-config", help="validate a DeepSpeed config (JSON/YAML file or preset name)")
    p.add_argument("file", help="path to a DeepSpeed .json/.yaml config, or a preset name such as zeropp")
    p.add_argument("--world-size", type=count(), help="also check what depends on the world size (batch sizes, hpZ)")
    p.add_argument("--ranks-per-node", type=count(), help="resolves zero_hpz_partition_size: auto")
    p.set_defaults(func=_cmd_check_config, parser=p)

    p = sub.add_parser("estimate", help="per-rank model-state memory for ZeRO stages 0-3")
    # 1e18 parameters: past any model, and 16 bytes each still fits a float without overflowing.
    p.add_argument("--params", type=number(1, 1e18), help="parameter count, e.g. 7.5e9")
    p.add_argument(
        "--model-config",
        type=existing_path,
        help="a transformers config.json (or its directory) instead of --params",
    )
    p.add_argument("--world-size", type=count(), required=True, help="total ranks")
    p.add_argument("--nodes", type=count(), default=1, help="nodes the ranks span")
    p.add_argument("--lora-rank", type=count(), help="also estimate LoRA with this rank (on --lora-targets)")
    p.add_argument(
        "--lora-targets",
        default="q,k,v,o",
        help="comma-separated projections LoRA adapts: q,k,v,o,gate,up,down, module names, or all-linear",
    )
    p.add_argument(
        "--frozen-format",
        default="bf16",
        choices=FROZEN_FORMATS,
        metavar="FORMAT",
        help=f"{'|'.join(FROZEN_FORMATS)}: storage of frozen Linear weights",
    )
    p.add_argument(
        "--frozen-group-size", type=count(), help="elements per scale of int8/int4/nf4/fp6 (default 128, 64, 64, 128)"
    )
    p.add_argument("--hidden-size", type=count(), help="with --params and --lora-rank: the hidden size")
    p.add_argument("--num-layers", type=count(), help="with --params and --lora-rank: the number of layers")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_estimate, parser=p)

    p = sub.add_parser(
        "export",
        help="consolidate a sharded checkpoint into safetensors (+ config.json)",
        description="Write a checkpoint's full weights as safetensors, reading about 1 GiB at a time (memory: that "
        "plus the largest tensor, whatever the model's size); the files replace an earlier export in out_dir only "
        "once all are written.",
    )
    p.add_argument(
        "ckpt_dir",
        help="a checkpoint directory written by ds_plugin (an engine, Lightning, Fabric, Accelerate)",
    )
    p.add_argument("out_dir", type=output_dir, help="where model.safetensors (and config.json) go; created")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], help="cast the weights (default: as saved)")
    p.set_defaults(func=_cmd_export, parser=p)

    p = sub.add_parser(
        "launch",
        help="the `deepspeed` launcher's flags: start a script's ranks through torchrun (CPU too)",
        description="Start SCRIPT on every rank as `deepspeed` does (--local_rank=<i> first, then your arguments).",
    )
    from ds_plugin.deepspeed.launcher import add_launch_arguments

    add_launch_arguments(p)
    p.set_defaults(func=_cmd_launch, parser=p)

    p = sub.add_parser(
        "bench",
        help="benchmarks that print JSON (need the repository checkout); `ds-plugin bench NAME --help`",
        description="Run a benchmark of the repository's benchmarks/ package, which `pip install .` does not install: "
        "it needs a clone installed with `pip install -e .`.",
    )
    p.add_argument("name", choices=sorted(BENCHMARKS))
    p.set_defaults(func=None, parser=p)
    return parser


def _parse(parser: ArgumentParser, argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The parsed command line and what `bench NAME` hands on; raises SystemExit on a mistake or --help."""
    # `bench NAME ...` hands everything after NAME to the benchmark's own parser.
    if argv[:1] == ["bench"] and len(argv) >= 2 and argv[1] in BENCHMARKS:
        return parser.parse_args(argv[:2]), argv[2:]
    args, extra = parser.parse_known_args(argv)
    # Reported by the subcommand's parser, the message names the command (`ds-plugin estimate: error:`).
    command_parser = parser if args.command is None else args.parser
    if extra:
        command_parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command is None:
        parser.error("the following arguments are required: COMMAND")
    return args, []


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `ds-plugin` command; returns the exit code (0, or 2 with one line on stderr).

    Args:
        argv: the arguments after `ds-plugin` (default: `sys.argv[1:]`).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args, rest = _parse(build_parser(), argv)
    except SystemExit as exc:  # argparse has printed the error line (or the help)
        return _exit_code(exc)
    try:
        if args.command == "bench":
            return _cmd_bench(args, rest)
        return args.func(args)
    except _user_errors() as exc:
        print(f"ds-plugin {args.command}: error: {one_line(exc)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
