"""FP8 vs BF16 training-step throughput on a stack of decoder-sized MLP blocks (``ds-plugin bench fp8``).

Each block is ``x + down(gelu(up(rmsnorm(x))))`` with ``up: hidden -> 4*hidden`` and ``down: 4*hidden -> hidden``,
the GEMM shapes that dominate a decoder layer. Every run starts from the same weights and sees the same batches;
the BF16 run uses ``nn.Linear`` under bf16 autocast, the FP8 runs swap the linears with
:func:`~ds_plugin.precision.fp8_linear.convert_to_fp8_training`. Reported per recipe: seconds per step (forward,
backward, AdamW step), the speedup over BF16, and ``loss_rel_diff``, the mean over steps of
``|loss_fp8 - loss_bf16| / loss_bf16``.

It needs a CUDA GPU (fp8 tensor cores); on a machine without one it says so and exits 0.
"""

from __future__ import annotations

import copy
import datetime
import json
import logging
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ds_plugin._argparse import ArgumentParser, choice_list, count
from ds_plugin.precision.fp8 import RECIPES
from ds_plugin.precision.fp8_linear import convert_to_fp8_training

__all__ = ["benchmark", "main"]

logger = logging.getLogger(__name__)

SKIP_MESSAGE = "needs a CUDA GPU"
_DISTINCT_BATCHES = 4


class _MlpBlock(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(hidden)
        self.up = nn.Linear(hidden, 4 * hidden, bias=False)
        self.down = nn.Linear(4 * hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _train(
    model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], steps: int, warmup: int, device: torch.device
) -> tuple[float, list[float]]:
    # lr is small on purpose: the run measures the same trajectory in both precisions, not how fast it learns.
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    losses: list[torch.Tensor] = []
    start = 0.0
    for step in range(steps):
        if step == warmup:
            _synchronize(device)
            start = time.perf_counter()
        x, target = batches[step % len(batches)]
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = F.mse_loss(model(x).float(), target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        # Kept on the device: a .item() per step would add a host sync to the timed loop.
        losses.append(loss.detach())
    _synchronize(device)
    return (time.perf_counter() - start) / max(1, steps - warmup), [float(v) for v in losses]


def benchmark(
    device: torch.device | str,
    hidden: int = 4096,
    layers: int = 4,
    steps: int = 30,
    batch_tokens: int = 8192,
    warmup: int = 5,
    recipes: tuple[str, ...] = RECIPES,
) -> dict[str, Any]:
    """Train the MLP stack in BF16 and in each FP8 recipe; return the timings and loss differences.

    Args:
        device: where to run (a CUDA device for meaningful numbers; CPU only exercises the code).
        hidden: model width (multiples of 128 keep every recipe eligible).
        layers: number of MLP blocks.
        steps: training steps per run, including ``warmup``.
        batch_tokens: tokens (rows) per batch.
        warmup: untimed steps at the start of each run.
        recipes: FP8 recipes to compare with BF16.
    """
    device = torch.device(device)
    gen = torch.Generator(device="cpu").manual_seed(0)
    torch.manual_seed(0)
    base = nn.Sequential(*(_MlpBlock(hidden) for _ in range(layers)))
    # A fixed random teacher gives a regression target whose loss falls steadily, so drift shows up.
    teacher = nn.Linear(hidden, hidden, bias=False).to(device)
    # A few distinct batches, cycled: at hidden 4096 one step's fp32 batch is 134 MB, so one per step would not fit
    # in host memory for long runs, and making them inside the loop would add to the timed step.
    batches = []
    with torch.no_grad():
        for _ in range(min(steps, _DISTINCT_BATCHES)):
            x = torch.randn(batch_tokens, hidden, generator=gen).to(device)
            batches.append((x, teacher(x)))
    results: dict[str, Any] = {}
    bf16_losses: list[float] = []
    for name in ("bf16", *recipes):
        model = copy.deepcopy(base).to(device)
        if name != "bf16":
            model = convert_to_fp8_training(model, name)
        step_s, losses = _train(model, batches, steps, min(warmup, steps - 1), device)
        entry: dict[str, Any] = {"step_s": step_s, "final_loss": losses[-1]}
        if name == "bf16":
            bf16_losses = losses
        else:
            entry["speedup_vs_bf16"] = results["bf16"]["step_s"] / step_s
            entry["loss_rel_diff"] = sum(abs(a - b) / b for a, b in zip(losses, bf16_losses, strict=True)) / len(losses)
        results[name] = entry
        logger.info("fp8 bench %s: %.4f s/step", name, step_s)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return results


def _environment(device: torch.device) -> dict[str, Any]:
    env: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else str(device),
        "torch": torch.__version__,
        "date": datetime.date.today().isoformat(),
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        pass
    return env


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print a table, or JSON with ``--json``.

    Args:
        argv: command-line arguments (default: ``sys.argv[1:]``).
    """
    parser = ArgumentParser(prog="ds-plugin bench fp8", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--hidden", type=count(), default=4096, help="model width (default 4096)")
    parser.add_argument("--layers", type=count(), default=4, help="MLP blocks (default 4)")
    parser.add_argument("--steps", type=count(), default=30, help="steps per run, including 5 warmup (default 30)")
    parser.add_argument("--batch-tokens", type=count(), default=8192, help="tokens per batch (default 8192)")
    # Checked while parsing, so a bad recipe is an error on a machine without a GPU too, not a skip.
    parser.add_argument(
        "--recipes", type=choice_list(RECIPES), default=",".join(RECIPES), help="comma-separated fp8 recipes"
    )
    args = parser.parse_args(argv)

    if not torch.cuda.is_available():
        if args.json:
            print(json.dumps({"skipped": SKIP_MESSAGE}))
        else:
            print(f"ds-plugin bench fp8 {SKIP_MESSAGE} (fp8 tensor cores, sm89+); none is visible here.")
        return 0
    recipes = tuple(args.recipes)
    device = torch.device("cuda", torch.cuda.current_device())
    results = benchmark(device, args.hidden, args.layers, args.steps, args.batch_tokens, recipes=recipes)
    report = {
        **_environment(device),
        "config": {
            "hidden": args.hidden,
            "layers": args.layers,
            "steps": args.steps,
            "batch_tokens": args.batch_tokens,
        },
        "results": results,
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"{report['device']}  torch {report['torch']}  hidden={args.hidden} layers={args.layers}")
    for name, entry in results.items():
        extra = ""
        if "speedup_vs_bf16" in entry:
            extra = f"  speedup {entry['speedup_vs_bf16']:.2f}x  loss rel diff {entry['loss_rel_diff']:.2%}"
        print(f"{name:>11}: {entry['step_s'] * 1e3:8.1f} ms/step{extra}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
