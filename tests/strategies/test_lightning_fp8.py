"""`plugins=Fp8Precision()` with `ZeroStrategy` (one CPU rank, in a subprocess): FP8 layers train, learning a
regression set about as plain fp32 torch does from the same weights and batches, and a model without eligible
layers fails with one line.
"""

from __future__ import annotations

import pytest
from _launch import run_script

pytestmark = pytest.mark.slow

BATCHES = 4  # per epoch of fit_loader; the runs take three epochs, in order


def epoch_means(losses: list[float]) -> list[float]:
    """The loss of each epoch over the same 4 batches (a single batch's loss swings with what it holds)."""
    assert len(losses) % BATCHES == 0, losses
    return [sum(losses[i : i + BATCHES]) / BATCHES for i in range(0, len(losses), BATCHES)]


@pytest.fixture(scope="module")
def fp8() -> dict:
    return run_script("fp8_single.py", timeout=180)


def test_fp8_plugin_swaps_layers_and_trains(fp8: dict) -> None:
    assert fp8["fp8"] == {"enabled": True, "recipe": "tensorwise"}
    assert fp8["compute_dtype"] == "bf16"
    assert fp8["fp8_layers"] == 3  # the three 16x16 blocks; the 16->1 head is not aligned
    assert fp8["finite"] and len(fp8["losses"]) == len(fp8["reference"]) == 12


def test_fp8_training_learns_like_fp32(fp8: dict) -> None:
    got, ref = epoch_means(fp8["losses"]), epoch_means(fp8["reference"])
    # A run that never steps scores the same batches the same every epoch (ratio 1); plain fp32 torch brings the
    # third epoch under a quarter of the first. FP8 must learn too: demand under 0.35.
    assert got[-1] < 0.35 * got[0], f"fp8 did not learn fit_loader: epoch losses {got} (fp32 torch: {ref})"
    # Before any step only the forward differs: E4M3 rounds each weight and activation by at most 2**-4 of it, and
    # over 16-wide dot products and a mean over the batch these errors average out, not add: within 2**-4.
    assert fp8["losses"][0] == pytest.approx(fp8["reference"][0], rel=2**-4)
    # Then every step follows gradients computed through fp8 (2-3 mantissa bits), so the runs drift apart, by a
    # fraction of how far training moves the loss: allow each epoch a tenth of the fp32 run's fall.
    fall = ref[0] - ref[-1]
    gaps = [abs(a - b) for a, b in zip(got, ref, strict=True)]
    assert max(gaps) <= 0.1 * fall, f"fp8 epoch losses {got} vs fp32 torch {ref}: gaps {gaps}, fp32 fell {fall:.4f}"


def test_fp8_all_gather_through_the_plugin_trains_alike(fp8: dict) -> None:
    # Tensorwise codes gathered as fp8 are the ones the layer would have made from the bf16 weight.
    assert fp8["fp8_gathers"] > 0, "the fp8 gather never ran"
    assert fp8["all_gather_losses"] == fp8["losses"]


def test_fp8_without_eligible_layers_is_one_line(fp8: dict) -> None:
    message = fp8["no_eligible_error"]
    assert "\n" not in message
    assert message.startswith("fp8: no nn.Linear in TinyMLP is eligible")
    assert "multiples of 16" in message
