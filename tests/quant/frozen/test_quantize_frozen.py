"""Frozen Linear weights stored as INT8 / INT4 / NF4 / FP6 (`quantize_frozen_`, `QuantizedWeight`), in one process."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from ds_plugin import quantize_frozen_
from ds_plugin.quant.frozen.codecs import dequantize_weight, quantize_weight
from ds_plugin.quant.frozen.quantize import quantized_weights
from ds_plugin.quant.frozen.tensor import QuantizedWeight

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

VOCAB = 160  # no logit or activation shape equals a weight shape (see the saved-tensor test)
QKVO = ["q_proj", "k_proj", "v_proj", "o_proj"]


def _llama(hidden: int = 64, seed: int = 0) -> nn.Module:
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg)


def _glm(hidden: int = 64, seed: int = 0) -> nn.Module:
    cfg = transformers.GlmConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        max_position_embeddings=64,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    return transformers.GlmForCausalLM(cfg)


def _lora(model: nn.Module, targets: list[str] = QKVO, **kw) -> nn.Module:
    warnings.simplefilter("ignore")
    cfg = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=targets, **kw)
    return peft.get_peft_model(model, cfg)


def _tokens(seed: int = 1, batch: int = 2, seq: int = 16) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _fake_quantized(model: nn.Module, fmt: str) -> nn.Module:
    """The reference: a copy whose chosen weights are plain tensors holding the dequantized values."""
    ref = copy.deepcopy(model)
    for name, q in quantized_weights(model).items():
        module_name, _, attr = name.rpartition(".")
        module = ref.get_submodule(module_name)
        setattr(module, attr, nn.Parameter(q.dequantize(), requires_grad=False))
    return ref


@pytest.mark.parametrize("fmt", ["int8", "int4", "nf4", "fp6"])
def test_lora_base_is_quantized_adapters_and_head_are_not(fmt):
    model = _lora(_llama())
    quantize_frozen_(model, fmt)
    names = set(quantized_weights(model))
    # Every frozen Linear of the decoder: q/k/v/o base layers and the MLP, 2 layers x 7; never the head.
    assert len(names) == 14, sorted(names)
    assert all("lora_" not in n and "lm_head" not in n for n in names)
    assert any(n.endswith("q_proj.base_layer.weight") for n in names)
    assert not isinstance(model.get_output_embeddings().weight, QuantizedWeight)
    for n, p in model.named_parameters():
        if p.requires_grad:
            assert "lora_" in n and not isinstance(p, QuantizedWeight)
        if isinstance(p, QuantizedWeight):
            assert all(t.dtype in (torch.uint8, torch.float32, torch.bfloat16, torch.float16) for t in p.parts.values())
            assert any(t.dtype == torch.uint8 for t in p.parts.values())


@pytest.mark.parametrize("fmt", ["int8", "int4", "nf4", "fp6"])
def test_forward_and_input_gradient_equal_the_dequantized_reference(fmt):
    torch.manual_seed(0)
    model = _lora(_llama())
    for n, p in model.named_parameters():  # non-zero LoRA B so the adapters take part in the output
        if "lora_B" in n:
            nn.init.normal_(p, std=0.02)
    quantize_frozen_(model, fmt)
    ref = _fake_quantized(model, fmt)
    x = _tokens()
    out = model(input_ids=x, labels=x)
    ref_out = ref(input_ids=x, labels=x)
    assert torch.equal(out.logits, ref_out.logits)
    out.loss.backward()
    ref_out.loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    assert set(grads) == set(ref_grads) and grads
    assert all("lora_" in n for n in grads)  # gradients reach only the adapters
    for n, g in grads.items():
        torch.testing.assert_close(g, ref_grads[n], rtol=1e-5, atol=1e-7)


def test_lora_on_an_fp6_base_trains_through_the_op(monkeypatch):
    from ds_plugin.quant.frozen import tensor as frozen_tensor

    calls = {"forward": 0, "backward": 0}
    real_forward, real_backward = frozen_tensor.quantized_linear, frozen_tensor.quantized_linear_grad_input

    def forward(*args):
        calls["forward"] += 1
        return real_forward(*args)

    def backward(*args):
        calls["backward"] += 1
        return real_backward(*args)

    monkeypatch.setattr(frozen_tensor, "quantized_linear", forward)
    monkeypatch.setattr(frozen_tensor, "quantized_linear_grad_input", backward)
    torch.manual_seed(0)
    model = _lora(_llama())
    quantize_frozen_(model, "fp6")
    codes = {n: q.parts["codes"].clone() for n, q in quantized_weights(model).items()}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    x = _tokens(batch=4)
    losses = []
    for _ in range(6):
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.1, losses
    # 14 frozen layers per step; backward reaches the 8 q/k/v/o bases' inputs and the MLPs'.
    assert calls["forward"] == 6 * 14 and calls["backward"] >= 6 * 8
    assert all(torch.equal(q.parts["codes"], codes[n]) for n, q in quantized_weights(model).items())


def test_no_full_precision_copy_of_a_quantized_weight_is_saved_for_backward():
    model = _lora(_llama())
    quantize_frozen_(model, "int4")
    shapes = {tuple(q.shape) for q in quantized_weights(model).values()}
    saved: list[tuple[tuple[int, ...], torch.dtype]] = []

    def pack(t: torch.Tensor):
        saved.append((tuple(t.shape), t.dtype))
        return t

    x = _tokens(batch=3, seq=7)  # 21 tokens: no activation shares a weight's shape
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=x, labels=x).loss
    loss.backward()
    # Control: the same model run on plain weights saves each weight (or its transpose) for backward.
    assert saved
    weights_saved = [s for s, dt in saved if dt.is_floating_point and (s in shapes or s[::-1] in shapes)]
    assert not weights_saved, weights_saved
    plain = _fake_quantized(model, "int4")
    plain_saved: list[tuple[int, ...]] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: plain_saved.append(tuple(t.shape)) or t, lambda t: t):
        plain(input_ids=x, labels=x).loss.backward()
    assert any(s in shapes or s[::-1] in shapes for s in plain_saved)


def test_default_keeps_a_head_tied_to_the_embedding():
    model = _llama()
    model.config.tie_word_embeddings = True
    model.lm_head.weight = model.model.embed_tokens.weight
    model.requires_grad_(False)
    quantize_frozen_(model, "int8")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert not isinstance(model.lm_head.weight, QuantizedWeight)
    # filter_fn overrides the default: the head too when asked.
    other = _llama()
    other.requires_grad_(False)
    quantize_frozen_(other, "int8", filter_fn=lambda m, name: True)
    assert isinstance(other.lm_head.weight, QuantizedWeight)


def test_default_keeps_a_reward_models_score_head():
    # A reward model (transformers' ...ForSequenceClassification on a decoder): its `score` head is the output
    # head, kept in full precision, frozen (the reward model) or kept frozen under peft's modules_to_save (a critic).
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, num_labels=1)  # fmt: skip
    torch.manual_seed(0)
    reward = transformers.LlamaForSequenceClassification(cfg).requires_grad_(False)
    quantize_frozen_(reward, "int8")
    assert len(quantized_weights(reward)) == 14 and not isinstance(reward.score.weight, QuantizedWeight)
    critic = peft.get_peft_model(transformers.LlamaForSequenceClassification(cfg),
                                 peft.LoraConfig(r=4, target_modules=QKVO, modules_to_save=["score"]))  # fmt: skip
    quantize_frozen_(critic, "int8")
    names = set(quantized_weights(critic))
    assert len(names) == 14 and not any("score" in n for n in names), sorted(names)


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize(
    ("fmt", "kwargs", "match"),
    [
        ("fp6", {"group_size": 24}, "multiple of 16"),
        ("int3", {}, "not one of"),
        ("int8", {"filter_fn": lambda m, name: True}, "trainable"),
        ("int4", {"group_size": 48}, "group"),
    ],
)
def test_bad_requests_fail_in_one_line_and_convert_nothing(fmt, kwargs, match):
    model = _lora(_llama())
    before = _state(model)
    with pytest.raises(ValueError, match=match) as info:
        quantize_frozen_(model, fmt, **kwargs)
    assert "\n" not in str(info.value)
    assert not quantized_weights(model)
    after = _state(model)
    assert all(torch.equal(before[n], after[n]) for n in before)


def test_peft_merge_requantizes_and_reports_its_error():
    torch.manual_seed(0)
    model = _lora(_llama())
    for n, p in model.named_parameters():
        if "lora_B" in n:
            nn.init.normal_(p, std=0.05)
    quantize_frozen_(model, "int8")
    x = _tokens()
    with torch.no_grad():
        unmerged = model(input_ids=x).logits
    # merge then unmerge: two requantizations, back within INT8 rounding of the original codes' values.
    base = model.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight
    original = base.dequantize()
    model.merge_adapter()
    model.unmerge_adapter()
    back = (base.dequantize() - original).norm() / original.norm()
    assert 0 < back < 0.02 and base.last_requantization_error is not None
    merged = model.merge_and_unload()
    q = merged.model.layers[0].self_attn.q_proj.weight
    assert isinstance(q, QuantizedWeight)
    assert q.last_requantization_error is not None and 0 < q.last_requantization_error < 0.02
    with torch.no_grad():
        out = merged(input_ids=x).logits
    rel = (out - unmerged).norm() / unmerged.norm()
    assert 0 < rel < 0.02  # one more INT8 rounding of W + BA, nothing lost


def test_load_state_dict_of_a_full_precision_model_requantizes():
    base = _llama()
    base.requires_grad_(False)
    quantized = copy.deepcopy(base)
    quantize_frozen_(quantized, "int8")
    trained = _llama(seed=5)  # different weights, same shapes
    quantized.load_state_dict(trained.state_dict())
    w = quantized.model.layers[1].mlp.up_proj.weight
    assert isinstance(w, QuantizedWeight)
    ref = trained.model.layers[1].mlp.up_proj.weight
    expected = dequantize_weight(quantize_weight(ref.detach(), "int8", w.group_size), "int8", w.group_size, ref.dtype)
    assert torch.equal(w.dequantize(), expected)


@pytest.mark.parametrize(("build", "name"), [(_llama, "llama"), (_glm, "glm")])
@pytest.mark.parametrize(("fmt", "limit"), [("int8", 0.025), ("int4", 0.28), ("nf4", 0.28), ("fp6", 0.15)])
def test_logit_error_against_the_bf16_model(build, name, fmt, limit):
    model = _lora(build(hidden=128)).to(torch.bfloat16)
    for n, p in model.named_parameters():
        if "lora_B" in n:
            nn.init.normal_(p, std=0.02)
    x = _tokens(batch=4, seq=32)
    with torch.no_grad():
        ref = model(input_ids=x).logits.float()
        quantize_frozen_(model, fmt)
        got = model(input_ids=x).logits.float()
    rel = float((got - ref).norm() / ref.norm())
    assert 0 < rel <= limit, (name, fmt, rel)


def test_a_width_the_default_group_does_not_divide_gets_a_finer_group():
    model = nn.Sequential(nn.Linear(96, 8), nn.Linear(8, 4)).requires_grad_(False)
    quantize_frozen_(model, "int4", filter_fn=lambda m, name: True)
    first, second = model[0].weight, model[1].weight
    assert isinstance(first, QuantizedWeight) and isinstance(second, QuantizedWeight)
    assert first.group_size == 32 and second.group_size == 8  # gcd with the default 64
    x = torch.randn(3, 96)
    ref = nn.functional.linear(
        nn.functional.linear(x, first.dequantize(), model[0].bias), second.dequantize(), model[1].bias
    )
    assert torch.equal(model(x), ref)
