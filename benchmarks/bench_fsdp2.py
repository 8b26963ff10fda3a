"""Side by side: the same Accelerate script (train.py, bf16) under ds_plugin ZeRO-3 and under Accelerate's own FSDP2.

    python -m benchmarks.bench_fsdp2 [--steps 12] [--width 256] [--layers 4] [--repeats 2]

Three launches per repeat on 2 processes: ds_plugin (`-m ds_plugin.accelerate --ds-config zero3.json`),
Accelerate's FSDP2 plugin (fsdp2_2proc.yaml, `fsdp_version: 2`), and plain Accelerate DDP. Each reports the median
optimizer-step time of rank 0 and the peak RSS of every rank; the table says which distributed type really ran
(on CPU, Accelerate's FSDP2 config runs as MULTI_CPU DDP: Accelerate only shards on GPU-like devices). Timings are
for reading, never for pass/fail. On a GPU machine, `--gpus N` runs N processes on the GPUs instead.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil  # an Accelerate dependency

# The Accelerate recipe folder: its train.py and the launch configs all three runs use.
RECIPE_DIR = Path(__file__).resolve().parents[1] / "examples" / "with_accelerate"
ACCELERATE = str(Path(sys.executable).parent / "accelerate")


def _port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def _launch(name: str, yaml: Path, args: list[str], ds_config: Path | None, env: dict[str, str], procs: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench_fsdp2_") as tmp:
        return _launch_into(Path(tmp) / f"{name}.json", yaml, args, ds_config, env, procs)


def _launch_into(
    out: Path, yaml: Path, args: list[str], ds_config: Path | None, env: dict[str, str], procs: int
) -> dict:
    name = out.stem
    cmd = [ACCELERATE, "launch", "--config_file", str(yaml), "--main_process_port", _port(), "--num_processes",
           str(procs)]  # fmt: skip
    if ds_config is not None:
        cmd += ["-m", "ds_plugin.accelerate", "--ds-config", str(ds_config), "--log-level", "warning"]
    cmd += [str(RECIPE_DIR / "train.py"), *args, "--out", str(out)]
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        family = {proc.pid: psutil.Process(proc.pid)}
        done_at = None
        # gloo ranks sometimes hang or abort at interpreter exit after a complete run: once the result is written,
        # give the launch a grace period, then end every process it started (tracked: torchrun's ranks run in
        # sessions of their own).
        while proc.poll() is None and (done_at is None or time.monotonic() - done_at < 30):
            with contextlib.suppress(psutil.Error):
                family.update({c.pid: c for c in family[proc.pid].children(recursive=True)})
            if done_at is None and out.is_file():
                done_at = time.monotonic()
            time.sleep(0.5)
        for p in family.values():
            with contextlib.suppress(psutil.Error):
                p.kill()
        proc.wait()
        if not out.is_file():
            log.seek(0)
            raise SystemExit(f"{name} failed (exit {proc.returncode}):\n{log.read().decode(errors='replace')[-3000:]}")
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=1, help="best median step time of this many runs")
    parser.add_argument("--gpus", type=int, default=0, help="run on this many GPUs instead of 2 CPU processes")
    args = parser.parse_args()
    train_args = ["--mixed-precision", "bf16", "--steps", str(args.steps), "--width", str(args.width), "--layers",
                  str(args.layers), "--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "HF_HUB_OFFLINE": "1"}
    plain_env = env if args.gpus else {**env, "ACCELERATE_USE_CPU": "true"}
    procs = args.gpus or 2
    multi = RECIPE_DIR / ("gpu_8.yaml" if args.gpus else "cpu_2proc.yaml")
    runs = {
        "ds_plugin ZeRO-3 (bf16)": (multi, RECIPE_DIR / "zero3.json", env),
        "Accelerate FSDP2 plugin (bf16)": (RECIPE_DIR / "fsdp2_2proc.yaml", None, plain_env),
        "Accelerate DDP (bf16 autocast)": (multi, None, plain_env),
    }
    rows = []
    for name, (yaml, ds_config, run_env) in runs.items():
        slug = name.split(" (")[0].replace(" ", "_")
        results = [_launch(slug, yaml, train_args, ds_config, run_env, procs) for _ in range(args.repeats)]
        best = min(results, key=lambda r: r["step_time_s"])
        rss = max((r["peak_rss_mib"] for r in results), key=max)
        rows.append((name, best["distributed_type"].split(".")[-1], best["step_time_s"] * 1e3, rss, best["losses"][-1]))
    print(f"model: GPT-2 {args.layers} layers x {args.width}, seq {args.seq_len}, batch {args.batch_size}/process, "
          f"{args.steps} steps, {procs} processes, OMP_NUM_THREADS={env['OMP_NUM_THREADS']}")  # fmt: skip
    print("| run | what ran | step time (median, ms) | peak RSS per rank (MiB) | last loss |")
    print("|---|---|---|---|---|")
    for name, kind, ms, rss, loss in rows:
        print(f"| {name} | {kind} | {ms:.1f} | {' / '.join(f'{x:.0f}' for x in rss)} | {loss:.3f} |")


if __name__ == "__main__":
    main()
