"""`load_pretrained`: a Hugging Face safetensors checkpoint loaded straight into a ZeRO model, each rank reading
only the rows it keeps, frozen Linear weights quantized as they are read.

`from_pretrained` followed by `quantize_frozen_` and sharding holds the whole model in full precision on every rank
first (a 7B model: 27 GB per rank in fp32) before ZeRO-3 or 4-bit storage save anything. Here, in order:

1. the checkpoint's headers are read and checked against the model the config describes (every tensor present, its
   shape and dtype), on every rank alike, before anything is allocated or any collective runs: a bad checkpoint is
   one `CheckpointLoadError` line naming the file and the tensor;
2. the model is built on the meta device (buffers such as rotary frequencies stay real), peft's adapters are added
   to it (their values drawn as on a real base), and the frozen Linear weights `quantize_frozen_` would choose
   become meta `QuantizedWeight`s of the same format and group size;
3. stages 2/3: `apply_plan` shards the empty model (FSDP2 sees the quantized weights, so it shards their codes), the
   rank allocates its shards, and each parameter's rows are read from the file into them: `Shard(0)`'s rows,
   torch.chunk's split (`shard_rows`), quantized on the way for the frozen Linear weights. No collective runs.
   Stages 0/1 keep whole weights: each rank reads and quantizes its share of a frozen weight's rows and the ranks
   all-gather the codes (as `quantize_frozen_(process_group=...)` does); other tensors are read whole.

A frozen weight's codes depend on its rows alone, so rows quantized apart are the weight quantized whole, bit for
bit: the model equals `from_pretrained(dtype=...)` + `quantize_frozen_` + `apply_zero` at the same world size.

Rows are read with positional reads of the byte range they fill in the file (a dim-0 slice of a row-major tensor is
contiguous), not through a memory map: pages a map touches count in the process's resident memory until it is
unmapped, which on a 7B checkpoint is the rank's whole share of it. Per rank at most one tensor's rows are held in
full precision at a time, beyond the shards (`LoadStats` records it). The safetensors headers themselves are also
opened with `safetensors.safe_open`, which validates them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ds_plugin.checkpoint.safetensors_files import (
    CheckpointLoadError,
    LoadStats,
    SafetensorsCheckpoint,
    naive_load_bytes,
)
from ds_plugin.presets import ConfigSource
from ds_plugin.quant.frozen import quantize as _frozen
from ds_plugin.quant.frozen.codecs import check_weight, quantize_weight
from ds_plugin.quant.frozen.quantize import default_group_size, is_output_head, peft_adapter_modules
from ds_plugin.quant.frozen.tensor import FrozenStorageStats, QuantizedWeight
from ds_plugin.zero.apply import apply_plan
from ds_plugin.zero.init import PENDING_LOAD, materialize_, meta_init
from ds_plugin.zero.mesh import data_parallel_mesh, mesh_device
from ds_plugin.zero.plan import ZeroPlan, plan_for
from ds_plugin.zero.stage1 import shard_rows
from ds_plugin.zero.wrap import BlockTypes

__all__ = ["CheckpointLoadError", "LoadStats", "SafetensorsCheckpoint", "load_pretrained", "naive_load_bytes"]

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------------- names


# A tensor kept whole on every rank is read in blocks of rows of at most this many bytes.
_WHOLE_FILL_BYTES = 32 << 20
_PEFT_PARTS = re.compile(r"\.(base_layer|original_module)(?=\.)|\.modules_to_save\.[^.]+(?=\.)")


def _base_name(name: str, prefix: str = "base_model.model") -> str:
    # peft's names -> the base model's: where peft holds it (`prefix`: "base_model.model" under a tuner such as
    # LoRA, "base_model" for prompt learning), LoRA's base_layer, modules_to_save's copies.
    if prefix and name.startswith(f"{prefix}."):
        name = name[len(prefix) + 1 :]
    return _PEFT_PARTS.sub("", name)


def _checkpoint_keys(base: nn.Module, ckpt: SafetensorsCheckpoint) -> dict[str, str]:
    """Base-model parameter name -> checkpoint tensor name, for every name a tensor exists for (ties included)."""
    prefix = getattr(base, "base_model_prefix", "") or ""
    aliases: dict[int, list[str]] = {}
    for name, p in base.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(_base_name(name, ""))
    out: dict[str, str] = {}
    for names in aliases.values():
        found = None
        for name in names:
            candidates = [name]
            if prefix:
                candidates += [f"{prefix}.{name}", name.removeprefix(f"{prefix}.")]
            found = next((c for c in candidates if c in ckpt), None)
            if found:
                break
        if found:
            out.update((name, found) for name in names)
    return out


# ---------------------------------------------------------------------- building the empty model


@contextlib.contextmanager
def _nothing_moves_to_meta() -> Iterator[None]:
    """Inside the block, `module.to("meta", ...)` keeps the module where it is (a dtype change still applies).

    peft moves each new adapter (and prompt encoder) to its base layer's device, which on a meta base would drop
    the values it just drew; left where they were made, they equal get_peft_model's on a real base (the same draws,
    in the same order, cast to the same dtype). Patches `nn.Module.to` while active (as `meta_init` patches
    `register_parameter`); not thread-safe.
    """
    original = nn.Module.to

    def to(self: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        if device is not None and device.type == "meta":
            return original(self, dtype=dtype) if dtype is not None else self
        return original(self, *args, **kwargs)

    nn.Module.to = to
    try:
        yield
    finally:
        nn.Module.to = original


def _build(
    path: Path, model_class: Any, dtype: torch.dtype, peft_config: Any, frozen: bool, model_kwargs: dict
) -> tuple:
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        hf_config = AutoConfig.from_pretrained(path, local_files_only=True, **model_kwargs)
    except (OSError, ValueError) as e:
        raise CheckpointLoadError(f"{path / 'config.json'}: {str(e).splitlines()[0]}") from None
    with meta_init():
        base = (model_class or AutoModelForCausalLM).from_config(hf_config, dtype=dtype)
    if frozen:
        base.requires_grad_(False)
    model = base
    if peft_config is not None:
        from peft import get_peft_model

        with _nothing_moves_to_meta():
            model = get_peft_model(base, peft_config)
    return hf_config, base, model


def _frozen_linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    # quantize_frozen_'s default choice: frozen, not tied to an embedding, not the output head, not peft's.
    tied = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    adapters = peft_adapter_modules(model)
    chosen = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or isinstance(module.weight, QuantizedWeight):
            continue
        w = module.weight
        if w.requires_grad or id(w) in tied or id(module) in adapters or is_output_head(model, name, module):
            continue
        chosen.append((name, module))
    return chosen


def _quantize_on_meta(model: nn.Module, fmt: str, group_size: int | None) -> dict[str, tuple[str, int]]:
    """Swap the chosen frozen Linear weights for meta `QuantizedWeight`s; returns name -> (fmt, group size)."""
    stats = model.__dict__.setdefault(_frozen._STATS_ATTR, FrozenStorageStats())
    layouts: dict[tuple, dict[str, torch.Tensor]] = {}
    done: dict[int, nn.Parameter] = {}
    out: dict[str, tuple[str, int]] = {}
    for name, module in _frozen_linears(model):
        w = module.weight
        rows, cols = w.shape
        g = default_group_size(fmt, cols) if group_size is None else group_size
        try:
            check_weight(fmt, (rows, cols), g)
        except ValueError as e:
            raise CheckpointLoadError(f"{name}.weight: {e}") from None
        if id(w) not in done:
            key = (fmt, cols, g, w.dtype)
            if key not in layouts:  # the components' widths: one zero row, quantized
                layouts[key] = quantize_weight(torch.zeros(1, cols, dtype=w.dtype), fmt, g)
            parts = {
                n: torch.empty((rows, *p.shape[1:]), dtype=p.dtype, device="meta") for n, p in layouts[key].items()
            }
            q = QuantizedWeight(parts, fmt, g, (rows, cols), w.dtype, stats)
            done[id(w)] = nn.Parameter(q, requires_grad=False)
        module.weight = done[id(w)]
        out[f"{name}.weight" if name else "weight"] = (fmt, g)
    return out


def _hold_real(model: nn.Module) -> dict[str, torch.Tensor]:
    # Parameters made outside the meta device (peft's adapters): kept aside by name, the model's own copy put on
    # meta so the model is uniformly empty; their rows are copied back like the checkpoint's.
    held: dict[str, torch.Tensor] = {}
    for module_name, module in model.named_modules():
        for leaf, p in list(module._parameters.items()):
            if p is None:
                continue
            name = f"{module_name}.{leaf}" if module_name else leaf
            if p.is_meta:
                continue
            held[name] = p.detach()
            module._parameters[leaf] = nn.Parameter(p.detach().to("meta"), requires_grad=p.requires_grad)
    return held


# ---------------------------------------------------------------------- checking before anything is read


def _declared_dtype(path: Path) -> str | None:
    # config.json's own word (transformers rewrites the config object's dtype to the one a model is built in).
    try:
        raw = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    declared = raw.get("dtype") or raw.get("torch_dtype")
    return declared if isinstance(declared, str) else None


def _check(
    model: nn.Module,
    base: nn.Module,
    base_keys: dict[str, str],
    held: dict,
    ckpt: SafetensorsCheckpoint,
    declared_dtype: str | None,
) -> dict[str, str]:
    """Parameter name -> checkpoint tensor for every parameter not held in memory; every problem is one line."""
    declared = getattr(torch, declared_dtype, None) if declared_dtype else None
    sources: dict[str, str] = {}
    where = next((name for name, m in model.named_modules() if m is base), "")
    added = peft_adapter_modules(model)
    adapters = {id(p) for m in model.modules() if id(m) in added for p in m.parameters()}
    for name, p in model.named_parameters():
        if name in held:
            continue
        key = base_keys.get(_base_name(name, where))
        if key is None:
            if p.requires_grad or id(p) in adapters:
                continue  # a new head (a reward model's score): initialised, as from_pretrained does
            raise CheckpointLoadError(
                f"{ckpt.path}: no tensor {_base_name(name, where)} in any file; the checkpoint is incomplete or is "
                "not this model's"
            )
        e = ckpt.entries[key]
        if tuple(e.shape) != tuple(p.shape):
            raise CheckpointLoadError(
                f"{e.file}: tensor {key} has shape {list(e.shape)} but config.json makes it {list(p.shape)}; the "
                "weights do not belong to this config"
            )
        if not e.dtype.is_floating_point or (isinstance(declared, torch.dtype) and e.dtype != declared):
            want = declared if isinstance(declared, torch.dtype) else "a floating dtype"
            raise CheckpointLoadError(
                f"{e.file}: tensor {key} is {e.dtype} but config.json declares {want}; the weights do not belong to "
                "this config"
            )
        sources[name] = key
    return sources


# ---------------------------------------------------------------------- filling the allocated model


def _rows_of(p: torch.Tensor, sharded: bool, mesh: Any) -> tuple[int, int]:
    if sharded and isinstance(p, DTensor):
        return shard_rows(p.shape[0], mesh.size(), mesh.get_local_rank())
    return 0, p.shape[0] if p.dim() else 1


def _to_local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p


def _lora_deltas(adapter: Path, ckpt: SafetensorsCheckpoint) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
    """Checkpoint tensor -> (A, B, scaling) of a saved peft LoRA adapter, to merge into the rows as they are read."""
    from safetensors.torch import load_file

    try:
        config = json.loads((adapter / "adapter_config.json").read_text())
        weights = load_file(adapter / "adapter_model.safetensors")
    except (OSError, ValueError) as e:
        raise CheckpointLoadError(f"{adapter}: not a saved peft LoRA adapter ({str(e).splitlines()[0]})") from None
    if config.get("peft_type") != "LORA" or config.get("rank_pattern") or config.get("alpha_pattern"):
        raise CheckpointLoadError(f"{adapter}: only a plain LoRA adapter (one rank and alpha) can be merged as read")
    r = config["r"]
    scaling = config["lora_alpha"] / (math.sqrt(r) if config.get("use_rslora") else r)
    out = {}
    for name, a in weights.items():
        if ".lora_A." not in name:
            continue
        module = _base_name(name.split(".lora_A.")[0])
        key = f"{module}.weight"
        if key not in ckpt:
            raise CheckpointLoadError(f"{adapter}: its {name} adapts {key}, which the checkpoint does not hold")
        out[key] = (a, weights[name.replace(".lora_A.", ".lora_B.")], scaling)
    return out


class _Filler:
    def __init__(self, ckpt: SafetensorsCheckpoint, dtype: torch.dtype, mesh: Any, stats: LoadStats,
                 merges: dict[str, tuple[torch.Tensor, torch.Tensor, float]] | None = None) -> None:  # fmt: skip
        self.ckpt, self.dtype, self.mesh, self.stats = ckpt, dtype, mesh, stats
        self.merges = merges or {}

    def rows(self, source: str | torch.Tensor, start: int, length: int) -> torch.Tensor:
        # The checkpoint's rows in the load dtype (what from_pretrained(dtype=...) would hold), tracked.
        import time

        t0 = time.perf_counter()
        if isinstance(source, torch.Tensor):  # peft's adapters: as peft made them (fp32 masters follow)
            return (source if source.dim() else source.reshape(1))[start : start + length]
        raw = self.ckpt.read_rows(source, start, length, self.stats)
        out = raw.to(self.dtype) if raw.is_floating_point() and raw.dtype != self.dtype else raw
        if source in self.merges:
            # peft's merge_and_unload, on these rows: W += (B @ A) * scaling, B's rows being W's rows.
            a, b, scaling = self.merges[source]
            out = out + (b[start : start + length].to(out.dtype) @ a.to(out.dtype)) * scaling
        if out is not raw and out.data_ptr() != raw.data_ptr():
            self.stats.track(out)
        self.stats.largest_tensor_bytes = max(
            self.stats.largest_tensor_bytes,
            raw.numel() * raw.element_size() + (out.numel() * out.element_size() if out is not raw else 0),
        )
        self.stats.read_s += time.perf_counter() - t0
        return out

    def quantize(self, rows: torch.Tensor, q: QuantizedWeight) -> dict[str, torch.Tensor]:
        import time

        t0 = time.perf_counter()
        parts = quantize_weight(rows, q.fmt, q.group_size)
        self.stats.quantize_s += time.perf_counter() - t0
        return parts

    def fill_sharded(self, p: DTensor, source: str | torch.Tensor) -> None:
        local = _to_local(p)
        start, length = _rows_of(p, True, p.device_mesh)
        if length == 0:
            return
        rows = self.rows(source, start, length)
        if isinstance(local, QuantizedWeight):
            # Quantized where the weight lives: on the GPU under NCCL.
            for name, part in self.quantize(rows.to(local.device), local).items():
                local.parts[name].copy_(part)
        else:
            local.copy_(rows.reshape(local.shape))

    def fill_whole(self, p: torch.Tensor, source: str | torch.Tensor) -> None:
        if not isinstance(p, QuantizedWeight):
            # In blocks of rows: a whole tensor (a frozen output head kept whole at ZeRO-3: 250 MiB at a 7B shape)
            # is then never held twice, as read and as stored.
            rows = p.shape[0] if p.dim() else 1
            target = p.detach().view(rows, -1)
            step = max(1, _WHOLE_FILL_BYTES // max(1, target.shape[1] * target.element_size()))
            for start in range(0, rows, step):
                length = min(step, rows - start)
                target[start : start + length].copy_(self.rows(source, start, length).reshape(length, -1))
            return
        # Each rank quantizes its share of the rows (zero rows pad the last) and the ranks gather the codes.
        world = self.mesh.size() if self.mesh is not None else 1
        rank = self.mesh.get_local_rank() if self.mesh is not None else 0
        total = p.shape[0]
        per = -(-total // world)
        start, length = min(rank * per, total), max(0, min(per, total - rank * per))
        local = torch.zeros((per, p.shape[1]), dtype=self.dtype, device=p.device)
        if length:
            local[:length].copy_(self.rows(source, start, length))
        parts = self.quantize(local, p)
        del local
        if world == 1:
            for name, part in parts.items():
                p.parts[name].copy_(part[:total])
            return
        group = self.mesh.get_group()
        device = mesh_device(self.mesh)
        for name, part in parts.items():
            gathered = part.new_empty((world * per, *part.shape[1:]), device=device)
            dist.all_gather_into_tensor(gathered, part.to(device).contiguous(), group=group)
            p.parts[name].copy_(gathered[:total])


def _init_new(model: nn.Module, names: list[str], seed: int) -> None:
    # Parameters the checkpoint does not hold (a new head): the owning module's own initialisation, whole, then
    # the local rows kept; the same seed on every rank.
    from ds_plugin.zero.init import _FullThenShard

    owners = {name.rpartition(".")[0] for name in names}
    hf = next((m for m in model.modules() if callable(getattr(m, "_init_weights", None))), None)
    with torch.random.fork_rng(), torch.no_grad(), _FullThenShard():
        torch.manual_seed(seed)
        for owner in sorted(owners):
            module = model.get_submodule(owner)
            if hf is not None:
                hf._init_weights(module)
            elif callable(reset := getattr(module, "reset_parameters", None)):
                reset()
    logger.warning("not in the checkpoint, newly initialised: %s", ", ".join(sorted(names)))


# ---------------------------------------------------------------------- the public function


def load_pretrained(
    path: str | os.PathLike,
    config: ZeroPlan | ConfigSource | None = None,
    *,
    model_class: Any = None,
    peft_config: Any = None,
    merge_adapter: str | os.PathLike | None = None,
    frozen: bool = False,
    frozen_format: str | None = None,
    frozen_group_size: int | None = None,
    dtype: torch.dtype = torch.float32,
    mesh: Any = None,
    block_types: BlockTypes | None = None,
    stats: LoadStats | None = None,
    seed: int = 0,
    defer: bool = False,
    **model_kwargs: Any,
) -> nn.Module:
    """Load a local Hugging Face safetensors checkpoint into a ZeRO model, streaming: each rank reads only the rows
    it keeps, frozen Linear weights are quantized as they are read, no rank ever holds the whole model.

    The result is the model `from_pretrained(path, dtype=dtype)` (with `get_peft_model(..., peft_config)`), then
    `quantize_frozen_`, then `apply_zero(model, config)` would give, bit for bit, already sharded: pass it to
    `ds_plugin.initialize` (or Lightning / Accelerate), which builds the engine on it without sharding it again.

    Args:
        path: the checkpoint directory: config.json and model.safetensors, or shards with their index JSON.
        config: the ZeRO config (a `ZeroPlan`, preset name, DeepSpeed dict or path, `TrainingConfig`); needs an
            initialized process group. None: no ZeRO, a plain model on CPU (one process; e.g. to reload an adapter).
        model_class: the transformers auto class (default `AutoModelForCausalLM`; e.g.
            `AutoModelForSequenceClassification`, whose new head is initialised as `from_pretrained` does).
        peft_config: a peft config (`LoraConfig`, `PrefixTuningConfig`, ...) whose adapters are added to the empty
            base: a `PeftModel` is returned, its base frozen.
        merge_adapter: a saved peft LoRA adapter (folder) merged into the weights as they are read, as
            `PeftModel.from_pretrained(base, merge_adapter).merge_and_unload()` would (before `peft_config`'s new
            adapters are added on top).
        frozen: freeze every parameter of the base (a reference model, inference); with `peft_config` the base is
            frozen anyway.
        frozen_format: "int8", "int4", "nf4" or "fp6" storage of the frozen Linear weights (the output head and
            peft's modules excepted, as in `quantize_frozen_`); default the config's
            `zero_optimization.frozen_format`, None stores them in `dtype`.
        frozen_group_size: elements per scale; default the config's, else the format's for the width.
        dtype: the dtype tensors are loaded in (as `from_pretrained(dtype=...)`); setup then keeps fp32 masters of
            trainable ones and the compute dtype for frozen ones.
        mesh: the 1-D data-parallel mesh; default all ranks.
        block_types: blocks to shard separately (see `apply_zero`).
        stats: a `LoadStats` to fill (bytes read, the most full-precision bytes held at once, seconds).
        seed: seed of the parameters the checkpoint lacks (a new head), the same on every rank.
        defer: return the empty (meta-device) model; it loads itself when ZeRO setup allocates it (`initialize`,
            the Lightning strategy after `configure_model`, Accelerate's `prepare`): each rank its own shards.
        model_kwargs: config overrides for `AutoConfig.from_pretrained` (e.g. `num_labels=1`).

    Raises:
        CheckpointLoadError: a missing shard or tensor, a truncated file, a shape or dtype that does not match
            config.json, an index naming a file that is not there (one line naming the file and the tensor),
            raised on every rank before anything is allocated or any collective runs.
        ZeroSetupError: as `apply_zero`.
    """
    path = Path(path)
    plan = mesh_ = None
    if config is not None:
        mesh_ = data_parallel_mesh(mesh)
        plan = plan_for(config, mesh_)
    fmt = frozen_format or (plan.frozen_format if plan is not None else None)
    group_size = frozen_group_size or (plan.frozen_group_size if plan is not None else None)
    if fmt is not None and fmt not in _frozen.FROZEN_FORMATS:
        raise CheckpointLoadError(f"frozen_format {fmt!r} is not one of {', '.join(_frozen.FROZEN_FORMATS)}")
    ckpt = SafetensorsCheckpoint(path)
    _, base, model = _build(path, model_class, dtype, peft_config, frozen, model_kwargs)
    base_keys = _checkpoint_keys(base, ckpt)
    held = _hold_real(model)
    sources = _check(model, base, base_keys, held, ckpt, _declared_dtype(path))
    if fmt is not None:
        _quantize_on_meta(model, fmt, group_size)
    merges = _lora_deltas(Path(merge_adapter), ckpt) if merge_adapter is not None else {}
    load = _PendingLoad(ckpt, sources, held, dtype, stats if stats is not None else LoadStats(), seed, mesh_, merges)
    model.__dict__[PENDING_LOAD] = load
    if defer:
        return model
    if plan is None:
        materialize_(model, device="cpu")
    elif plan.stage >= 2:
        apply_plan(model, plan, mesh=mesh_, block_types=block_types, sync_module_states=False)
        materialize_(model, device=mesh_device(mesh_))
    else:
        materialize_(model, device=mesh_device(mesh_))
        apply_plan(model, plan, mesh=mesh_, block_types=block_types, sync_module_states=False)
    return model


class _PendingLoad:
    """What `materialize_` calls on the allocated model: every parameter's rows read (and quantized) into it."""

    def __init__(self, ckpt: SafetensorsCheckpoint, sources: dict[str, str], held: dict[str, torch.Tensor],
                 dtype: torch.dtype, stats: LoadStats, seed: int, mesh: Any, merges: dict) -> None:  # fmt: skip
        self.ckpt, self.sources, self.held, self.dtype = ckpt, sources, held, dtype
        self.stats, self.seed, self.mesh, self.merges = stats, seed, mesh, merges

    @torch.no_grad()
    def __call__(self, model: nn.Module) -> None:
        import time

        started = time.perf_counter()
        mesh = self.mesh
        if mesh is None and dist.is_available() and dist.is_initialized():
            mesh = data_parallel_mesh()
        filler = _Filler(self.ckpt, self.dtype, mesh, self.stats, self.merges)
        missing: list[str] = []
        done: set[int] = set()
        for name, p in model.named_parameters():
            if id(p) in done:
                continue
            done.add(id(p))
            source = self.held.get(name, self.sources.get(name))
            if source is None:
                missing.append(name)
            elif isinstance(p, DTensor):
                filler.fill_sharded(p, source)
            else:
                filler.fill_whole(p, source)
        if missing:
            _init_new(model, missing, self.seed)
        self.held = {}
        if mesh is None or mesh.get_local_rank() == 0:
            logger.info(
                "loaded %s (%.1f MB of weights) in %.1f s: read %.1f MB on this rank, quantized in %.1f s",
                self.ckpt.path,
                self.ckpt.nbytes() / 2**20,
                time.perf_counter() - started,
                self.stats.read_bytes / 2**20,
                self.stats.quantize_s,
            )
