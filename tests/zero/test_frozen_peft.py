"""peft prompt learning on a quantized frozen base under ZeRO-3: P-Tuning v1 and prefix tuning (P-Tuning v2).

Both runs train in one spawn of 2 gloo ranks, each saving its adapter with `save_adapter`; the test process reloads
each onto a fresh base, stores that base in the same format, and must reproduce the trained model's logits. The same
spawn checks that a 16-bit cast of the whole model leaves the quantized base's components alone, and that a checkpoint
saved without the frozen base (`exclude_frozen_parameters`) resumes exactly into a new engine built on the same base.
"""

from __future__ import annotations

import itertools
import traceback
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from ds_plugin.launch import run_ranks
from tests.zero._tiny import VOCAB, llama, quiet

pytestmark = pytest.mark.slow

peft = pytest.importorskip("peft")

SEQ, PER_RANK, STEPS = 16, 2, 6


def _base():
    return llama(seed=0)


def _peft_config(kind: str):
    if kind == "ptuning":
        return peft.PromptEncoderConfig(task_type="CAUSAL_LM", num_virtual_tokens=4, encoder_hidden_size=32)
    return peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)


def _probe() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(99))


def _train(rank: int, world: int, kind: str, fmt: str, out_dir: str) -> dict:
    torch.set_num_threads(1)
    quiet()
    warnings.simplefilter("ignore")
    from ds_plugin import initialize, save_adapter

    torch.manual_seed(1)
    model = peft.get_peft_model(_base(), _peft_config(kind))
    cfg = {"zero_optimization": {"stage": 3, "frozen_format": fmt}, "gradient_clipping": 0.0}
    engine = initialize(model, cfg, optimizer=lambda ps: torch.optim.AdamW(ps, lr=3e-2))
    g = torch.Generator().manual_seed(7)
    data = torch.randint(0, VOCAB, (world * PER_RANK, SEQ), generator=g)  # one batch, learned by heart
    x = data[rank * PER_RANK : (rank + 1) * PER_RANK]
    losses = []
    for _ in range(STEPS):
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    save_adapter(engine, out_dir)
    with torch.no_grad():
        logits = engine(input_ids=_probe()).logits.detach().clone()
    # A whole-model save cast to 16 bits (save_16bit_model, stage3_gather_16bit_weights_on_model_save), as an fp16
    # run asks for it: the model's weights in fp16, the stored components of the quantized base (codes, bf16
    # scales, ...) as they are.
    from ds_plugin.peft_adapters import full_state_dict

    plain, cast = full_state_dict(engine), full_state_dict(engine, dtype=torch.float16)
    dtypes = {k: (str(v.dtype), str(cast[k].dtype)) for k, v in plain.items()}
    same = all(torch.equal(v.to(cast[k].dtype), cast[k]) for k, v in plain.items())
    result = {"losses": losses, "logits": logits, "dtypes": dtypes, "cast_is_rounding": same}

    # A checkpoint without the frozen base (DeepSpeed's exclude_frozen_parameters), loaded into a new engine built from
    # the same base with another prompt initialisation: the trained logits, and the same next step as the original.
    ckpt = Path(out_dir).parent / f"{kind}_checkpoints"
    engine.save_checkpoint(ckpt, tag="adapter_only", exclude_frozen_parameters=True)
    torch.manual_seed(2)
    resumed = initialize(peft.get_peft_model(_base(), _peft_config(kind)), cfg,
                         optimizer=lambda ps: torch.optim.AdamW(ps, lr=3e-2))  # fmt: skip
    resumed.load_checkpoint(ckpt)
    with torch.no_grad():
        result["resumed_logits"] = resumed(input_ids=_probe()).logits.detach().clone()
    for e in (engine, resumed):
        loss = e(input_ids=x, labels=x).loss
        e.backward(loss)
        e.step()
        result.setdefault("next_losses", []).append(loss.item())
    # A model that trains a weight the checkpoint left out cannot take it: one line, before anything loads.
    other = peft.get_peft_model(_base(), _peft_config(kind))
    other.base_model.model.norm.weight.requires_grad_(True)
    other = initialize(other, cfg, optimizer=lambda ps: torch.optim.AdamW(ps, lr=3e-2))
    try:
        other.load_checkpoint(ckpt)
    except Exception as e:  # reported to the test
        result["refusal"] = f"{type(e).__name__}: {e}"
    result["checkpoint"] = str(ckpt / "adapter_only")
    return result


def _reload(kind: str, fmt: str, path: str) -> torch.Tensor:
    from ds_plugin import quantize_frozen_

    model = peft.PeftModel.from_pretrained(_base(), path)
    quantize_frozen_(model, fmt)
    with torch.no_grad():
        return model(input_ids=_probe()).logits


CASES = [("ptuning", "int4"), ("prefix", "nf4")]


