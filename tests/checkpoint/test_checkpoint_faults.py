"""SIGKILL during `save_checkpoint`, at each of its phases, in real processes (tests/checkpoint/scripts/crash_save.py).

Wherever the kill lands, the name still holds a complete checkpoint: the previous one (A), bit-identical, until
the new one (B) is in place; the temporary directories of the unfinished save are refused as incomplete, in one
line; and the next save to the name removes every leftover. The script saves A, starts B and kills itself at the
phase; this process then does the loading and checking.
"""

from __future__ import annotations

import json
import logging
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from ds_plugin.checkpoint import CheckpointError, load_checkpoint, read_checkpoint_info, save_checkpoint

SCRIPT = Path(__file__).parent / "scripts" / "crash_save.py"
# TARGET:PHASE, see the script: B saved over A (`same`, overwrite=True) or next to it (`new`). Phases: shards and
# metadata (before `.metadata`), marker (after it), rename (after the marker), swap (A moved aside, B not yet in:
# the two-rename fallback) and swapped (just after the atomic exchange: B is the checkpoint then).
SINGLE = [f"same:{p}" for p in ("shards", "metadata", "marker", "rename", "swap", "swapped")] + [
    f"new:{p}" for p in ("shards", "metadata", "marker", "rename")
]


def _placeholders(value: Any) -> Any:
    """An empty state of the same structure: zero tensors, None for every other value."""
    if isinstance(value, dict):
        return {k: _placeholders(v) for k, v in value.items()}
    if isinstance(value, list) and any(isinstance(v, dict) for v in value):
        return [_placeholders(v) for v in value]
    return torch.zeros_like(value) if isinstance(value, torch.Tensor) else None


def _assert_same(got: Any, ref: Any, where: str = "") -> None:
    if isinstance(ref, torch.Tensor):
        assert got.dtype == ref.dtype and torch.equal(got, ref), where
    elif isinstance(ref, dict):
        assert got.keys() == ref.keys(), where
        for k in ref:
            _assert_same(got[k], ref[k], f"{where}.{k}")
    elif isinstance(ref, (list, tuple)) and any(isinstance(v, dict) for v in ref):
        for i, (g, r) in enumerate(zip(got, ref, strict=True)):
            _assert_same(g, r, f"{where}.{i}")
    else:
        assert got == ref, where


def _load(path: Path, like: tuple[dict, dict]) -> tuple[dict, dict]:
    model, optim = _placeholders(like[0]), _placeholders(like[1])
    load_checkpoint(path, model_state=model, optimizer_state=optim)
    return model, optim


