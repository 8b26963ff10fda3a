"""A Lightning run on 4 ranks whose rank 2 is SIGKILLed mid-step ends by itself, with one clear error on rank 0.

The 2-rank case, with the restart that resumes bit-identically, is the `killed` fixture and the resume test of
test_lightning_multiprocess.py; the engine API's at 2 and 4 ranks is tests/zero/test_dead_rank.py.
"""

from __future__ import annotations

import pytest
from _launch import run_script

from ds_plugin.zero.checkpoint import read_checkpoint_info

pytestmark = [pytest.mark.slow, pytest.mark.long]


def test_four_ranks_one_killed_mid_step_ends_the_fit_with_rank_failure_error(tmp_path):
    result = run_script("dead_rank4.py", workdir=tmp_path, timeout=240)
    assert result["error_type"] == "RankFailureError", result
    message = result["message"]
    assert "\n" not in message and message.startswith("rank 0 of 4: "), message
    assert "another rank died, hung or lost its network" in message, message
    # The strategy's default collective timeout (not torch's 30 minutes), and how to resume with the Trainer.
    assert "collective timeout 600 s" in message and 'ckpt_path="last"' in message, message
    # The checkpoint of the last finished epoch is complete and verifies.
    info, _ = read_checkpoint_info(tmp_path / "ckpt" / "last.ckpt")
    assert info["world_size"] == 4