def _all_cases(rank: int, world: int, workdir: str) -> dict[tuple, tuple[str, Any]]:
    import _break  # a fresh (spawned) process: DS_PLUGIN_TEST_NOOP_STEP must be applied here too

    _break.install()
    out = {}
    for kind, fmt in CASES:
        try:
            out[kind, fmt] = ("ok", _train(rank, world, kind, fmt, str(Path(workdir) / kind)))
        except Exception:  # reported by the case's own test
            out[kind, fmt] = ("error", traceback.format_exc())
    return out


@pytest.fixture(scope="module")
def spawned(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    workdir = tmp_path_factory.mktemp("adapters")
    return workdir, run_ranks(_all_cases, 2, timeout=500, workdir=str(workdir))


# LoRA (with modules_to_save) is saved and reloaded the same way in test_frozen_zero.py, at 2 and 4 ranks.
@pytest.mark.parametrize(("kind", "fmt"), CASES)
def test_adapter_trained_at_zero3_on_a_quantized_base_reloads_exactly(spawned, kind, fmt):
    quiet()
    workdir, by_rank = spawned
    path = str(workdir / kind)
    for rank, r in enumerate(by_rank):
        if r[kind, fmt][0] == "error":
            pytest.fail(f"rank {rank}, case {kind} {fmt}:\n{r[kind, fmt][1]}", pytrace=False)
    results = [r[kind, fmt][1] for r in by_rank]
    for r in results:
        # It learns the one batch: slowly in 6 steps, but every step lowers the loss (a no-op optimizer would
        # repeat the first loss).
        losses = r["losses"]
        assert all(b < a for a, b in itertools.pairwise(losses)) and losses[-1] < 0.995 * losses[0], losses
    # The saved tensors are whole: every entry has the unsharded model's shape, none is empty.
    from safetensors.torch import load_file

    saved = load_file(f"{path}/adapter_model.safetensors")
    fresh = peft.get_peft_model(_base(), _peft_config(kind))
    expected = peft.get_peft_model_state_dict(fresh)
    assert set(saved) == set(expected) and saved
    for k, v in saved.items():
        assert v.shape == expected[k].shape and v.numel() > 0, k
    # A fresh base + the adapter + the same storage format reproduces what the trained model computes.
    got = _reload(kind, fmt, path)
    torch.testing.assert_close(got, results[0]["logits"], rtol=0, atol=1e-5)
    untrained = peft.get_peft_model(_base(), _peft_config(kind))
    with torch.no_grad():
        before = untrained(input_ids=_probe()).logits
    assert not torch.allclose(before, got, atol=1e-3)  # the adapter changed the model
    # Cast to fp16 on gathering: every weight (the adapter's, the base's norms and embeddings) becomes fp16, the
    # rounded fp32 value; the quantized base's components keep their dtypes (fp16 scales would be other weights).
    dtypes = results[0]["dtypes"]
    components = {k: d for k, d in dtypes.items() if ".weight." in k}  # <linear>.weight.codes, .scales, ...
    assert components and all(before_ == after for before_, after in components.values()), components
    # Float components among them (int4's bf16 scales, nf4's fp32 absmax offsets), left alone.
    assert any(d[0] in ("torch.bfloat16", "torch.float32") for d in components.values()), components
    weights = {k: d for k, d in dtypes.items() if k not in components}
    assert weights and all(d == ("torch.float32", "torch.float16") for d in weights.values()), weights
    assert results[0]["cast_is_rounding"]

    # exclude_frozen_parameters: only the trained weights are in the checkpoint, and it resumes exactly.
    from torch.distributed.checkpoint import FileSystemReader

    from ds_plugin.checkpoint import CheckpointError, read_checkpoint_info
    from ds_plugin.export import export_checkpoint

    ckpt = results[0]["checkpoint"]
    stored = [k for k in FileSystemReader(ckpt).read_metadata().state_dict_metadata if k.startswith("model.")]
    excluded = read_checkpoint_info(Path(ckpt))[0]["extra"]["frozen_excluded"]
    trainable = [name for name, p in fresh.named_parameters() if p.requires_grad]
    assert len(stored) == len(trainable) and excluded  # the prompt's weights; the base (every component) left out
    assert any(k.endswith(".codes") for k in excluded) and not {f"model.{k}" for k in excluded} & set(stored)
    for r in results:
        torch.testing.assert_close(r["resumed_logits"], r["logits"], rtol=0, atol=0)
        assert r["next_losses"][0] == r["next_losses"][1]  # optimizer state and counters came back too
        assert r["refusal"].startswith("CheckpointError: ") and "was saved without its frozen weights" in r["refusal"]
        assert "\n" not in r["refusal"]
    with pytest.raises(CheckpointError, match=r"saved without its \d+ frozen weights"):
        export_checkpoint(ckpt, str(workdir / "export"))
