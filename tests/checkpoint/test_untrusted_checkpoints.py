"""Forged checkpoints: pickle payloads that would run code, with the marker rewritten to match, through every door.

Whoever can rewrite a checkpoint can rewrite its marker too (the sha256 of `.metadata`, the file sizes), so the
marker proves nothing against a forger; what must hold is that no payload ever runs and the refusal is one line.
Doors: `load_checkpoint` (and `read_checkpoint_info`, `load_full_state_dict`), `ds-plugin export`, and a Lightning
`Trainer.fit` / `.validate` with `ckpt_path`. Payloads: `.metadata` (a bare one, and one nested in real metadata),
a shard's non-tensor value, and the framework state kept in the marker's `extra`. Every payload is first shown to
be live: plain unpickling runs it. Covered elsewhere, not repeated here: the unpickler's getattr/BUILD corner cases
(test_checkpoint_unpickler.py), a bare `.metadata` payload and a non-tensor optimizer entry through `load_checkpoint`
(test_checkpoint.py).
"""

from __future__ import annotations

import base64
import io
import json
import os
import pickle
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex

from ds_plugin.checkpoint import (
    MARKER,
    CheckpointError,
    load_checkpoint,
    load_full_state_dict,
    read_checkpoint_info,
    save_checkpoint,
)
from ds_plugin.export import export_checkpoint


class _Touch:
    """Unpickled, creates `path` (through os.system): the side effect that shows a payload ran."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {shlex.quote(str(self.path))}",))


def _live(run: Any, pwned: Path) -> None:
    """`run()` unpickles the payload the unguarded way: it must create `pwned`, or the test would prove nothing."""
    run()
    assert pwned.exists(), "the payload is not live: this test would prove nothing"
    pwned.unlink()


def _marker(ck: Path) -> dict[str, Any]:
    return json.loads((ck / MARKER).read_text())


def _forge_metadata(ck: Path, data: bytes) -> None:
    """Replace `.metadata` and make the marker agree, as a forger would."""
    import hashlib

    (ck / ".metadata").write_bytes(data)
    marker = _marker(ck)
    marker["metadata_sha256"] = hashlib.sha256(data).hexdigest()
    marker["files"][".metadata"] = len(data)
    (ck / MARKER).write_text(json.dumps(marker))


def _metadata_payload(ck: Path, pwned: Path, nested: bool) -> bytes:
    """A bare payload, or the checkpoint's own metadata with one hidden in it (unpickled before anything else)."""
    if not nested:
        return pickle.dumps(_Touch(pwned))
    _, metadata = read_checkpoint_info(ck)
    metadata.planner_data = {"hint": _Touch(pwned)}
    return pickle.dumps(metadata)


def _one_line(err: pytest.ExceptionInfo, *words: str) -> str:
    message = str(err.value)
    assert "\n" not in message and all(w in message for w in words), message
    return message


def _weights() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {"w": torch.randn(6, 4), "b": torch.randn(6)}


# -- door (i): the checkpoint module ---------------------------------------------------------------------------
def test_payload_nested_in_real_metadata_is_refused_by_every_reader(tmp_path: Path) -> None:
    pwned = tmp_path / "PWNED"
    ck = save_checkpoint(tmp_path / "ck", model_state=_weights())
    data = _metadata_payload(ck, pwned, nested=True)
    _live(lambda: pickle.loads(data), pwned)
    _forge_metadata(ck, data)
    readers = {
        "read_checkpoint_info": lambda: read_checkpoint_info(ck),
        "load_checkpoint": lambda: load_checkpoint(ck, model_state=_weights()),
        "load_full_state_dict": lambda: load_full_state_dict(ck),
    }
    for name, read in readers.items():
        with pytest.raises(CheckpointError) as err:
            read()
        _one_line(err, "refused", "system is not allowed in DCP metadata")
        assert not pwned.exists(), name


def _item_bytes(ck: Path, fqn: str) -> bytes:
    """The stored bytes of one non-tensor value, cut out of its shard file."""
    _, metadata = read_checkpoint_info(ck)
    info = metadata.storage_data[MetadataIndex(fqn)]
    with open(ck / info.relative_path, "rb") as f:
        f.seek(info.offset)
        return f.read(info.length)


def test_payload_in_a_shard_value_never_runs(tmp_path: Path) -> None:
    """A model-state value (as `_extra_state` would be): refused by a load, and never read by export."""
    pwned = tmp_path / "PWNED"
    ck = save_checkpoint(tmp_path / "ck", model_state={**_weights(), "extra": _Touch(pwned)})
    assert not pwned.exists()
    _live(lambda: torch.load(io.BytesIO(_item_bytes(ck, "model.extra")), weights_only=False), pwned)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(ck, model_state={**_weights(), "extra": None})
    _one_line(err, "'model.extra' is not plain data")
    from safetensors.torch import load_file

    out = export_checkpoint(ck, tmp_path / "out")  # tensors only: the value is not even read
    assert sorted(load_file(out / "model.safetensors")) == ["b", "w"]
    assert not pwned.exists()


