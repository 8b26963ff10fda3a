"""`ds-plugin bench export`: peak memory and time of `ds-plugin export` on a Llama-shaped fp32 checkpoint.

The checkpoint is what a full fine-tune saves: the fp32 weights of a Llama-2-7B-wide model (hidden 4096, MLP 11008,
vocabulary 32000; `--layers` of them), written as a sharded ds_plugin checkpoint by `--world-size` ranks that each
hold only their rows, so a checkpoint larger than this machine's memory can be made. Each way of exporting it runs
in a fresh process, one after the other, and reports its own peak RSS:

- `streaming`: `export_checkpoint`, which reads the checkpoint about `READ_BYTES` at a time;
- `whole_in_memory` (the baseline, skipped with `--no-baseline`): every weight read at once with
  `load_full_state_dict`, cast, and written with safetensors' `save_file`, as the export did before it streamed
  (and as DeepSpeed's `zero_to_fp32.py` does). At a 7B shape it needs 28 GB of fp32 plus the cast.

Both write the same tensors: the report says whether the two exports are equal byte for byte in their tensors.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ds_plugin._argparse import MAX_LOCAL_RANKS, MAX_TIMEOUT_S, ArgumentParser, count, number, output_dir, output_file
from ds_plugin.launch import run_ranks

from .big_model import llama_tensors

DTYPES = ("fp32", "bf16", "fp16")


def _save_rank(rank: int, world: int, *, shape: dict[str, int], path: str) -> int:
    """Save this rank's rows of every tensor (random, seeded by the tensor's index and the rank) as one checkpoint."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from ds_plugin.checkpoint import save_checkpoint

    mesh = init_device_mesh("cpu", (world,))
    state = {}
    for k, (name, size) in enumerate(llama_tensors(shape)):
        rows = -(-size[0] // world)
        local = (min(size[0], (rank + 1) * rows) - min(size[0], rank * rows), *size[1:])
        gen = torch.Generator().manual_seed(1000 * k + rank)
        t = torch.empty(local).normal_(0.0, 0.02, generator=gen)
        state[name] = DTensor.from_local(t, mesh, [Shard(0)], run_check=False, shape=size, stride=_stride(size))
    save_checkpoint(path, model_state=state)
    dist.barrier()
    return sum(t.to_local().numel() for t in state.values())


def _stride(size: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(math.prod(size[i + 1 :]) for i in range(len(size)))


def _export(mode: str, ckpt: str, out: str, dtype: str, queue: Any) -> None:
    start = time.perf_counter()
    if mode == "streaming":
        from ds_plugin.export import export_checkpoint

        export_checkpoint(ckpt, out, dtype=dtype)
    else:
        import torch
        from safetensors.torch import save_file

        from ds_plugin.checkpoint import load_full_state_dict

        state = load_full_state_dict(ckpt)
        cast = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
        state = {k: v.to(cast).contiguous() for k, v in state.items()}
        Path(out).mkdir(parents=True, exist_ok=True)
        save_file(state, str(Path(out) / "model.safetensors"), metadata={"format": "pt"})
    seconds = time.perf_counter() - start
    queue.put(
        {"seconds": round(seconds, 2), "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}
    )


def _measure(mode: str, ckpt: Path, out: Path, dtype: str, timeout: float) -> dict[str, Any]:
    ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: its peak RSS is the export's alone
    queue = ctx.Queue()
    proc = ctx.Process(target=_export, args=(mode, str(ckpt), str(out), dtype, queue))
    proc.start()
    proc.join(timeout)
    if proc.is_alive():
        proc.kill()
        proc.join()
        return {"error": f"did not finish in {timeout:g} s"}
    if proc.exitcode != 0:
        # -9: killed, most likely by the kernel for want of memory (the baseline at large shapes)
        return {"error": f"exit code {proc.exitcode}"}
    result = queue.get(timeout=10)
    result["bytes_written"] = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    return result


def _same_tensors(a: Path, b: Path) -> bool:
    from safetensors import safe_open

    files = sorted(a.glob("*.safetensors"))
    with safe_open(b / "model.safetensors", framework="pt") as whole:
        names = set(whole.keys())
        seen: set[str] = set()
        for file in files:
            with safe_open(file, framework="pt") as part:
                for name in part.keys():
                    seen.add(name)
                    if name not in names or not part.get_tensor(name).equal(whole.get_tensor(name)):
                        return False
    return seen == names


def run(args: Any) -> dict[str, Any]:
    shape = {"hidden": args.hidden, "intermediate": args.intermediate, "vocab": args.vocab, "layers": args.layers}
    params = sum(math.prod(s) for _, s in llama_tensors(shape))
    if args.workdir:
        Path(args.workdir).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="ds_plugin_bench_export_", dir=args.workdir) as tmp:
        work = Path(tmp)
        start = time.perf_counter()
        run_ranks(_save_rank, args.world_size, timeout=args.timeout, shape=shape, path=str(work / "ckpt"))
        ckpt_bytes = sum(f.stat().st_size for f in (work / "ckpt").rglob("*") if f.is_file())
        print(f"export: wrote a {ckpt_bytes / 1e9:.2f} GB checkpoint in {time.perf_counter() - start:.0f} s",
              file=sys.stderr)  # fmt: skip
        report: dict[str, Any] = {
            "shape": shape,
            "parameters": params,
            "checkpoint_bytes": ckpt_bytes,
            "dtype": args.dtype,
            "machine_memory_mb": round(_total_memory() / 2**20),
        }
        report["streaming"] = _measure("streaming", work / "ckpt", work / "streaming", args.dtype, args.timeout)
        report["whole_in_memory"] = None
        if args.baseline:
            report["whole_in_memory"] = _measure("whole", work / "ckpt", work / "whole", args.dtype, args.timeout)
            both = "error" not in report["streaming"] and "error" not in report["whole_in_memory"]
            report["same_tensors"] = _same_tensors(work / "streaming", work / "whole") if both else None
            if both:
                report["peak_rss_ratio"] = round(
                    report["streaming"]["peak_rss_mb"] / report["whole_in_memory"]["peak_rss_mb"], 3
                )
    return report


def _total_memory() -> int:
    import psutil

    return psutil.virtual_memory().total


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="ds-plugin bench export", description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=count(), default=8, help="decoder layers (default 8: 1.9B parameters)")
    parser.add_argument("--hidden", type=count(), default=4096, help="hidden size (default 4096)")
    parser.add_argument("--intermediate", type=count(), default=11008, help="MLP width (default 11008)")
    parser.add_argument("--vocab", type=count(), default=32000, help="vocabulary (default 32000)")
    parser.add_argument("--world-size", type=count(1, MAX_LOCAL_RANKS), default=2, help="ranks saving it")
    parser.add_argument("--dtype", choices=DTYPES, default="bf16", help="the export's dtype (default bf16)")
    parser.add_argument("--workdir", type=output_dir, help="where the checkpoint and exports go (default: /tmp)")
    parser.add_argument("--timeout", type=number(0, MAX_TIMEOUT_S, above_minimum=True), default=3600.0, help="seconds")
    parser.add_argument("--no-baseline", dest="baseline", action="store_false", help="skip the whole-in-memory run")
    parser.add_argument("--json", action="store_true", help="print the JSON report only")
    parser.add_argument("--out", type=output_file, help="also write the JSON report to this file")
    args = parser.parse_args(argv)
    report = run(args)
    text = json.dumps(report, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text if args.json else _summary(report))
    return 0


def _summary(report: dict[str, Any]) -> str:
    lines = [
        f"export of {report['parameters'] / 1e9:.2f}B fp32 parameters ({report['checkpoint_bytes'] / 1e9:.2f} GB "
        f"checkpoint) to {report['dtype']}, machine memory {report['machine_memory_mb']} MB:"
    ]
    for mode in ("streaming", "whole_in_memory"):
        r = report[mode]
        if r is None:
            continue
        done = "error" not in r
        what = (
            f"peak RSS {r['peak_rss_mb']} MB, {r['seconds']} s, {r['bytes_written'] / 1e9:.2f} GB"
            if done
            else r["error"]
        )
        lines.append(f"  {mode:<16} {what}")
    if "peak_rss_ratio" in report:
        lines.append(
            f"  streaming / whole peak RSS: {report['peak_rss_ratio']}; same tensors: {report['same_tensors']}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
