"""`DummyOptim` / `DummyScheduler` on one process: the JSON's AdamW + WarmupDecayLR with "auto" params.

Writes {"lr": [...], "reference_lr": [...], "max_diff": float, "moved": float, "errors": {...}} to --out. The
reference is a plain torch AdamW with the values Accelerate's DeepSpeed integration would fill, and ds_plugin's
WarmupDecayLR (whose rates tests/zero/test_config_optimizer.py holds to DeepSpeed's).

DeepSpeed is hidden from this process (it is not a dependency of ds_plugin; accelerate.utils exports its own
DummyOptim only when DeepSpeed is installed), so the script runs as it would on a machine without it, and records
that it did ("deepspeed_hidden").
"""

from __future__ import annotations

import argparse
import json
import sys

sys.modules["deepspeed"] = None  # type: ignore[assignment]  # importlib.util.find_spec and import now both miss it

import accelerate.utils  # noqa: E402
import torch  # noqa: E402
from accelerate.utils.deepspeed import DummyOptim as AccelerateDummyOptim  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from ds_plugin.accelerate import Accelerator, DummyOptim, DummyScheduler, ZeroPlugin  # noqa: E402
from ds_plugin.lr_schedules import WarmupDecayLR  # noqa: E402

STEPS = 20
CONFIG = {
    "zero_optimization": {"stage": 2},
    "gradient_clipping": 0,
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "betas": [0.9, 0.95]}},
    "scheduler": {
        "type": "WarmupDecayLR",
        "params": {
            "total_num_steps": "auto",
            "warmup_num_steps": "auto",
            "warmup_min_lr": "auto",
            "warmup_max_lr": "auto",
        },
    },
}


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(4 * STEPS, 8, generator=g), torch.randn(4 * STEPS, 2, generator=g))


def one_line_error(fn) -> str:
    try:
        fn()
    except ValueError as exc:
        return str(exc)
    return "no error"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    accelerator = Accelerator(zero_plugin=ZeroPlugin(CONFIG))
    net = model()
    start = [p.detach().clone() for p in net.parameters()]
    optimizer = DummyOptim(net.parameters(), lr=0.01, weight_decay=0.1)
    scheduler = DummyScheduler(optimizer, total_num_steps=STEPS, warmup_num_steps=5)
    loader = DataLoader(data(), batch_size=4)
    net, optimizer, loader, scheduler = accelerator.prepare(net, optimizer, loader, scheduler)
    lrs = []
    for x, y in loader:
        lrs.append(optimizer.param_groups[0]["lr"])
        loss = nn.functional.mse_loss(net(x), y)
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()  # a no-op: the engine stepped the schedule
        optimizer.zero_grad()
    trained = [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach() for p in net.parameters()]

    ref = model()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01, weight_decay=0.1, betas=(0.9, 0.95))
    ref_sched = WarmupDecayLR(ref_opt, total_num_steps=STEPS, warmup_min_lr=0, warmup_max_lr=0.01, warmup_num_steps=5)
    ref_lrs = []
    for x, y in DataLoader(data(), batch_size=4):
        ref_lrs.append(ref_opt.param_groups[0]["lr"])
        nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
        ref_sched.step()
        ref_opt.zero_grad()
    diff = max(float((a - b.detach()).abs().max()) for a, b in zip(trained, ref.parameters(), strict=True))
    moved = max(float((a - b).abs().max()) for a, b in zip(trained, start, strict=True))
    result = {
        "lr": lrs,
        "reference_lr": ref_lrs,
        "max_diff": diff,
        "moved": moved,
        "engine_lr": scheduler.get_last_lr(),
        "deepspeed_hidden": not hasattr(accelerate.utils, "DummyOptim") and sys.modules.get("deepspeed") is None,
    }

    # Accelerate's own placeholder works the same; without an optimizer block it is a one-line error.
    accelerator.free_memory()
    plain = Accelerator(zero_plugin=ZeroPlugin({"zero_optimization": {"stage": 1}}))
    other = model()
    result["errors"] = {
        "no_optimizer_block": one_line_error(lambda: plain.prepare(other, AccelerateDummyOptim(other.parameters()))),
    }
    plain.free_memory()

    # Accelerate's DeepSpeed rules: the JSON's accumulation when the Accelerator is given none; its micro batch must
    # be the DataLoader's.
    json_gas = Accelerator(
        zero_plugin=ZeroPlugin({"gradient_accumulation_steps": 4, "zero_optimization": {"stage": 1}})
    )
    net = model()
    net, _ = json_gas.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    result["json_accumulation"] = [json_gas.gradient_accumulation_steps, json_gas.engine.gradient_accumulation_steps]
    json_gas.free_memory()
    micro = Accelerator(
        zero_plugin=ZeroPlugin({"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": 1}})
    )
    result["errors"]["micro_batch"] = one_line_error(lambda: micro.prepare(DataLoader(data(), batch_size=4)))
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