def test_forged_marker_and_stray_paths_are_refused(tmp_path: Path) -> None:
    """What the marker and metadata name is checked before it is used: malformed fields, paths out of the directory."""
    ck = save_checkpoint(tmp_path / "ck", model_state=_weights())
    good = _marker(ck)
    malformed = [("files", ["__0_0.distcp"]), ("files", {"../x": 1}), ("files", {"a": "1"}), ("extra", "x")]
    for field, value in malformed:
        (ck / MARKER).write_text(json.dumps({**good, field: value}))
        with pytest.raises(CheckpointError) as err:
            read_checkpoint_info(ck)
        _one_line(err, "is malformed")
    (ck / MARKER).write_text(json.dumps(good))
    # The metadata may only name the checkpoint's own files: here it points at a copy of the shard outside it.
    _, metadata = read_checkpoint_info(ck)
    shard = next(iter(metadata.storage_data.values())).relative_path
    shutil.copy(ck / shard, tmp_path / "outside.distcp")
    for info in metadata.storage_data.values():
        info.relative_path = "../outside.distcp"
    _forge_metadata(ck, pickle.dumps(metadata))
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(ck, model_state=_weights())
    _one_line(err, "refers to '../outside.distcp', not a file of this checkpoint")


# -- door (ii): `ds-plugin export` -----------------------------------------------------------------------------
def test_export_cli_refuses_a_metadata_payload(tmp_path: Path) -> None:
    pwned = tmp_path / "PWNED"
    ck = save_checkpoint(tmp_path / "ck", model_state=_weights())
    data = _metadata_payload(ck, pwned, nested=False)
    _live(lambda: pickle.loads(data), pwned)
    _forge_metadata(ck, data)
    done = subprocess.run(
        [sys.executable, "-m", "ds_plugin.cli", "export", str(ck), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=tmp_path,
    )
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and len(done.stderr.splitlines()) == 1, done.stderr
    assert done.stderr.startswith("ds-plugin export: error: ") and "system is not allowed" in done.stderr
    assert not pwned.exists() and not (tmp_path / "out" / "model.safetensors").exists()


# -- door (iii): Lightning -------------------------------------------------------------------------------------
@pytest.fixture
def lightning_process() -> Any:
    """Lightning in this process: its environment variables and process group must not outlive the test."""
    env = dict(os.environ)
    yield
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(env)


def _lightning() -> tuple[Any, Any, Any]:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    import ds_plugin  # noqa: F401  (registers "zero3" with the Trainer)

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch: list[torch.Tensor], idx: int) -> torch.Tensor:
            return torch.nn.functional.mse_loss(self.layer(batch[0]), batch[1])

        def validation_step(self, batch: list[torch.Tensor], idx: int) -> None:
            self.log("val", torch.nn.functional.mse_loss(self.layer(batch[0]), batch[1]))

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=0.1)

    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    data = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)

    def trainer(root: Path) -> pl.Trainer:
        return pl.Trainer(
            strategy="zero3", accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=root,
        )  # fmt: skip

    return Tiny, data, trainer


def _encoded(state: Any) -> str:
    buf = io.BytesIO()
    torch.save(state, buf)
    return base64.b64encode(buf.getvalue()).decode("ascii")


@pytest.mark.timeout(300)
def test_lightning_fit_and_validate_refuse_forged_checkpoints(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lightning_process: None
) -> None:
    from ds_plugin.checkpoint import engine_state

    pwned = tmp_path / "PWNED"
    Tiny, data, trainer = _lightning()
    t = trainer(tmp_path)
    t.fit(Tiny(), data)
    good = tmp_path / "good.ckpt"
    t.save_checkpoint(good)

    # The optimizer's learning rate replaced by a payload, in the shard (the marker written by the save itself).
    real_save = engine_state.save_checkpoint

    def with_payload(path: Any, **kwargs: Any) -> Any:
        kwargs["optimizer_state"]["param_groups"][0]["lr"] = _Touch(pwned)
        return real_save(path, **kwargs)

    monkeypatch.setattr(engine_state, "save_checkpoint", with_payload)
    t.save_checkpoint(tmp_path / "hparam.ckpt")
    monkeypatch.undo()
    lr = _item_bytes(tmp_path / "hparam.ckpt", "optim.param_groups.0.lr")
    _live(lambda: torch.load(io.BytesIO(lr), weights_only=False), pwned)

    forged = {}
    for name in ("metadata", "nested_metadata", "framework_state"):
        ck = forged[name] = tmp_path / f"{name}.ckpt"
        shutil.copytree(good, ck)
        if name == "framework_state":  # the marker is JSON; nothing checks `extra` but the unpickling of this entry
            marker = _marker(ck)
            state = _encoded({"epoch": 0, "callbacks": {"evil": _Touch(pwned)}})
            _live(lambda s=state: torch.load(io.BytesIO(base64.b64decode(s)), weights_only=False), pwned)
            marker["extra"]["framework_state"] = state
            (ck / MARKER).write_text(json.dumps(marker))
        else:
            data_ = _metadata_payload(ck, pwned, nested=name == "nested_metadata")
            _live(lambda d=data_: pickle.loads(d), pwned)
            _forge_metadata(ck, data_)
    forged["hparam"] = tmp_path / "hparam.ckpt"

    for name, ck in forged.items():
        for stage in ("fit", "validate"):
            run = getattr(trainer(tmp_path), stage)
            if name == "hparam" and stage == "validate":  # validate loads no optimizer state: the value is not read
                run(Tiny(), data, ckpt_path=ck)
            else:
                with pytest.raises(CheckpointError) as err:
                    run(Tiny(), data, ckpt_path=ck)
                _one_line(err, "refus" if name != "hparam" else "'optim.param_groups.0.lr' is not plain data")
            assert not pwned.exists(), (name, stage)
