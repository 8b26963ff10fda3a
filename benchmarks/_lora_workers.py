"""The processes of `ds-plugin bench lora-memory`: the model, the ZeRO-3 ranks, the bitsandbytes QLoRA process.

Each worker builds the same bf16 Llama with peft LoRA, trains it for a few steps on a fixed batch and returns
what `lora_memory` reports (see its docstring): model-state bytes counted from storage after the last backward,
the frozen Linear weights' bytes, the frozen all-gather bytes of the last step, step times, losses, peak RSS.
"""

from __future__ import annotations

import resource
import time
import warnings
from typing import Any

import torch
from torch import nn

from benchmarks._model_states import FROZEN_CATEGORIES, Ledger, count_model_states, fsdp_param_groups, local

__all__ = ["FORMATS", "LORA_RANK", "LORA_TARGETS", "LR", "bnb_worker", "model_config", "shared_worker", "zero_worker"]

FORMATS = ("bf16", "int8", "int4", "nf4")
LORA_RANK = 16
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
LR = 1e-3


def model_config(hidden: int, layers: int, intermediate: int, heads: int, vocab: int, seq: int) -> dict[str, Any]:
    """The Llama config (a transformers config.json dict, also what `ds-plugin estimate --model-config` reads).

    Args:
        hidden: hidden size.
        layers: decoder layers.
        intermediate: MLP width.
        heads: attention heads (as many k/v heads).
        vocab: vocabulary size.
        seq: tokens per sample (sets max_position_embeddings).
    """
    return {
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": intermediate,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "vocab_size": vocab,
        "max_position_embeddings": max(seq, 128),
        "tie_word_embeddings": True,
    }


def _build(config: dict[str, Any]) -> nn.Module:
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    warnings.simplefilter("ignore")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    # Built in bf16: the frozen base is never trained, and fp32 would double what each rank holds before sharding.
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        return LlamaForCausalLM(LlamaConfig(**{k: v for k, v in config.items() if k != "model_type"}))
    finally:
        torch.set_default_dtype(default)


def _lora(model: nn.Module) -> nn.Module:
    import peft

    cfg = peft.LoraConfig(r=LORA_RANK, lora_alpha=2 * LORA_RANK, lora_dropout=0.0, target_modules=list(LORA_TARGETS))
    return peft.get_peft_model(model, cfg)  # adapters in fp32 (peft's autocast_adapter_dtype)


def _batch(rank: int, batch: int, seq: int, vocab: int) -> torch.Tensor:
    # The same batch every step: the adapters can fit it, so the loss falls within a few steps.
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1000 + rank))


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def _frozen_linears(model: nn.Module) -> list[nn.Linear]:
    from ds_plugin.quant.frozen.quantize import is_output_head

    return [
        m
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and not m.weight.requires_grad and not is_output_head(model, name, m)
    ]


class _GatherCounter:
    """Bytes of plain (unquantized) frozen Linear weights that ZeRO-3's all-gathers deliver to this rank.

    Wraps each FSDP2 parameter group's `unshard` (on the instance) and counts the calls that start an
    all-gather; each adds `world x` the padded shard bytes of the group's plain frozen Linear weights, which is
    what the all-gather sends and the convention of `FrozenStorageStats.gathered_bytes`, which counts the
    quantized ones. Private FSDP2 API (torch 2.9-2.13), read only.
    """

    def __init__(self, model: nn.Module, world: int) -> None:
        from ds_plugin.quant.frozen.tensor import QuantizedWeight

        self.bytes = 0
        frozen = {id(m) for m in _frozen_linears(model)}
        for group in fsdp_param_groups(model):
            per_gather = 0
            for fp in group.fsdp_params:
                info = fp._module_info
                shard = local(fp.sharded_param)
                if id(info.module) in frozen and info.param_name == "weight" and not isinstance(shard, QuantizedWeight):
                    per_gather += world * fp.padded_sharded_param_size.numel() * shard.element_size()
            if per_gather and world > 1:
                group.unshard = self._wrap(group, group.unshard, per_gather)

    def _wrap(self, group: Any, original: Any, per_gather: int) -> Any:
        def unshard(*args: Any, **kwargs: Any) -> Any:
            idle = group._all_gather_result is None
            out = original(*args, **kwargs)
            if idle and group._all_gather_result is not None:
                self.bytes += per_gather
            return out

        return unshard


def _linear_bytes(model: nn.Module) -> int:
    ledger = Ledger(["frozen_params"])
    for m in _frozen_linears(model):
        ledger.add("frozen_params", m.weight)
        for t in _quant_state_tensors(getattr(m.weight, "quant_state", None)):
            ledger.add("frozen_params", t)
    return ledger.bytes["frozen_params"]


def _quant_state_tensors(state: Any) -> list[torch.Tensor]:
    # bitsandbytes' QuantState: absmax, code, offset, and a nested QuantState for the double-quantized absmax.
    if state is None:
        return []
    out = []
    for value in vars(state).values():
        if isinstance(value, torch.Tensor):
            out.append(value)
        elif type(value) is type(state):
            out += _quant_state_tensors(value)
    return out


