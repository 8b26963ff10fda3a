"""`ds-plugin bench comm`: the ZeRO++ byte reductions hold (byte counts are deterministic, not timings)."""

from __future__ import annotations

import pytest

from benchmarks.comm import run


@pytest.mark.timeout(600)
def test_zeropp_byte_targets():
    report = run(n_layer=2, n_embd=128, seq=64, steps=1)
    c = report["configs"]
    # The baseline really moves weights and gradients across nodes.
    assert c["zero3"]["inter_node_bytes"] > 0 and c["zero3"]["backward_inter_node_allgather_bytes"] > 0
    assert c["qwz"]["allgather_bytes"] <= 0.51 * c["zero3"]["allgather_bytes"]
    assert c["qgz"]["gradient_bytes"] <= 0.27 * c["zero3"]["gradient_bytes"]
    assert c["hpz"]["backward_inter_node_allgather_bytes"] == 0
    assert c["zeropp"]["inter_node_bytes"] <= 0.26 * c["zero3"]["inter_node_bytes"]
    # qwZ and hpZ leave the gradient path alone; qgZ leaves the weight path alone.
    assert c["qwz"]["gradient_bytes"] == c["hpz"]["gradient_bytes"] == c["zero3"]["gradient_bytes"]
    assert c["qgz"]["allgather_bytes"] == c["zero3"]["allgather_bytes"]
