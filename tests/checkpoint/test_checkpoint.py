"""DCP checkpoints: save at 4 ranks, load at 2 and 1; atomic writes; the pickle guard; export to safetensors.

The reference state is the full (unsharded) model and optimizer state gathered at save time; every load
must reproduce it exactly.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from _fsdp_io import load_fsdp

from ds_plugin.checkpoint import MARKER, CheckpointError, load_checkpoint, read_checkpoint_info, save_checkpoint
from ds_plugin.export import export_checkpoint, export_command
from ds_plugin.launch import run_ranks


def _mlp(seed: int, hidden: int = 12) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    # Dims that 2 and 4 do not divide evenly, so shards are padded and resharding is non-trivial.
    return torch.nn.Sequential(
        torch.nn.Linear(8, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 7), torch.nn.ReLU(), torch.nn.Linear(7, 5)
    )


def _shard(model: torch.nn.Module) -> None:
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)


def _full_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> tuple[dict, dict]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    return get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _save_worker(rank: int, n: int, root: str) -> str | None:
    import torch.distributed as dist
    from _fsdp_io import save_fsdp
    from torch.distributed.checkpoint import FileSystemWriter

    model = _mlp(seed=0)
    _shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    save_fsdp(Path(root) / "step2", model, opt, extra={"step": 2, "loss_scaler": {"scale": 65536.0}})
    ref = _full_state(model, opt)
    if rank == 0:
        torch.save(ref, Path(root) / "ref.pt")

    with pytest.raises(CheckpointError, match="already exists"):
        save_fsdp(Path(root) / "step2", model, opt)
    # A rank failing mid-write: every rank gets the error, nothing appears under the final name.
    original = FileSystemWriter.write_data
    if rank == 1:
        FileSystemWriter.write_data = lambda *a, **k: (_ for _ in ()).throw(OSError("disk full (injected)"))
    try:
        with pytest.raises(CheckpointError, match=r"saving .*step3 failed"):
            save_fsdp(Path(root) / "step3", model, opt)
    finally:
        FileSystemWriter.write_data = original
    dist.barrier()
    assert not (Path(root) / "step3").exists()
    # A crash that killed the writer leaves a temporary sibling; the next save of that name removes it.
    if rank == 0:
        (Path(root) / ".step3.partial-crashed").mkdir()
    dist.barrier()
    save_fsdp(Path(root) / "step3", model, opt, extra={"step": 3})
    return sorted(p.name for p in Path(root).iterdir()) if rank == 0 else None


def _load_worker(rank: int, n: int, root: str) -> str:
    model = _mlp(seed=5)  # different initial weights: the load must overwrite all of them
    _shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)
    extra = load_fsdp(Path(root) / "step2", model, opt)
    assert extra["step"] == 2 and extra["loss_scaler"] == {"scale": 65536.0}
    loaded = _full_state(model, opt)
    if rank == 0:
        torch.save(loaded, Path(root) / f"loaded_w{n}.pt")
    other = _mlp(seed=0, hidden=10)  # another model: shape mismatch, reported in one line
    _shard(other)
    with pytest.raises(CheckpointError) as err:
        load_fsdp(Path(root) / "step2", other)
    return str(err.value)


def _assert_state_equal(got: tuple[dict, dict], ref: tuple[dict, dict]) -> None:
    (gm, go), (rm, ro) = got, ref
    assert gm.keys() == rm.keys()
    for k in rm:
        assert torch.equal(gm[k], rm[k]), k
    assert go["state"].keys() == ro["state"].keys()
    for fqn, st in ro["state"].items():
        for name, value in st.items():
            assert torch.equal(go["state"][fqn][name], value), (fqn, name)
    assert go["param_groups"][0]["lr"] == ro["param_groups"][0]["lr"] == 1e-2


@pytest.fixture(scope="module")
def saved_at_4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("ckpt4")
    listing = run_ranks(_save_worker, 4, root=str(root))[0]
    assert listing == ["ref.pt", "step2", "step3"]  # no temporaries left behind
    return root


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_save_w4_load_w2(saved_at_4: Path) -> None:
    info, _ = read_checkpoint_info(saved_at_4 / "step2")
    assert info["world_size"] == 4 and sum(f.endswith(".distcp") for f in info["files"]) == 4
    errors = run_ranks(_load_worker, 2, root=str(saved_at_4))
    ref = torch.load(saved_at_4 / "ref.pt", weights_only=False)
    _assert_state_equal(torch.load(saved_at_4 / "loaded_w2.pt", weights_only=False), ref)
    for msg in errors:
        assert "\n" not in msg and "'model.0.weight' has shape (12, 8)" in msg and "(10, 8)" in msg


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_save_w4_load_w1_without_dist(saved_at_4: Path, tmp_path: Path) -> None:
    import torch.distributed as dist

    assert not dist.is_initialized()
    model = _mlp(seed=5)
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)
    extra = load_fsdp(saved_at_4 / "step2", model, opt)
    assert extra["step"] == 2 and extra["model_class"] == "torch.nn.modules.container.Sequential"
    _assert_state_equal(_full_state(model, opt), torch.load(saved_at_4 / "ref.pt", weights_only=False))
    # A model without a transformers config exports as plain safetensors with the model's own keys.
    from safetensors.torch import load_file

    out = export_checkpoint(saved_at_4 / "step2", tmp_path / "plain")
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
    exported = load_file(out / "model.safetensors")
    ref_model = torch.load(saved_at_4 / "ref.pt", weights_only=False)[0]
    assert exported.keys() == ref_model.keys() and all(torch.equal(exported[k], ref_model[k]) for k in ref_model)
    with pytest.raises(
        CheckpointError, match=r"has an entry the model lacks: 'model\.0\.bias' \(0 missing, 5 unexpected"
    ):
        load_checkpoint(saved_at_4 / "step2", model_state={"0.weight": torch.empty(12, 8)})


class _Evil:
    def __reduce__(self) -> tuple:
        return (os.system, ("touch pwned",))


def _single_process_ckpt(tmp_path: Path) -> Path:
    model = _mlp(seed=0)
    return save_checkpoint(tmp_path / "ck", model_state=model.state_dict(), extra={"step": 1})


def test_pickle_guard(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    ck = _single_process_ckpt(tmp_path)
    state = _mlp(seed=3).state_dict()
    assert load_checkpoint(ck, model_state=state) == {"step": 1}
    assert torch.equal(state["0.weight"], _mlp(seed=0).state_dict()["0.weight"])

    evil = pickle.dumps(_Evil())
    (ck / ".metadata").write_bytes(evil)
    with pytest.raises(CheckpointError, match="does not match the sha256"):
        load_checkpoint(ck, model_state=state)
    # A forger who also rewrites the marker still meets the restricted unpickler.
    marker = json.loads((ck / MARKER).read_text())
    marker["metadata_sha256"] = __import__("hashlib").sha256(evil).hexdigest()
    marker["files"][".metadata"] = len(evil)
    (ck / MARKER).write_text(json.dumps(marker))
    with pytest.raises(CheckpointError, match=r"posix\.system is not allowed|os\.system is not allowed"):
        load_checkpoint(ck, model_state=state)
    assert not (tmp_path / "pwned").exists()

    (ck / MARKER).unlink()
    with pytest.raises(CheckpointError, match="not a ds_plugin checkpoint"):
        load_checkpoint(ck, model_state=state)
    with pytest.raises(CheckpointError, match="not a directory"):
        load_checkpoint(tmp_path / "nope", model_state=state)


def test_truncated_file_and_unsafe_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    ck = _single_process_ckpt(tmp_path)
    shard = next(ck.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match="truncated or corrupted"):
        load_checkpoint(ck, model_state=_mlp(seed=0).state_dict())
    # Non-tensor values are unpickled with weights_only=True: an object is refused, not run.
    ck2 = save_checkpoint(tmp_path / "ck2", model_state={}, optimizer_state={"evil": _Evil()})
    with pytest.raises(CheckpointError, match=r"'optim\.evil' is not plain data"):
        load_checkpoint(ck2, model_state={}, optimizer_state={"evil": None})
    assert not (tmp_path / "pwned").exists()
    with pytest.raises(CheckpointError, match="must be JSON-serialisable"):
        save_checkpoint(tmp_path / "ck3", model_state={}, extra={"t": torch.ones(1)})
    assert not (tmp_path / "ck3").exists()


GPT2 = {"vocab_size": 64, "n_positions": 32, "n_embd": 16, "n_layer": 2, "n_head": 2, "bos_token_id": 0}


def _gpt2_worker(rank: int, n: int, root: str) -> None:
    from _fsdp_io import save_fsdp
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(**GPT2, eos_token_id=0))
    from torch.distributed.fsdp import fully_shard

    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(rank))
    model(ids, labels=ids).loss.backward()
    opt.step()
    save_fsdp(Path(root) / "gpt", model, opt, extra={"step": 1})
    model.eval()
    with torch.no_grad():
        logits = model(torch.arange(16).view(1, 16)).logits
    if rank == 0:
        torch.save(logits, Path(root) / "logits.pt")


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_export_gpt2_to_transformers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import AutoModelForCausalLM

    run_ranks(_gpt2_worker, 2, root=str(tmp_path))
    out = export_checkpoint(tmp_path / "gpt", tmp_path / "hf")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["GPT2LMHeadModel"] and config["n_embd"] == 16
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"], info["missing_keys"]  # a set or a list, by transformers version: empty either way
    assert not info["unexpected_keys"] and not info["mismatched_keys"]
    assert model.lm_head.weight is model.transformer.wte.weight
    with torch.no_grad():
        logits = model(torch.arange(16).view(1, 16)).logits
    assert torch.equal(logits, torch.load(tmp_path / "logits.pt"))

    # Sharded output with an index, cast to bf16, and the CLI entry point.
    assert export_command(str(tmp_path / "gpt"), str(tmp_path / "bf16"), dtype="bf16") == 0
    assert "exported" in capsys.readouterr().out
    sharded = export_checkpoint(tmp_path / "gpt", tmp_path / "sharded", max_shard_size=4096)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    again = AutoModelForCausalLM.from_pretrained(sharded)
    with torch.no_grad():
        assert torch.equal(again(torch.arange(16).view(1, 16)).logits, logits)
    bf16 = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16")
    assert bf16.transformer.wte.weight.dtype == torch.bfloat16

    # Read a few tensors at a time (as a model larger than memory is): the same files' tensors, and the shards
    # back as one file when re-exported into the same directory, the shards and index gone.
    from safetensors.torch import load_file

    import ds_plugin.export as export

    monkeypatch.setattr(export, "READ_BYTES", 2048)
    small = export_checkpoint(tmp_path / "gpt", tmp_path / "sharded", max_shard_size=4096)
    assert json.loads((small / "model.safetensors.index.json").read_text()) == index
    for name in set(index["weight_map"].values()):
        assert load_file(small / name).keys() == {k for k, v in index["weight_map"].items() if v == name}
    whole = load_file(out / "model.safetensors")
    assert all(
        torch.equal(t, whole[k])
        for name in set(index["weight_map"].values())
        for k, t in load_file(small / name).items()
    )
    export_checkpoint(tmp_path / "gpt", small)
    assert sorted(p.name for p in small.iterdir()) == ["config.json", "model.safetensors"]
    assert load_file(small / "model.safetensors").keys() == whole.keys()


def test_export_command_bad_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert export_command(str(tmp_path / "missing"), str(tmp_path / "out")) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1
    shutil.rmtree(tmp_path / "out", ignore_errors=True)
    assert export_command(str(tmp_path), str(tmp_path / "out"), dtype="int3") == 2


def test_optimizer_hyperparameter_added_by_newer_torch(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    ck = save_checkpoint(tmp_path / "ck", model_state={}, optimizer_state={"param_groups": [{"lr": 0.1}]})
    optim_state = {"param_groups": [{"lr": 0.5, "new_knob": True}]}
    load_checkpoint(ck, model_state={}, optimizer_state=optim_state)
    assert optim_state == {"param_groups": [{"lr": 0.1, "new_knob": True}]}
    assert "optim.param_groups.0.new_knob" in caplog.text


def test_overwrite_swaps_in_the_new_checkpoint(tmp_path: Path) -> None:
    first = {"w": torch.zeros(3)}
    save_checkpoint(tmp_path / "ck", model_state=first, extra={"step": 1})
    save_checkpoint(tmp_path / "ck", model_state={"w": torch.ones(3)}, extra={"step": 2}, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]  # no temporary or old copy left
    assert load_checkpoint(tmp_path / "ck", model_state=first) == {"step": 2}
    assert torch.equal(first["w"], torch.ones(3))