def _shifted(state: Any) -> Any:
    """Checkpoint C: every value of A changed, so a load of C cannot pass for A or B."""
    if isinstance(state, dict):
        return {k: _shifted(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_shifted(v) for v in state)
    if isinstance(state, torch.Tensor):
        return state + 1
    return state * 3 if isinstance(state, float) else state


def _refused_as_incomplete(path: Path, *words: str) -> None:
    with pytest.raises(CheckpointError) as err:
        read_checkpoint_info(path)
    message = str(err.value)
    assert "\n" not in message and all(w in message for w in words), message


def _check_after_crash(workdir: Path, target: str, phase: str, caplog: pytest.LogCaptureFixture, left: bool) -> None:
    ckpts = workdir / "ckpts"
    ref_a, ref_b = (torch.load(workdir / f"ref_{x}.pt", weights_only=True) for x in "AB")
    # After the exchange the save is complete: B is the checkpoint. Before it, and on every other path, A is.
    exchanged = (workdir / "exchanged").is_file() and json.loads((workdir / "exchanged").read_text())
    if phase == "swap":  # A is in `.ck.old-*`; the recovery must not need B's `.ck.partial-*`, which layout.py clears
        for partial in ckpts.glob(".ck.partial-*"):
            shutil.rmtree(partial)
    with caplog.at_level(logging.WARNING, logger="ds_plugin.checkpoint"):
        _assert_same(_load(ckpts / "ck", ref_a), ref_b if exchanged else ref_a, "ck")
    if phase == "swap":  # read from where the interrupted save had moved it
        assert ".ck.old-" in caplog.text and "interrupted" in caplog.text, caplog.text

    leftovers = [p for p in ckpts.iterdir() if p.name.startswith(".")]
    assert leftovers or not left, "nothing left behind: the kill came before the save began or after it ended"
    for p in leftovers:
        _refused_as_incomplete(p, "incomplete", "interrupted")
    if target == "new":
        _refused_as_incomplete(ckpts / "ck_new", "ck_new", *(("interrupted",) if left else ()))
    else:  # the name is taken (by A, restored if it had been moved aside): a save that may not overwrite is refused
        with pytest.raises(CheckpointError, match="already exists"):
            save_checkpoint(ckpts / "ck", model_state=ref_a[0])
        assert (ckpts / "ck").is_dir()

    # The next successful save of that name removes the leftovers.
    name = ckpts / ("ck" if target == "same" else "ck_new")
    ref_c = _shifted(ref_a)
    save_checkpoint(name, model_state=ref_c[0], optimizer_state=ref_c[1], overwrite=True)
    assert sorted(p.name for p in ckpts.iterdir()) == (["ck"] if target == "same" else ["ck", "ck_new"])
    _assert_same(_load(name, ref_a), ref_c, name.name)
    if target == "new":
        _assert_same(_load(ckpts / "ck", ref_a), ref_a, "ck")


@pytest.fixture(scope="module")
def crashed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    root = tmp_path_factory.mktemp("crash")
    cmd = [sys.executable, str(SCRIPT), str(root), *SINGLE]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return root, json.loads((root / "result.json").read_text())


@pytest.mark.timeout(300)
@pytest.mark.parametrize("scenario", SINGLE)
def test_killed_save_leaves_a_complete_checkpoint(
    crashed: tuple[Path, dict[str, Any]], scenario: str, caplog: pytest.LogCaptureFixture
) -> None:
    root, results = crashed
    assert results[scenario] == {"signal": signal.SIGKILL}, results[scenario]  # exit 3: the kill point never came
    target, phase = scenario.split(":")
    _check_after_crash(root / f"{target}-{phase}", target, phase, caplog, left=True)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_rank_killed_mid_shard_leaves_the_previous_checkpoint(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Rank 1 of 2 dies half-way through its shard; rank 0 is killed too, as a launcher does, if still running."""
    cmd = [sys.executable, str(SCRIPT), str(tmp_path), "same:shards", "--world", "2", "--store", str(tmp_path / "s")]
    logs = [open(tmp_path / f"rank{r}.log", "w") for r in range(2)]  # closed below
    procs = [
        subprocess.Popen([*cmd, "--rank", str(r), "--kill-rank", "1"], stdout=logs[r], stderr=subprocess.STDOUT)
        for r in range(2)
    ]
    try:
        assert procs[1].wait(timeout=240) == -signal.SIGKILL, (tmp_path / "rank1.log").read_text()[-3000:]
        try:
            code = procs[0].wait(timeout=10)
            assert code != 0, "rank 0 reported success for a save whose rank 1 died"
        except subprocess.TimeoutExpired:
            procs[0].kill()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        for f in logs:
            f.close()
    # Rank 0 may have seen the failure and removed the temporary directory itself before it was killed.
    _check_after_crash(tmp_path / "same-shards", "same", "shards", caplog, left=False)


def test_overwrite_by_two_renames_where_there_is_no_atomic_exchange(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fallback's own successful path: B in place, A's `.ck.old-*` gone, nothing else left."""
    import ds_plugin.checkpoint.io as ckpt

    monkeypatch.setattr(ckpt, "exchange", lambda a, b: False)
    a, b = {"w": torch.zeros(3)}, {"w": torch.arange(3.0)}
    save_checkpoint(tmp_path / "ck", model_state=a)
    save_checkpoint(tmp_path / "ck", model_state=b, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    load_checkpoint(tmp_path / "ck", model_state=a)
    assert torch.equal(a["w"], b["w"])
