"""A Lightning run on 4 ranks whose rank 2 freezes mid-step ends by itself after the collective timeout, with one
clear error on rank 0.

The 2-rank case, with the restart that resumes bit-identically, is the `killed` fixture and the resume test of
test_lightning_multiprocess.py; the engine API's at 2 and 4 ranks is tests/runtime/test_dead_rank.py.
"""

from __future__ import annotations

import pytest
from _launch import run_script

from ds_plugin.checkpoint import read_checkpoint_info

pytestmark = [pytest.mark.slow, pytest.mark.long]


def test_four_ranks_one_frozen_mid_step_ends_the_fit_with_rank_failure_error(tmp_path):
    result = run_script("dead_rank4.py", workdir=tmp_path, timeout=240)
    assert result["error_type"] == "RankFailureError", result
    message = result["message"]
    assert "\n" not in message and message.startswith("rank 0 of 4: "), message
    assert "another rank died, hung or lost its network" in message, message
    # The timeout DS_PLUGIN_TIMEOUT gave the strategy's process group, and how to resume with the Trainer.
    assert "collective timeout 15 s" in message and 'ckpt_path="last"' in message, message
    assert 15 <= result["seconds"] < 120, result["seconds"]  # it waited for the timeout, then gave up
    # The checkpoint of the last finished epoch is complete and verifies.
    info, _ = read_checkpoint_info(tmp_path / "ckpt" / "last.ckpt")
    assert info["world_size"] == 4
