"""The row dispatch's safety net: a Triton row kernel that fails on its first launch (for a kernel, dtype and bit
width) hands over to torch (one warning, same result); after one successful launch, its errors propagate."""

from __future__ import annotations

import logging
import types

import pytest
import torch

from ds_plugin.quant.comm import dispatch, fused


@pytest.fixture
def fake_kernels(monkeypatch: pytest.MonkeyPatch) -> types.SimpleNamespace:
    calls = types.SimpleNamespace(n=0, fail=True)

    def quantize_rows_triton(rows, block, bits):
        calls.n += 1
        if calls.fail:
            raise RuntimeError("PTX compile failed\nlong driver log")
        return fused.quantize_rows(rows, block, bits, compiled=False)

    module = types.SimpleNamespace(quantize_rows_triton=quantize_rows_triton)
    monkeypatch.setattr(dispatch, "triton_kernels", lambda t, backend="auto": module)
    monkeypatch.setattr(dispatch, "_triton_rows", {"verified": set(), "failed": None})
    monkeypatch.delenv("DS_PLUGIN_STRICT_KERNELS", raising=False)  # strict mode raises instead (test_quant_triton.py)
    return calls


def test_first_launch_failure_falls_back_to_torch(fake_kernels, caplog: pytest.LogCaptureFixture) -> None:
    rows = torch.randn(3, 200, generator=torch.Generator().manual_seed(0))
    expected = fused.quantize_rows(rows, 64, 8, compiled=False)
    with caplog.at_level(logging.WARNING, logger=dispatch.__name__):
        codes, scales = dispatch.quantize_rows(rows, 64, 8)
    assert torch.equal(codes, expected[0]) and torch.equal(scales, expected[1])
    assert fake_kernels.n == 1 and "PTX compile failed" in caplog.text and "long driver log" not in caplog.text
    dispatch.quantize_rows(rows, 64, 8)
    assert fake_kernels.n == 1  # not tried again
    with pytest.raises(RuntimeError, match="PTX compile failed"):  # an explicit Triton request is not rescued
        dispatch.quantize_rows(rows, 64, 8, backend="triton")


def test_errors_after_a_successful_launch_propagate(fake_kernels) -> None:
    rows = torch.randn(2, 128)
    fake_kernels.fail = False
    dispatch.quantize_rows(rows, 64, 8)
    fake_kernels.fail = True
    with pytest.raises(RuntimeError, match="PTX compile failed"):
        dispatch.quantize_rows(rows, 64, 8)
    # Another specialisation's first launch is still covered.
    codes, _ = dispatch.quantize_rows(rows, 64, 4)
    assert torch.equal(codes, fused.quantize_rows(rows, 64, 4, compiled=False)[0])
