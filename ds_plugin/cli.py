"""The `ds-plugin` command: env, check-config, estimate, export, bench.

Every user mistake ends in one line on stderr and exit code 2; never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Sequence

from ds_plugin.config import ConfigError

BENCHMARKS = {
    "zero-memory": "ds_plugin.bench.zero_memory",
    "lora-memory": "ds_plugin.bench.lora_memory",
    "peers": "ds_plugin.bench.peers",
    "comm": "ds_plugin.bench.comm",
    "slow-link": "ds_plugin.bench.slow_link",
    "fp8": "ds_plugin.bench.fp8",
    "kernels": "ds_plugin.bench.kernels",
}


class UsageError(Exception):
    """A bad command line or input file: printed as one line, exit code 2."""


def _cmd_env(args: argparse.Namespace) -> int:
    from ds_plugin.env import collect_env, format_env

    report = collect_env()
    print(json.dumps(report, indent=2) if args.json else format_env(report))
    return 0


def _cmd_check_config(args: argparse.Namespace) -> int:
    from ds_plugin.config import from_deepspeed
    from ds_plugin.presets import PRESETS, get_preset

    cfg = get_preset(args.file) if args.file in PRESETS else from_deepspeed(args.file)
    if args.world_size is not None:
        cfg = cfg.resolve(world_size=args.world_size, ranks_per_node=args.ranks_per_node)
    print(json.dumps(cfg.to_deepspeed(include_ignored=False), indent=2))
    ignored = cfg.ignored_keys()
    if ignored:
        print(f"\nignored keys ({len(ignored)}): accepted, but they have no effect here")
        for key, reason in ignored.items():
            print(f"  {key}: {reason}")
    unresolved = cfg.unresolved()
    if unresolved:
        print(f'\n"auto" values resolved at launch from the framework: {", ".join(unresolved)}')
    print(f"\nOK: {args.file} is a valid config (ZeRO stage {cfg.stage})", file=sys.stderr)
    return 0


def _cmd_estimate(args: argparse.Namespace) -> int:
    from ds_plugin.estimate import ModelShape, estimate, format_table, load_hf_config, shape_from_hf_config

    if (args.params is None) == (args.model_config is None):
        raise UsageError("give exactly one of --params N or --model-config config.json")
    if args.model_config is not None:
        try:
            shape = shape_from_hf_config(load_hf_config(args.model_config))
        except (OSError, json.JSONDecodeError) as exc:
            raise UsageError(f"--model-config {args.model_config}: cannot read it ({exc})") from None
    else:
        if args.params <= 0:
            raise UsageError(f"--params {args.params:g} must be positive")
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


def _cmd_export(args: argparse.Namespace) -> int:
    from ds_plugin.export import export_command

    return export_command(args.ckpt_dir, args.out_dir, dtype=args.dtype)


def _cmd_bench(args: argparse.Namespace, rest: list[str]) -> int:
    module = importlib.import_module(BENCHMARKS[args.name])
    return int(module.main(rest) or 0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ds-plugin", description="ZeRO and ZeRO++ on FSDP2: tools")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("env", help="versions, GPUs, and which kernels and backends run here")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_env)

    p = sub.add_parser("check-config", help="validate a DeepSpeed config (JSON/YAML file or preset name)")
    p.add_argument("file", help="path to a DeepSpeed .json/.yaml config, or a preset name such as zeropp")
    p.add_argument("--world-size", type=int, help="also check what depends on the world size (batch sizes, hpZ)")
    p.add_argument("--ranks-per-node", type=int, help="resolves zero_hpz_partition_size: auto")
    p.set_defaults(func=_cmd_check_config)

    p = sub.add_parser("estimate", help="per-rank model-state memory for ZeRO stages 0-3")
    p.add_argument("--params", type=float, help="parameter count, e.g. 7.5e9")
    p.add_argument("--model-config", help="a transformers config.json (or its directory) instead of --params")
    p.add_argument("--world-size", type=int, required=True, help="total ranks")
    p.add_argument("--nodes", type=int, default=1, help="nodes the ranks span")
    p.add_argument("--lora-rank", type=int, help="also estimate LoRA with this rank (on --lora-targets)")
    p.add_argument(
        "--lora-targets",
        default="q,k,v,o",
        help="comma-separated projections LoRA adapts: q,k,v,o,gate,up,down, module names, or all-linear",
    )
    p.add_argument("--frozen-format", default="bf16", help="bf16|int8|int4|nf4|fp6: storage of frozen Linear weights")
    p.add_argument(
        "--frozen-group-size", type=int, help="elements per scale of int8/int4/nf4/fp6 (default 128, 64, 64, 128)"
    )
    p.add_argument("--hidden-size", type=int, help="with --params and --lora-rank: the hidden size")
    p.add_argument("--num-layers", type=int, help="with --params and --lora-rank: the number of layers")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_estimate)

    p = sub.add_parser("export", help="consolidate a sharded checkpoint into safetensors (+ config.json)")
    p.add_argument("ckpt_dir")
    p.add_argument("out_dir")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], help="cast the weights (default: as saved)")
    p.set_defaults(func=_cmd_export)

    p = sub.add_parser("bench", help="benchmarks that print JSON; `ds-plugin bench NAME --help`")
    p.add_argument("name", choices=sorted(BENCHMARKS))
    p.set_defaults(func=None)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `ds-plugin` command; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    # `bench NAME ...` hands everything after NAME to the benchmark's own parser.
    if argv[:1] == ["bench"] and len(argv) >= 2 and argv[1] in BENCHMARKS:
        args, rest = parser.parse_args(argv[:2]), argv[2:]
    else:
        args, rest = parser.parse_args(argv), []
    try:
        if args.command == "bench":
            return _cmd_bench(args, rest)
        return args.func(args)
    except (ConfigError, UsageError) as exc:
        print(f"ds-plugin {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
