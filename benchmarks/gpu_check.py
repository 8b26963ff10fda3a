"""The blockwise quantizer and the quantized-linear kernels on a CUDA GPU, against their torch forms.

Run by `benchmarks/gpu_check.sh`; prints one JSON object: device, versions, date; per bucket size the median
milliseconds of the quantizer's Triton and torch forms and whether their outputs are identical ("runs"); and per
frozen-weight format the largest error of the ``ds_plugin::quantized_linear`` kernels against ``F.linear`` on the
dequantized weight, on a real quantized 8192 x 8192 weight, relative to that product's largest entry ("linear").

It runs strict (``DS_PLUGIN_STRICT_KERNELS=1`` unless set otherwise: a kernel that fails to launch is an error), and
every row says which backend served its Triton figures (``"backend"``: "triton" when the kernels' launch counters
moved and, for the linear rows, the reference served nothing; else "reference"). It exits 1, naming the rows, when
any is not "triton", so an error of about zero from the reference cannot pass for the kernels'.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import sys
from typing import Any

import torch
import torch.nn.functional as F
import triton

from ds_plugin.quant import STRICT_KERNELS_ENV
from ds_plugin.quant.comm import dispatch
from ds_plugin.quant.frozen import linear_op
from ds_plugin.quant.frozen.codecs import dequantize_weight, quantize_weight
from ds_plugin.quant.frozen.linear_op import parts_list, quantized_linear, quantized_linear_grad_input


def _median_ms(fn, repeats: int = 20) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main() -> int:
    os.environ.setdefault(STRICT_KERNELS_ENV, "1")
    device = torch.device("cuda")
    report = {
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": datetime.date.today().isoformat(),
        "what": "quantize_rows + dequantize_rows_into, bf16 rows of 8 ranks' shards, INT8 block 4096 and INT4 block 64",
        "runs": quantizer_runs(device),
        "linear": linear_errors(device),
    }
    print(json.dumps(report, indent=1))
    problems = check_rows(report)
    if problems:
        print(
            f"gpu_check: {len(problems)} rows did not run the Triton kernels: " + "; ".join(problems), file=sys.stderr
        )
        return 1
    return 0


def check_rows(report: dict[str, Any]) -> list[str]:
    """One line per row of ``report`` ("runs" and "linear") whose ``"backend"`` is not "triton"."""
    runs = [f"quantizer numel={r['numel']} bits={r['bits']}" for r in report["runs"] if r.get("backend") != "triton"]
    linear = [f"linear {r['format']}" for r in report["linear"] if r.get("backend") != "triton"]
    return [f"{what}: not served by the Triton kernels" for what in runs + linear]


def quantizer_runs(device: torch.device) -> list[dict[str, Any]]:
    """The row quantizer's torch and Triton forms timed on 8 ranks' shards; ``"backend"``: what served the Triton
    figures, by :func:`~ds_plugin.quant.comm.dispatch.kernel_launches` (every row kernel used must have launched)."""
    runs = []
    gen = torch.Generator(device=device).manual_seed(0)
    for numel in (1 << 20, 1 << 24, 1 << 26):
        rows = torch.randn(8, numel // 8, generator=gen, device=device, dtype=torch.bfloat16)
        for bits, block in ((8, 4096), (4, 64)):
            entry: dict[str, Any] = {"numel": numel, "bits": bits, "block": block}
            outs = {}
            for backend in ("torch", "triton"):
                before = dispatch.kernel_launches()
                quantize = functools.partial(dispatch.quantize_rows, rows, block, bits, compiled=False, backend=backend)
                codes, scales = quantize()
                codes = codes.contiguous()
                outs[backend] = (codes, scales)
                entry[f"{backend}_quantize_ms"] = _median_ms(quantize)
                used = [("quantize", bits)]
                if bits == 8:
                    dequantize = functools.partial(
                        dispatch.dequantize_rows_into,
                        torch.empty_like(rows),
                        codes,
                        scales,
                        block,
                        compiled=False,
                        backend=backend,
                    )
                    entry[f"{backend}_dequantize_ms"] = _median_ms(dequantize)
                    used.append(("dequantize", 8))
                if backend == "triton":
                    after = dispatch.kernel_launches()
                    ran = all(after.get(key, 0) > before.get(key, 0) for key in used)
                    entry["backend"] = "triton" if ran else "reference"
            entry["identical"] = all(torch.equal(a, b) for a, b in zip(outs["torch"], outs["triton"], strict=True))
            entry["quantize_speedup"] = entry["torch_quantize_ms"] / entry["triton_quantize_ms"]
            runs.append(entry)
    return runs


def linear_errors(device: torch.device, n: int = 8192, k: int = 8192) -> list[dict]:
    """Largest |kernel - reference| / max |reference| of the forward (M = 1, 16, 4096) and backward (M = 4096);
    ``"backend"``: "triton" when both passes' kernels launched and the reference served no call, else "reference"."""
    gen = torch.Generator(device=device).manual_seed(1)
    w = torch.randn(n, k, generator=gen, device=device) * 0.02
    out = []
    for fmt in ("fp6", "int4", "int8"):
        parts = quantize_weight(w, fmt)
        group = {"fp6": 128, "int4": 64, "int8": 128}[fmt]  # the formats' defaults
        tensors = parts_list(fmt, parts)
        ref_w = dequantize_weight(parts, fmt, group, torch.bfloat16)
        entry = {"format": fmt, "N": n, "K": k}
        launches, calls = linear_op.kernel_launches(), linear_op.backend_calls()
        for m in (1, 16, 4096):
            x = torch.randn(m, k, generator=gen, device=device, dtype=torch.bfloat16)
            want = F.linear(x.float(), ref_w.float())
            got = quantized_linear(x, tensors, fmt, group, None).float()
            entry[f"fwd_m{m}_rel_err"] = float((got - want).abs().max() / want.abs().max())
        dy = torch.randn(4096, n, generator=gen, device=device, dtype=torch.bfloat16)
        want = dy.float() @ ref_w.float()
        got = quantized_linear_grad_input(dy, tensors, fmt, group, k).float()
        entry["bwd_m4096_rel_err"] = float((got - want).abs().max() / want.abs().max())
        after, after_calls = linear_op.kernel_launches(), linear_op.backend_calls()
        launched = all(after.get((p, fmt), 0) > launches.get((p, fmt), 0) for p in ("fwd", "bwd"))
        fell_back = any(
            after_calls.get((p, fmt, "reference"), 0) > calls.get((p, fmt, "reference"), 0) for p in ("fwd", "bwd")
        )
        entry["backend"] = "triton" if launched and not fell_back else "reference"
        out.append(entry)
    return out


if __name__ == "__main__":
    raise SystemExit(main())
