"""`get_accelerator()`: DeepSpeed's device abstraction as training scripts call it, over torch's CUDA or the CPU.

    from ds_plugin.deepspeed.accelerator import get_accelerator   # was: from deepspeed.accelerator import ...
    device = torch.device(get_accelerator().device_name(local_rank))

DeepSpeedExamples and DeepSpeed-Chat call it for the device name, the current device, seeding, `empty_cache`,
`synchronize` and memory figures. On a machine without a GPU every call answers for the CPU, as DeepSpeed's CPU
accelerator does (its memory figures are this process's resident memory); the communication backend is then gloo.
"""

from __future__ import annotations

import contextlib
import os
import resource
from typing import Any

import torch

__all__ = ["get_accelerator"]


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _Accelerator:
    """CUDA when torch sees a GPU, else the CPU; method names and meanings as DeepSpeed's accelerators'."""

    def __init__(self) -> None:
        self._cuda = torch.cuda.is_available()
        self._name = "cuda" if self._cuda else "cpu"

    # devices
    def is_available(self) -> bool:
        return True

    def device_name(self, device_index: int | None = None) -> str:
        """ "cuda" / "cuda:<i>", or "cpu" (the index has no meaning on the CPU)."""
        return self._name if device_index is None or not self._cuda else f"{self._name}:{device_index}"

    def device(self, device_index: int | None = None) -> torch.device:
        return torch.device(self.device_name(device_index))

    def set_device(self, device_index: int) -> None:
        if self._cuda:
            torch.cuda.set_device(device_index)

    def current_device(self) -> int:
        return torch.cuda.current_device() if self._cuda else 0

    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}" if self._cuda else "cpu"

    def device_count(self) -> int:
        return torch.cuda.device_count() if self._cuda else 1

    def synchronize(self, device_index: int | None = None) -> None:
        if self._cuda:
            torch.cuda.synchronize(device_index)

    def communication_backend_name(self) -> str:
        return "nccl" if self._cuda else "gloo"

    # random numbers
    def random(self) -> Any:
        return torch.random

    def manual_seed(self, seed: int) -> None:
        (torch.cuda.manual_seed if self._cuda else torch.manual_seed)(seed)

    def manual_seed_all(self, seed: int) -> None:
        (torch.cuda.manual_seed_all if self._cuda else torch.manual_seed)(seed)

    def initial_seed(self) -> int:
        return torch.cuda.initial_seed() if self._cuda else torch.initial_seed()

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        return torch.cuda.get_rng_state(device_index or 0) if self._cuda else torch.get_rng_state()

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        if self._cuda:
            torch.cuda.set_rng_state(new_state, device_index or 0)
        else:
            torch.set_rng_state(new_state)

    # memory
    def empty_cache(self) -> None:
        if self._cuda:
            torch.cuda.empty_cache()

    def memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_allocated(device_index) if self._cuda else _rss_bytes()

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        if self._cuda:
            return torch.cuda.max_memory_allocated(device_index)
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(device_index)

    reset_max_memory_allocated = reset_peak_memory_stats

    def memory_reserved(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_reserved(device_index) if self._cuda else _rss_bytes()

    def max_memory_reserved(self, device_index: int | None = None) -> int:
        return torch.cuda.max_memory_reserved(device_index) if self._cuda else self.max_memory_allocated()

    def total_memory(self, device_index: int | None = None) -> int:
        if self._cuda:
            return torch.cuda.get_device_properties(device_index or 0).total_memory
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def available_memory(self, device_index: int | None = None) -> int:
        if self._cuda:
            return torch.cuda.mem_get_info(device_index)[0]
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")

    # dtypes
    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported() if self._cuda else True

    def is_fp16_supported(self) -> bool:
        return self._cuda

    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.float32, torch.bfloat16] + ([torch.float16] if self._cuda else [])

    # host memory and streams
    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor.pin_memory() if self._cuda else tensor

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned()

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self._name

    def stream(self, stream: Any) -> Any:
        return torch.cuda.stream(stream) if self._cuda else contextlib.nullcontext()

    def current_stream(self, device_index: int | None = None) -> Any:
        return torch.cuda.current_stream(device_index) if self._cuda else None

    def default_stream(self, device_index: int | None = None) -> Any:
        return torch.cuda.default_stream(device_index) if self._cuda else None

    def range_push(self, msg: str) -> None:
        if self._cuda:
            torch.cuda.nvtx.range_push(msg)

    def range_pop(self) -> None:
        if self._cuda:
            torch.cuda.nvtx.range_pop()


_ACCELERATOR: _Accelerator | None = None


def get_accelerator() -> _Accelerator:
    """The one accelerator of this process (CUDA if torch sees a GPU, else the CPU)."""
    global _ACCELERATOR
    if _ACCELERATOR is None:
        _ACCELERATOR = _Accelerator()
    return _ACCELERATOR
