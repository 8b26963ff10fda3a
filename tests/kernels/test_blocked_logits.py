"""The output layer in column blocks against `F.linear`: the same logits and gradients.

Single process. Blocks are made 256 columns narrow so every case crosses block boundaries and ends in a short
block. With the first-call choice pinned to blocks the numbers match `F.linear`'s to float rounding (bit for bit
with this machine's kernels, which is not asserted: it is the BLAS's property); left to choose, they are always
`F.linear`'s bit for bit, since blocks are kept only when they gave the same bits. The
engine's swap (config `blocked_logits`) is checked in tests/zero/test_model_setup.py, training parity with DDP in
tests/zero/test_engine_parity.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ds_plugin.kernels import blocked_logits
from ds_plugin.kernels.blocked_logits import BlockedLogitsLinear, blocked_linear, use_blocked_logits

BLOCK = 256
COLUMNS = BLOCK * 4 + 37  # four whole blocks and a short one


@pytest.fixture
def narrow_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(blocked_logits, "BLOCK_COLUMNS", BLOCK)
    monkeypatch.setattr(blocked_logits, "MIN_COLUMNS", 2 * BLOCK)
    monkeypatch.setattr(blocked_logits, "_FASTER_IN_BLOCKS", {})


def _pin(monkeypatch: pytest.MonkeyPatch, blocks: bool) -> list[tuple]:
    asked: list[tuple] = []

    def decide(key: tuple, whole: object, in_blocks: object) -> bool:
        asked.append(key)
        return blocks

    monkeypatch.setattr(blocked_logits, "_faster_in_blocks", decide)
    return asked


def _inputs(dtype: torch.dtype, bias: bool, rows: int = 70) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, rows // 2, 24, generator=g).to(dtype)
    w = torch.randn(COLUMNS, 24, generator=g).to(dtype)
    b = torch.randn(COLUMNS, generator=g).to(dtype) if bias else None
    grad = torch.randn(2, rows // 2, COLUMNS, generator=g).to(dtype)
    return x, w, b, grad


def _forward_backward(fn, x, w, b, grad) -> list[torch.Tensor]:
    leaves = [t.detach().clone().requires_grad_() for t in (x, w, b) if t is not None]
    out = fn(*leaves)
    out.backward(grad)
    return [out.detach(), *(t.grad for t in leaves)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_blocks_give_f_linears_numbers(narrow_blocks, monkeypatch, dtype, bias):
    x, w, b, grad = _inputs(dtype, bias)
    want = _forward_backward(F.linear, x, w, b, grad)
    for blocks in (True, False):
        asked = _pin(monkeypatch, blocks)
        got = _forward_backward(blocked_linear, x, w, b, grad)
        # Both passes asked once: the logits at forward, the weight's gradient at backward.
        assert [key[0] for key in asked] == ["forward", "weight_grad"], asked
        names = ("logits", "x grad", "weight grad", "bias grad")[: len(got)]
        for name, mine, theirs in zip(names, got, want, strict=True):
            assert mine.dtype == theirs.dtype and mine.shape == theirs.shape, name
            torch.testing.assert_close(mine, theirs, msg=f"{name}, blocks {blocks}")


def test_measured_choice_is_kept_per_shape_and_few_rows_take_one_matmul(narrow_blocks):
    x, w, _, grad = _inputs(torch.float32, False)
    want = _forward_backward(F.linear, x, w, None, grad)
    got = _forward_backward(blocked_linear, x, w, None, grad)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    keys = set(blocked_logits._FASTER_IN_BLOCKS)
    assert {key[0] for key in keys} == {"forward", "weight_grad"}
    assert all(key[2:4] == (24, COLUMNS) for key in keys), keys
    # The same shape again is not measured again; a different width is.
    _forward_backward(blocked_linear, x, w, None, grad)
    assert set(blocked_logits._FASTER_IN_BLOCKS) == keys
    few = _inputs(torch.float32, False, rows=10)  # under 64 rows: one matmul, nothing measured
    blocked_logits._FASTER_IN_BLOCKS.clear()
    got, want = _forward_backward(blocked_linear, *few), _forward_backward(F.linear, *few)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)) and blocked_logits._FASTER_IN_BLOCKS == {}


def test_blocks_that_change_a_bit_are_never_kept(narrow_blocks, monkeypatch):
    # Blocks made faster but one ulp off in one logit: the first call must keep F.linear, whatever the timing.
    honest = blocked_logits._logits_in_blocks

    def off_by_an_ulp(x, weight, bias):
        out = honest(x, weight, bias)
        out[0, -1] = torch.nextafter(out[0, -1], torch.tensor(float("inf")))
        return out

    monkeypatch.setattr(blocked_logits, "_logits_in_blocks", off_by_an_ulp)
    monkeypatch.setattr(blocked_logits, "_GAIN", float("inf"))  # blocks always count as faster
    x, w, _, grad = _inputs(torch.float32, False)
    got, want = _forward_backward(blocked_linear, x, w, None, grad), _forward_backward(F.linear, x, w, None, grad)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    decided = {key[0]: v for key, v in blocked_logits._FASTER_IN_BLOCKS.items()}
    assert decided["forward"] is False, decided


def test_falls_back_to_f_linear_under_autocast_and_without_grad(narrow_blocks, monkeypatch):
    asked = _pin(monkeypatch, True)
    x, w, _, _ = _inputs(torch.float32, False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = blocked_linear(x, w)
    assert out.dtype == torch.bfloat16 and asked == []  # autocast's cast, not blocks
    with torch.no_grad():
        assert torch.equal(blocked_linear(x, w), F.linear(x, w))
    assert [key[0] for key in asked] == ["forward"]


def test_use_blocked_logits_switches_wide_plain_output_layers_only(narrow_blocks, monkeypatch):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        vocab_size=COLUMNS, n_embd=24, n_layer=1, n_head=2, n_positions=40, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0
    )
    torch.manual_seed(0)
    stock = transformers.GPT2LMHeadModel(config)
    mine = transformers.GPT2LMHeadModel(config)
    mine.load_state_dict(stock.state_dict())
    keys = list(mine.state_dict())
    assert use_blocked_logits(torch.nn.ModuleDict({"wrapped": mine})) == 1
    head = mine.get_output_embeddings()
    assert type(head) is BlockedLogitsLinear and head.weight is mine.transformer.wte.weight  # still tied
    assert list(mine.state_dict()) == keys
    asked = _pin(monkeypatch, True)
    ids = torch.randint(0, COLUMNS, (2, 35), generator=torch.Generator().manual_seed(3))
    losses = []
    for model in (stock, mine):
        loss = model(ids, labels=ids).loss
        loss.backward()
        losses.append((loss.detach(), model.transformer.wte.weight.grad, model.transformer.h[0].mlp.c_fc.weight.grad))
    assert [key[0] for key in asked] == ["forward", "weight_grad"]
    for mine, theirs in zip(*losses, strict=True):
        torch.testing.assert_close(mine, theirs)
    # Narrower than MIN_COLUMNS, or not exactly nn.Linear: left as it is.
    narrow = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=60, n_embd=24, n_layer=1, n_head=2))
    assert use_blocked_logits(narrow) == 0 and type(narrow.lm_head) is torch.nn.Linear

    class MyHead(torch.nn.Linear):
        pass

    custom = transformers.GPT2LMHeadModel(config)
    custom.lm_head.__class__ = MyHead
    assert use_blocked_logits(custom) == 0 and use_blocked_logits(torch.nn.Linear(2, 200)) == 0
