"""`plugins=Fp8Precision()` with `ZeroStrategy` (one CPU rank, in a subprocess): FP8 layers train, and a model
without eligible layers fails with one line.
"""

from __future__ import annotations

import pytest
from _launch import run_script

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fp8() -> dict:
    return run_script("fp8_single.py", timeout=180)


def test_fp8_plugin_swaps_layers_and_trains(fp8: dict) -> None:
    assert fp8["fp8"] == {"enabled": True, "recipe": "tensorwise"}
    assert fp8["compute_dtype"] == "bf16"
    assert fp8["fp8_layers"] == 3  # the three 16x16 blocks; the 16->1 head is not aligned
    assert fp8["finite"] and len(fp8["losses"]) == 3


def test_fp8_all_gather_through_the_plugin_trains_alike(fp8: dict) -> None:
    # Tensorwise codes gathered as fp8 are the ones the layer would have made from the bf16 weight.
    assert fp8["fp8_gathers"] > 0, "the fp8 gather never ran"
    assert fp8["all_gather_losses"] == fp8["losses"]


def test_fp8_without_eligible_layers_is_one_line(fp8: dict) -> None:
    message = fp8["no_eligible_error"]
    assert "\n" not in message
    assert message.startswith("fp8: no nn.Linear in TinyMLP is eligible")
    assert "multiples of 16" in message