def zero_worker(rank: int, world: int, *, fmt: str, config: dict[str, Any], seq: int, batch: int, steps: int) -> dict:
    import ds_plugin
    from ds_plugin.quant.frozen.quantize import frozen_storage_stats

    baseline = _rss_mb()
    model = _build(config)
    params = sum(p.numel() for p in model.parameters())
    model = _lora(model)
    zero: dict[str, Any] = {"stage": 3}
    if fmt != "bf16":
        zero["frozen_format"] = fmt
    cfg = {
        "zero_optimization": zero,
        "bf16": {"enabled": True},
        "gradient_clipping": 0.0,
        "comms_logger": {"enabled": True},
    }
    engine = ds_plugin.initialize(model, cfg, optimizer=lambda ps: torch.optim.AdamW(ps, lr=LR))
    counter = _GatherCounter(engine.module, world)
    stats = frozen_storage_stats(engine.module)
    x = _batch(rank, batch, seq, config["vocab_size"])
    times, losses, out = [], [], {}
    for step in range(steps):
        counter.bytes, stats_before = 0, stats.gathered_bytes if stats else 0
        start = time.perf_counter()
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        if step == steps - 1:
            counted = time.perf_counter()
            states = count_model_states(engine, split_frozen=True)
            out["frozen_linear_bytes"] = _linear_bytes(engine.module)
            start += time.perf_counter() - counted  # the count is not part of the step
        engine.step()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    per_step = engine.comms_logger.summary()[steps - 1]
    engine.comms_logger.stop()  # a later run in this process starts its own
    out.update(
        states=states,
        times=times,
        losses=losses,
        # Quantized weights count their own gathers (padding of their packed rows included); plain ones are counted.
        frozen_allgather_bytes=counter.bytes + ((stats.gathered_bytes - stats_before) if stats else 0),
        stats_allgather_bytes=(stats.gathered_bytes - stats_before) if stats else None,
        allgather_bytes=sum(v["out_bytes"] for (op, _), v in per_step.items() if op.startswith("all_gather")),
        peak_rss_mb=_rss_mb(),
        baseline_rss_mb=baseline,
        params=params,
        trainable_params=sum(p.numel() for p in engine.trainable_parameters()),
    )
    return out


def _to_bnb_nf4(model: nn.Module) -> None:
    import bitsandbytes as bnb

    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if not isinstance(child, nn.Linear):
                    continue
                q = bnb.nn.Linear4bit(
                    child.in_features,
                    child.out_features,
                    bias=child.bias is not None,
                    compute_dtype=torch.bfloat16,
                    compress_statistics=True,
                    quant_type="nf4",
                )
                q.weight = bnb.nn.Params4bit(
                    child.weight.data, requires_grad=False, compress_statistics=True, quant_type="nf4"
                )
                setattr(parent, name, q.to("cpu"))  # moving a Params4bit to a device quantizes it
    # peft picks its bnb LoRA layers when the model says it was loaded in 4 bits (from_pretrained sets this).
    model.is_loaded_in_4bit = True


def bnb_worker(rank: int, world: int, *, config: dict[str, Any], seq: int, batch: int, steps: int, ranks: int) -> dict:
    torch.set_num_threads(ranks)  # the cores the ZeRO-3 run's ranks had, one thread each
    baseline = _rss_mb()
    model = _build(config)
    params = sum(p.numel() for p in model.parameters())
    _to_bnb_nf4(model)
    model = _lora(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=LR)
    x = torch.cat([_batch(r, batch, seq, config["vocab_size"]) for r in range(ranks)])
    times, losses = [], []
    for step in range(steps):
        start = time.perf_counter()
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        if step == steps - 1:
            counted = time.perf_counter()
            ledger = Ledger(FROZEN_CATEGORIES)
            for p in model.parameters():
                ledger.add("master_params" if p.requires_grad else "frozen_params", p)
                for t in _quant_state_tensors(getattr(p, "quant_state", None)):
                    ledger.add("frozen_params", t)
                ledger.add("grads", p.grad)
            for value in (v for s in opt.state.values() for v in s.values()):
                if isinstance(value, torch.Tensor):
                    ledger.add("optimizer_state", value)
            states, linear = ledger.snapshot(), _linear_bytes(model)
            start += time.perf_counter() - counted
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    return {
        "states": states,
        "frozen_linear_bytes": linear,
        "times": times,
        "losses": losses,
        "frozen_allgather_bytes": 0,
        "stats_allgather_bytes": None,
        "allgather_bytes": 0,
        "peak_rss_mb": _rss_mb(),
        "baseline_rss_mb": baseline,
        "params": params,
        "trainable_params": sum(p.numel() for p in trainable),
    }


def shared_worker(
    rank: int, world: int, *, runs: tuple[str, ...], config: dict[str, Any], seq: int, batch: int, steps: int
) -> dict[str, Any]:
    """Every run in this one set of processes (for tiny configs: peak RSS is then the largest so far, not its own).

    Args:
        rank: this rank.
        world: ranks N.
        runs: formats to run at ZeRO-3, then "bnb_qlora" on rank 0.
        config: the model config.
        seq: tokens per sample.
        batch: samples per rank.
        steps: training steps per run.
    """
    out = {}
    for name in runs:
        if name in FORMATS:
            out[name] = zero_worker(rank, world, fmt=name, config=config, seq=seq, batch=batch, steps=steps)
    if "bnb_qlora" in runs and rank == 0:
        # The other ranks wait at run_ranks' closing barrier meanwhile.
        out["bnb_qlora"] = bnb_worker(rank, 1, config=config, seq=seq, batch=batch, steps=steps, ranks=world)
        torch.set_num_threads(1)
    return out
