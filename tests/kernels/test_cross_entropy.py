"""The chunked causal-LM loss against transformers' own: same loss and gradients, no fp32 copy of the logits.

Single process; chunks are made a few rows small so every case crosses chunk boundaries, with a last chunk shorter
than the rest; on a CUDA GPU (the gpu tier) the same comparison at the accelerator's chunk size, with its peak
memory. The engine's swap (config `chunked_loss`) is checked in tests/zero/test_model_setup.py, training
parity with DDP's stock loss in tests/zero/test_engine_parity.py.
"""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from ds_plugin.kernels import cross_entropy
from ds_plugin.kernels.cross_entropy import causal_lm_loss, chunk_rows, use_chunked_loss

transformers = pytest.importorskip("transformers")
from transformers.loss.loss_utils import ForCausalLMLoss  # noqa: E402

VOCAB = 1000
ROWS = 7  # rows per chunk in these tests: 2 x 40 tokens cross many chunks and end in a short one


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cross_entropy, "_CPU_CHUNK_BYTES", ROWS * 4 * VOCAB)
    assert chunk_rows(VOCAB, torch.device("cpu")) == ROWS


def _logits(dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(2, 40, VOCAB, generator=g) * 4).to(dtype)


def _labels() -> torch.Tensor:
    labels = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))
    labels[0, :9] = -100  # a prompt that carries no loss
    labels[1, 17] = -100
    return labels


def _loss_and_grad(fn, logits: torch.Tensor, labels: torch.Tensor, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    x = logits.clone().requires_grad_()
    loss = fn(x, labels, VOCAB, **kwargs)
    (loss * 3).backward()  # a gradient other than 1 reaches the kernel
    return loss.detach(), x.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", ["mean", "num_items_tensor", "num_items_int", "shift_labels"])
def test_same_loss_and_gradient_as_transformers(small_chunks, dtype, case):
    logits, labels = _logits(dtype), _labels()
    kwargs = {
        "mean": {},
        "num_items_tensor": {"num_items_in_batch": torch.tensor(123)},
        "num_items_int": {"num_items_in_batch": 123},
        "shift_labels": {"shift_labels": labels.flip(1)},
    }[case]
    want_loss, want_grad = _loss_and_grad(ForCausalLMLoss, logits, labels, **kwargs)
    got_loss, got_grad = _loss_and_grad(causal_lm_loss, logits, labels, **kwargs)
    assert got_loss.dtype == torch.float32 and got_grad.dtype == dtype
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-6, atol=0)
    # fp32 softmax rounded once to the logits' dtype on both sides: equal up to fp32 rounding before that.
    tol = {torch.float32: 1e-7, torch.bfloat16: 1e-2, torch.float16: 1e-3}[dtype]
    torch.testing.assert_close(got_grad.float(), want_grad.float(), rtol=tol, atol=1e-7)
    # Ignored positions get no gradient: the last token of each row (nothing to predict) and the masked ones.
    if case != "shift_labels":
        assert got_grad[0, :8].abs().sum() == 0 and got_grad[:, -1].abs().sum() == 0
        assert got_grad[1, 16].abs().sum() == 0 and got_grad[1, 17].abs().sum() > 0


def test_every_label_ignored_gives_nan_like_transformers(small_chunks):
    logits, labels = _logits(torch.float32), torch.full((2, 40), -100)
    assert torch.isnan(ForCausalLMLoss(logits, labels, VOCAB)) and torch.isnan(causal_lm_loss(logits, labels, VOCAB))


def _largest_allocation(fn, logits: torch.Tensor, labels: torch.Tensor) -> int:
    x = logits.clone().requires_grad_()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn(x, labels, VOCAB).backward()
    return max(e.cpu_memory_usage for e in prof.events())


def test_no_allocation_the_size_of_fp32_logits(small_chunks):
    logits, labels = _logits(torch.bfloat16), _labels()
    fp32_logits = logits.numel() * 4
    assert _largest_allocation(ForCausalLMLoss, logits, labels) >= fp32_logits  # the measurement sees them
    # Largest: the bf16 gradient (half the fp32 size); each chunk's fp32 rows are far smaller.
    assert _largest_allocation(causal_lm_loss, logits, labels) <= logits.numel() * 2


