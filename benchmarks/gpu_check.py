"""The blockwise quantizer on a CUDA GPU: Triton row kernels against the torch form, bit-compared and timed.

Run by `benchmarks/gpu_check.sh`; prints one JSON object (device, versions, date, and per bucket size the
median milliseconds of each form and whether their outputs are identical).
"""

from __future__ import annotations

import datetime
import functools
import json

import torch
import triton

from ds_plugin.quant import dispatch


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


def main() -> None:
    device = torch.device("cuda")
    report = {
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": datetime.date.today().isoformat(),
        "what": "quantize_rows + dequantize_rows_into, bf16 rows of 8 ranks' shards, INT8 block 4096 and INT4 block 64",
        "runs": [],
    }
    gen = torch.Generator(device=device).manual_seed(0)
    for numel in (1 << 20, 1 << 24, 1 << 26):
        rows = torch.randn(8, numel // 8, generator=gen, device=device, dtype=torch.bfloat16)
        for bits, block in ((8, 4096), (4, 64)):
            entry = {"numel": numel, "bits": bits, "block": block}
            outs = {}
            for backend in ("torch", "triton"):
                quantize = functools.partial(dispatch.quantize_rows, rows, block, bits, compiled=False, backend=backend)
                codes, scales = quantize()
                codes = codes.contiguous()
                outs[backend] = (codes, scales)
                entry[f"{backend}_quantize_ms"] = _median_ms(quantize)
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
            entry["identical"] = all(torch.equal(a, b) for a, b in zip(outs["torch"], outs["triton"], strict=True))
            entry["quantize_speedup"] = entry["torch_quantize_ms"] / entry["triton_quantize_ms"]
            report["runs"].append(entry)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
