"""bf16 on a CPU without bf16 units: detected from the CPU's flags, measured by `ds-plugin env`, warned about once
by the engine, and avoided by the default dtype the examples and benchmarks take."""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch import nn

from ds_plugin.runtime import cpu_bf16

# Flag lines as /proc/cpuinfo lists them (shortened): the CI machines' AMD EPYC (AVX2 only), a Sapphire Rapids
# Xeon, a Cooper Lake Xeon (AVX512-BF16 without AMX), an Ice Lake Xeon (AVX-512 without bf16), a Graviton3.
EPYC = "processor\t: 0\nflags\t\t: fpu sse2 avx fma avx2 bmi2 sha_ni\n"
SAPPHIRE = "flags\t\t: avx2 avx512f avx512bw avx512_bf16 amx_bf16 amx_tile amx_int8\n"
COOPER = "flags\t\t: avx2 avx512f avx512_bf16\n"
ICE = "flags\t\t: avx2 avx512f avx512bw avx512_vnni\n"
GRAVITON3 = "processor\t: 0\nFeatures\t: fp asimd evtstrm aes sve bf16 i8mm\n"


def test_units_are_read_from_the_cpu_flags():
    assert cpu_bf16.units_from_cpuinfo(EPYC) == (False, "avx2 only, no bf16 units")
    assert cpu_bf16.units_from_cpuinfo(SAPPHIRE) == (True, "avx512_bf16, amx_bf16")
    assert cpu_bf16.units_from_cpuinfo(COOPER) == (True, "avx512_bf16")
    assert cpu_bf16.units_from_cpuinfo(ICE) == (False, "avx512f only, no bf16 units")
    assert cpu_bf16.units_from_cpuinfo(GRAVITON3) == (True, "bf16")
    assert cpu_bf16.units_from_cpuinfo("") == (False, "no CPU flags listed")
    # This machine's own answer is one of the two, with its reason.
    native, why = cpu_bf16.cpu_bf16_units()
    assert isinstance(native, bool) and why


def test_default_dtype_follows_the_units(monkeypatch):
    monkeypatch.setattr(cpu_bf16, "cpu_bf16_units", lambda: (False, "avx2 only, no bf16 units"))
    assert cpu_bf16.fast_compute_dtype("cpu") == ("fp32", "this CPU has avx2 only, no bf16 units")
    monkeypatch.setattr(cpu_bf16, "cpu_bf16_units", lambda: (True, "amx_bf16"))
    assert cpu_bf16.fast_compute_dtype("cpu") == ("bf16", "this CPU has bf16 units (amx_bf16)")


def test_slowdown_is_a_measured_ratio():
    ratio = cpu_bf16.bf16_matmul_slowdown(m=32, k=64, n=64, repeats=1)
    assert ratio > 0 and ratio == ratio  # a ratio of two timings, not a constant


def test_engine_warns_once_for_bf16_on_a_cpu_without_units(monkeypatch, caplog):
    import ds_plugin

    monkeypatch.setattr(cpu_bf16, "_warned", set())
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with caplog.at_level(logging.WARNING, logger="ds_plugin"):
            monkeypatch.setattr(cpu_bf16, "cpu_bf16_units", lambda: (True, "amx_bf16"))
            ds_plugin.initialize(nn.Linear(8, 8), {"zero_optimization": {"stage": 0}, "bf16": {"enabled": True}})
            assert not [r for r in caplog.records if "bf16 units" in r.getMessage()]
            monkeypatch.setattr(cpu_bf16, "cpu_bf16_units", lambda: (False, "avx2 only, no bf16 units"))
            for stage in (0, 3):  # every setup path; one warning per process
                ds_plugin.initialize(
                    nn.Linear(8, 8), {"zero_optimization": {"stage": stage}, "bf16": {"enabled": True}}
                )
            ds_plugin.initialize(nn.Linear(8, 8), {"zero_optimization": {"stage": 0}})  # fp32: nothing to say
    finally:
        dist.destroy_process_group()
    warned = [r.getMessage() for r in caplog.records if "bf16 units" in r.getMessage()]
    assert len(warned) == 1, warned
    assert "\n" not in warned[0] and "avx2 only" in warned[0] and '"bf16": {"enabled": false}' in warned[0]
    assert torch.get_default_dtype() == torch.float32


def test_env_reports_the_units_and_the_ratio(monkeypatch):
    from ds_plugin.env import collect_env, format_env

    monkeypatch.setattr(cpu_bf16, "cpu_bf16_units", lambda: (False, "avx2 only, no bf16 units"))
    monkeypatch.setattr(cpu_bf16, "bf16_matmul_slowdown", lambda: 48.0)
    caps = collect_env()["capabilities"]
    assert caps["bf16 units (CPU)"].startswith("no (avx2 only, no bf16 units")
    assert caps["bf16/fp32 matmul time (CPU)"].startswith("48.0x")
    assert "bf16 units (CPU)" in format_env(collect_env())
    # bitsandbytes is reported as installed or not, never as a warning from its optional hub kernel.
    import importlib.util

    import ds_plugin.env as env_module

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        env_module.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "bitsandbytes" else real_find_spec(name, *a),
    )
    assert env_module.import_bitsandbytes_quietly() is False
    assert collect_env()["capabilities"]["bitsandbytes (NF4, 8-bit optimizers)"] == "no (not installed)"