def test_chunk_rows_fit_the_budget():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert chunk_rows(50_257, cpu) == 10 and chunk_rows(128_256, cpu) == 4 and chunk_rows(10**9, cpu) == 1
    assert chunk_rows(128_256, cuda) == 130 and chunk_rows(0, cpu) >= 1


def test_use_chunked_loss_switches_stock_causal_lms_only(monkeypatch):
    import transformers.modeling_utils as hf_modeling
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    warned = []  # transformers warns when a loss is read from a module it knows no loss type for (a backbone)
    monkeypatch.setattr(hf_modeling.logger, "warning_once", lambda msg, *a, **k: warned.append(str(msg)))
    cfg = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=40, bos_token_id=0, eos_token_id=0)
    cfg.resid_pdrop = cfg.embd_pdrop = cfg.attn_pdrop = 0.0  # the two models compute the same function
    torch.manual_seed(0)
    stock, chunked = GPT2LMHeadModel(cfg), GPT2LMHeadModel(cfg)
    chunked.load_state_dict(stock.state_dict())
    # The head (GPT-2's class name maps to no loss type: the stock loss by fallback), not its backbone.
    assert use_chunked_loss(chunked) == 1 and chunked.loss_function is causal_lm_loss
    assert "_loss_function" not in vars(chunked.transformer)
    shape = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    shape.update(num_key_value_heads=2, bos_token_id=0, eos_token_id=0)
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, **shape))
    assert use_chunked_loss(llama) == 1 and llama.loss_function is causal_lm_loss
    assert "_loss_function" not in vars(llama.model)
    assert not [m for m in warned if "loss_type" in m], warned
    labels = _labels()
    losses = [m(input_ids=labels.clamp(min=0), labels=labels).loss for m in (stock, chunked)]
    for loss in losses:
        loss.backward()
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=0)
    for (name, a), b in zip(stock.named_parameters(), chunked.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-7, msg=name)
    # A loss its owner chose stays; a module that is not from transformers has none to switch.
    mine = GPT2LMHeadModel(cfg)
    custom = lambda *args, **kwargs: torch.zeros(())  # noqa: E731
    mine.loss_function = custom
    mine.transformer.loss_function = custom
    assert use_chunked_loss(mine) == 0 and mine.loss_function is custom
    assert use_chunked_loss(torch.nn.Linear(2, 2)) == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_same_numbers_and_less_peak_memory(monkeypatch):
    # Several chunks at the accelerator's budget: 4,096 tokens of a 32,000-word vocabulary, bf16 logits (250 MiB).
    monkeypatch.setattr(cross_entropy, "_ACCELERATOR_CHUNK_BYTES", 64 << 20)
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(1, 4096, 32_000, generator=g, device="cuda") * 4).bfloat16()
    labels = torch.randint(0, 32_000, (1, 4096), generator=g, device="cuda")
    labels[0, :100] = -100
    peaks, results = [], []
    for fn in (ForCausalLMLoss, causal_lm_loss):
        x = logits.clone().requires_grad_()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        loss = fn(x, labels, 32_000)
        loss.backward()
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - base)
        results.append((loss.detach(), x.grad))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-5, atol=0)
    torch.testing.assert_close(results[1][1].float(), results[0][1].float(), rtol=1e-2, atol=1e-7)
    fp32_logits = logits.numel() * 4
    assert peaks[1] < peaks[0] - 2 * fp32_logits, [p / 2**20 for p in peaks]


def test_torch_compile_leaves_the_chunk_loop_out_of_the_graph(small_chunks):
    # Traced, the loop would be unrolled once per chunk (minutes of compiling at a few thousand tokens).
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()
    logits, labels = _logits(torch.float32), _labels()
    compiled = torch.compile(lambda x, y: causal_lm_loss(x, y, VOCAB) * 2, backend=counter, fullgraph=False)
    torch.testing.assert_close(compiled(logits, labels), causal_lm_loss(logits, labels, VOCAB) * 2)
    assert counter.op_count <= 2, counter.op_count  # the `* 2` after the graph break; no log_softmax per chunk
