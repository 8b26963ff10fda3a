"""`apply_zero(model, config)`: turn a model into a ZeRO model for stages 0, 1, 2 or 3.

`apply_zero` resolves its config once (`plan_for`); `apply_plan`, which `setup_zero` calls, takes only the plan.
The model half of setup (`setup.py` runs the whole of it), in one fixed order, each step for a reason:
check the model → host memory reuse (CPU) → rank 0's weights to every rank → FP8 layers and frozen-weight storage
(before sharding: FSDP2 shards the parameters it finds, and the FP8 / quantized weight subclasses must be in place
for their all-gather hooks) → fp32 masters for trainable parameters only, frozen ones stored in the compute dtype →
shard (stages 2/3) or replicate (0/1) → ZeRO++ collectives (they replace the collectives of the sharded modules,
so they come last).

Stages 2 and 3 are FSDP2: every repeated block, then the root, goes through `fully_shard`, so the fp32 master
weights are the sharded parameters and the gradients are reduce-scattered into them. Stage 3 frees the gathered
weights after each block's forward (`reshard_after_forward=True`, or hpZ's int k); stage 2 keeps them until
backward (False). Stages 0 and 1 keep the parameters whole (see `stage1.py`).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from ds_plugin.kernels.blocked_logits import use_blocked_logits
from ds_plugin.kernels.cross_entropy import use_chunked_loss
from ds_plugin.presets import ConfigSource
from ds_plugin.quant.frozen.quantize import check_shardable, quantize_frozen_, quantized_weights
from ds_plugin.quant.frozen.tensor import QuantizedWeight
from ds_plugin.runtime.host_memory import release_freed_host_memory, reuse_freed_host_memory, warn_thread_cache
from ds_plugin.zero.generation import held_gathered
from ds_plugin.zero.gloo_comm import AllReduceScatter, BufferPool, InFlightReductions, RingAllGather
from ds_plugin.zero.mesh import ZeroSetupError, data_parallel_mesh, mesh_device, torch_dtype
from ds_plugin.zero.plan import ZeroPlan, plan_for
from ds_plugin.zero.stage1 import ReplicatedState, replicated_state
from ds_plugin.zero.wrap import BlockTypes, find_blocks
from ds_plugin.zero.zeropp import install_zeropp, quantized_collectives

__all__ = ["apply_plan", "apply_zero", "broadcast_module_states", "is_zero_applied", "mixed_precision_policy"]

logger = logging.getLogger(__name__)


def mixed_precision_policy(plan: ZeroPlan) -> MixedPrecisionPolicy:
    """FSDP2's mixed precision for a plan: compute in fp16/bf16, reduce in `communication_data_type`.

    The fp32 master weights are the sharded parameters themselves, so `param_dtype` only sets the dtype of
    the gathered copies forward and backward use.

    Args:
        plan: the resolved plan.
    """
    compute = torch_dtype(plan.compute_dtype)
    reduce = torch_dtype(plan.reduce_dtype)
    return MixedPrecisionPolicy(
        param_dtype=None if compute == torch.float32 else compute,
        reduce_dtype=None if reduce == compute else reduce,
    )


def is_zero_applied(model: nn.Module) -> bool:
    """Whether `apply_zero` (or a raw `fully_shard`) already went over this model.

    Args:
        model: any module.
    """
    return isinstance(model, FSDPModule) or replicated_state(model) is not None


def _check_model(model: nn.Module, stage: int) -> None:
    if next(model.parameters(), None) is None:
        raise ZeroSetupError(
            f"{type(model).__name__} has no parameters; ZeRO partitions parameters, so build the model's layers "
            "before apply_zero"
        )
    if is_zero_applied(model):
        raise ZeroSetupError(f"{type(model).__name__} already went through apply_zero/fully_shard; apply it once")
    if stage < 2 and any(p.is_meta for p in model.parameters()):
        raise ZeroSetupError(
            f"stage {stage} keeps whole parameters on every rank, so they cannot stay on the meta device; "
            "materialize the model first (init_sharded and initialize do it for you)"
        )
    if stage >= 2:
        scalars = [name for name, p in model.named_parameters() if p.dim() == 0]
        if scalars:
            raise ZeroSetupError(
                f"parameter {scalars[0]!r} is a scalar, which stage {stage} (FSDP2) cannot shard; "
                "make it a 1-element tensor (e.g. torch.ones(1)) or use stage 0 or 1"
            )


def has_fp8_layers(model: nn.Module) -> bool:
    """Whether FP8 linears are already in the model (converted by the user or by an earlier setup).

    Args:
        model: any module.
    """
    from ds_plugin.precision.fp8_linear import Fp8Linear

    return any(isinstance(m, Fp8Linear) for m in model.modules())


def _convert_layers(model: nn.Module, plan: ZeroPlan, mesh: DeviceMesh) -> None:
    # FP8 layers and frozen-weight storage. FP8 conversion keeps the trainable parameter objects, so an optimizer
    # built on the model before setup still maps onto them; frozen weights have no optimizer state to keep.
    if plan.fp8 is not None and not has_fp8_layers(model):
        from ds_plugin.precision.fp8_linear import convert_to_fp8_training

        try:
            convert_to_fp8_training(model, plan.fp8)
        except ValueError as e:
            raise ZeroSetupError(f"fp8: {e}") from None
    if plan.frozen_format is not None:
        if quantized_weights(model):
            logger.info("frozen weights already quantized by the caller; frozen_format is not applied again")
            return
        try:
            # Every rank holds the same weights here (broadcast above): each quantizes a share of the rows.
            group = mesh.get_group() if mesh.size() > 1 else None
            quantize_frozen_(model, plan.frozen_format, group_size=plan.frozen_group_size, process_group=group)
        except ValueError as e:
            raise ZeroSetupError(f"zero_optimization.frozen_format: {e}") from None


@torch.no_grad()
def _store_parameters(model: nn.Module, compute_dtype: torch.dtype) -> None:
    # Trainable weights get fp32 masters whatever dtype they were loaded in (as DeepSpeed does). Frozen ones are
    # stored in the compute dtype and never get a master: no optimizer updates them, so fp32 would only cost memory
    # (4 bytes per frozen weight in a LoRA run). A quantized weight keeps its codes; only its compute dtype is set.
    trainable = [p for p in model.parameters() if p.requires_grad and p.is_floating_point()]
    low = [p for p in trainable if p.dtype != torch.float32] if compute_dtype != torch.float32 else []
    if low:
        logger.info("upcasting %d %s parameters to fp32 master weights", len(low), low[0].dtype)
        for p in low:
            p.data = p.data.float()
    frozen = {id(p) for p in model.parameters() if not p.requires_grad and p.is_floating_point()}
    replaced: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None or id(p) not in frozen or p.dtype == compute_dtype:
                continue
            if isinstance(p, QuantizedWeight):
                # A wrapper subclass cannot swap its dtype through `.data`; a new parameter (shared ones stay shared).
                if id(p) not in replaced:
                    replaced[id(p)] = nn.Parameter(p.to(compute_dtype), requires_grad=False)
                module._parameters[name] = replaced[id(p)]
            else:
                p.data = p.data.to(compute_dtype)


def _check_quantized_shards(model: nn.Module, plan: ZeroPlan, mesh: DeviceMesh) -> None:
    # FSDP2 gathers a quantized weight through its all-gather extension, which has no path for uneven rows (the
    # padded shard would have to be the codes' shape) nor for hpZ's secondary shard.
    if not quantized_weights(model):
        return
    if isinstance(plan.reshard_after_forward, int) and not isinstance(plan.reshard_after_forward, bool):
        raise ZeroSetupError(
            "quantized frozen weights cannot combine with hpZ (FSDP2 re-gathers the secondary shard without the "
            "codes' all-gather hooks); set zero_hpz_partition_size to 1"
        )
    try:
        check_shardable(model, mesh.size())
    except ValueError as e:
        raise ZeroSetupError(str(e)) from None


def _shard(model: nn.Module, plan: ZeroPlan, mesh: DeviceMesh, blocks: list[nn.Module]) -> None:
    # FSDP2 offloads all sharded state together: the sharded params are the fp32 masters the optimizer owns.
    offload: OffloadPolicy = CPUOffloadPolicy(pin_memory=plan.pin_memory) if plan.offload else OffloadPolicy()
    kwargs: dict[str, Any] = {
        "mesh": mesh,
        "reshard_after_forward": plan.reshard_after_forward,
        "mp_policy": mixed_precision_policy(plan),
        "offload_policy": offload,
    }
    if plan.fp8_all_gather:
        from ds_plugin.precision.fp8_all_gather import enable_fp8_all_gather

        # Before fully_shard: FSDP2 looks for the all-gather hooks on the tensors it shards.
        try:
            stats = enable_fp8_all_gather(model, mesh.size())
        except ValueError as e:
            raise ZeroSetupError(str(e)) from None
        if mesh.get_local_rank() == 0:
            logger.info(stats.summary())
    # Blocks first, root last: the root then owns only what no block claimed (embeddings, final norm, head).
    kept = _kept_blocks(model, blocks, plan)
    if kept and mesh.get_local_rank() == 0:
        logger.info(
            "stage 3 keeps the last %d of %d blocks gathered from forward to backward (%.1fM parameters; "
            "stage3_max_reuse_distance 0 frees them all)",
            len(kept),
            len(blocks),
            sum(_numel(b) for b in kept) / 1e6,
        )
    for block in blocks:
        fully_shard(block, **{**kwargs, "reshard_after_forward": block not in kept and plan.reshard_after_forward})
    root = plan.reshard_after_forward
    whole = _whole_frozen_head(model, plan)
    if whole is not None:
        # Not FSDP2's: it stays on the mesh's device, where the gathered weights compute.
        for p in whole.parameters():
            if not p.is_meta:
                p.data = p.data.to(mesh_device(mesh))
    # Stage 3 with an untied input embedding and output head (Llama, Mistral; not GPT-2's tied one): each is its own
    # unit, so the root no longer holds both whole from forward to backward (524 MB of bf16 at a 7B model: two
    # 32000 x 4096 weights). The embedding frees its gathered weight after forward, as a block does; the head, used
    # last in forward and first in backward, stays gathered between the two (freeing it there would only add an
    # all-gather) and is freed after its backward.
    ends = [(m, after) for m, after in _separate_ends(model, root) if m is not whole]
    frozen_embeddings: set[nn.Module] = set()
    for module, after_forward in ends:
        fully_shard(module, **{**kwargs, "reshard_after_forward": after_forward})
        if isinstance(module, nn.Embedding) and not any(p.requires_grad for p in module.parameters()):
            frozen_embeddings.add(module)
            # A frozen input embedding has nothing to compute in backward (its input, token ids, takes no gradient),
            # but FSDP2's implicit backward prefetch would still gather it when the first block's backward starts,
            # at the size of the whole table twice over (500 MiB at a 7B Llama shape): the step's peak there.
            module.set_unshard_in_backward(False)
    # The root (the final norm; the embedding and head too when tied) stays gathered from forward to backward,
    # which needs it first, as FSDP2 does by itself when the setting is left unset: that saves one all-gather per
    # step of what is often the largest parameter (GPT-2's tied embedding: 9% of the step in `bench peers`). With
    # hpZ the root keeps the blocks' setting: its backward gather stays in the node anyway, and backward then sees
    # the root's weights as it sees the blocks' (under qwZ, secondary shards re-quantized, as in DeepSpeed). Keeping
    # the root gathered there moved fp16 ZeRO++ from 0.84% to 1.01% off ZeRO-3's loss in
    # tests/zero/test_zeropp_convergence.py.
    ignored = set(whole.parameters()) if whole is not None else None
    root_after = False if root is True else root
    fully_shard(model, **{**kwargs, "reshard_after_forward": root_after, "ignored_params": ignored})
    for block in kept:
        # Runs after FSDP2's post-forward hook, which fully_shard registered first.
        block.register_forward_hook(_free_without_backward)
    first = [m for m, _ in ends if isinstance(m, nn.Embedding)]  # the input embedding; a head is used last
    units = first + blocks + [m for m, _ in ends if m not in first]
    _set_prefetch(model, units, frozen_embeddings, kept, plan, mesh)


def _kept_blocks(model: nn.Module, blocks: list[nn.Module], plan: ZeroPlan) -> set[nn.Module]:
    """The blocks stage 3 keeps gathered from their forward to their backward instead of freeing and gathering
    them again: DeepSpeed's `stage3_max_reuse_distance`, at FSDP2's block granularity.

    DeepSpeed does not release a module's weights after its forward when they are used again before that many
    parameter elements have run (its default, 1e9: every block of a model under ~500M parameters, the last two of
    a 7B Llama). Between block k's forward and its backward run the later blocks and what follows them (final
    norm, head; GPT-2's tied embedding), twice: forward and backward. So the blocks are kept from the last one
    backwards while that distance stays under `stage3_max_reuse_distance`, the kept blocks' parameters under
    `stage3_max_live_parameters`, and each block fits `stage3_prefetch_bucket_size` (what may be gathered ahead
    of use: a 7B Llama layer, 202M elements, does not, so big models keep today's peak). Each kept block saves
    one all-gather per step, at the cost of its gathered weights held through the backward of the later ones.
    """
    if plan.reshard_after_forward is False or not blocks:
        return set()
    sizes = [_numel(b) for b in blocks]
    # The untied input embedding runs before the blocks, not between a block's forward and backward.
    before = sum(_numel(m) for m, _ in _separate_ends(model, plan.reshard_after_forward) if isinstance(m, nn.Embedding))
    after = _numel(model) - sum(sizes) - before
    kept: set[nn.Module] = set()
    live = 0  # elements of the blocks kept so far: the later blocks
    for block, numel in zip(reversed(blocks), reversed(sizes), strict=True):
        if 2 * (live + after) >= plan.reuse_numel or numel > plan.prefetch_numel or live + numel > plan.live_numel:
            break
        kept.add(block)
        live += numel
    return kept


def _free_without_backward(block: nn.Module, args: Any, output: Any) -> None:
    # A kept block stays gathered for the backward that follows its forward. A forward without autograd has none
    # (evaluation, a frozen reference or reward model's scores, reentrant activation checkpointing's first pass),
    # so the block is freed as any other stage-3 block (DeepSpeed's trace likewise sees no reuse there); else a
    # small frozen model would stay gathered whole. The root and an untied head keep FSDP2's behaviour (gathered
    # after a forward either way). Inside `gathered_for_generation` every unit stays gathered on purpose.
    if not torch.is_grad_enabled() and not held_gathered(block):
        block.reshard()


def _gloo_collectives(model: nn.Module, reuse_buffers: bool) -> None:
    # FSDP2 on gloo: every unit's gradient reduction lands while the next unit's backward runs, and reductions and
    # all-gathers go round a ring of sends and receives, faster than gloo's own (see `gloo_comm`). Where ZeRO++
    # installed qwZ / qgZ (before this), they stay; qgZ's reductions land through the same queue. With host memory
    # reuse, the reductions' input buffers are kept for the next step (`BufferPool`).
    in_flight = InFlightReductions()
    pool = BufferPool(keep=in_flight.depth + 1) if reuse_buffers else None
    gather = RingAllGather()
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    owner: dict[int, tuple[nn.Module, nn.Parameter]] = {}
    for unit in units:  # outer units come first, so a parameter ends with the innermost unit holding it
        owner.update({id(p): (unit, p) for p in unit.parameters()})
    for unit in units:
        own = [p for u, p in owner.values() if u is unit]
        weights, gradients = quantized_collectives(unit)
        if gradients is None:
            gradients = AllReduceScatter()
            unit.set_custom_reduce_scatter(gradients)
        gradients.overlap(own, in_flight)
        gradients.pool = pool
        if weights is None:
            unit.set_custom_all_gather(gather)


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _ahead(units: list[nn.Module], sizes: dict[nn.Module, int], numel: int) -> list[nn.Module]:
    # The leading units of `units` to gather ahead: DeepSpeed's rule (`PartitionedParameterCoordinator`'s prefetch
    # loop takes the next parameter while the elements it has taken are fewer than the bucket, so the last one may
    # cross it), with whole units for parameters. A unit larger than `numel` on its own is never taken (nor any after
    # it): DeepSpeed would take only some of its parameters, and a whole 7B layer ahead is 0.2B elements more held.
    out, total = [], 0
    for unit in units:
        if total >= numel or sizes[unit] > numel:
            break
        out.append(unit)
        total += sizes[unit]
    return out


def _set_prefetch(
    model: nn.Module,
    units: list[nn.Module],
    no_backward_gather: set[nn.Module],
    kept: set[nn.Module],
    plan: ZeroPlan,
    mesh: DeviceMesh,
) -> None:
    """Prefetch the next units' weights while a unit computes: `stage3_prefetch_bucket_size` elements ahead.

    FSDP2's own (implicit) prefetch overlaps a gather with compute only on a GPU, where the all-gather runs on
    its own stream; on a CPU it issues the gather synchronously (`async_op=False`, no streams), so it overlaps
    nothing. Here each unit names the units to gather ahead of it, forward (`set_modules_to_forward_prefetch`) and,
    when blocks are resharded after forward, backward (`set_modules_to_backward_prefetch`): the next units while
    fewer than `plan.prefetch_numel` elements are taken (DeepSpeed's rule: the last may cross it; `_ahead`). On a
    CPU the gathers are then issued asynchronously (gloo runs them in its own thread while this one computes). A
    unit larger than the budget is not prefetched: on a CPU nothing is
    gathered early (one 7B Llama layer's INT4 codes: ~110 MiB more held at once), on a GPU FSDP2's implicit
    stream prefetch stays.

    Args:
        model: the root FSDP module.
        units: the other FSDP units, in forward order (input embedding, blocks, output head).
        no_backward_gather: units that `set_unshard_in_backward(False)` keeps sharded in backward.
        kept: blocks kept gathered from forward to backward (`_kept_blocks`): nothing to fetch for them.
        plan: the resolved plan.
        mesh: the data-parallel mesh.
    """
    cpu = mesh.device_type == "cpu"
    budget, sizes = plan.prefetch_numel, {u: _numel(u) for u in units}
    forward = {model: _ahead(units, sizes, budget)}
    forward |= {u: _ahead(units[i + 1 :], sizes, budget) for i, u in enumerate(units)}
    backward: dict[nn.Module, list[nn.Module]] = {}
    if plan.reshard_after_forward is not False:
        # Backward runs the units in reverse; a frozen embedding that skips its backward gather is never fetched,
        # and a kept block is still gathered: the budget goes to the units after it that need a gather.
        order = [u for u in reversed(units) if u not in no_backward_gather]
        backward = {model: _ahead([u for u in order if u not in kept], sizes, budget)}
        for i, unit in enumerate(order):
            backward[unit] = _ahead([u for u in order[i + 1 :] if u not in kept], sizes, budget)
    prefetching = any(forward.values()) or any(backward.values())
    for unit in (model, *units):
        if cpu and prefetching:
            unit._set_unshard_async_op(True)
        if forward[unit]:
            unit.set_modules_to_forward_prefetch(forward[unit])
        if backward.get(unit) or (cpu and unit in backward):
            # An explicit list replaces FSDP2's implicit prefetch; on a CPU an empty budget names the unit itself.
            unit.set_modules_to_backward_prefetch(backward[unit] or [unit])


def _whole_frozen_head(model: nn.Module, plan: ZeroPlan) -> nn.Module | None:
    """The output head to keep whole on every rank instead of sharding it, or None.

    Stage 3 gathers a sharded head for the end of forward and keeps it to the start of backward: at that moment the
    rank holds the whole head twice (FSDP2's all-gather output and the unsharded weight it is copied into) on top of
    its shard and of every activation saved for backward: +500 MiB at a Llama-2-7B shape (32000 x 4096 in bf16),
    when a rank's memory is at its fullest. A frozen head has no
    gradient to reduce-scatter and no optimizer state, so it can stay whole on every rank like a buffer: that costs
    (1 - 1/N) of its size for the whole run and removes twice its size from the peak. Only an untied head (a tied
    one is the input embedding's weight, which the root shards), wholly frozen, not quantized, and not under CPU
    offload (there the weights' home is the host, and the head would have to live on the device).
    """
    if plan.reshard_after_forward is False or plan.offload:
        return None
    ends = dict(_separate_ends(model, plan.reshard_after_forward))
    try:
        head = _names_its_ends(model).get_output_embeddings()
    except (AttributeError, NotImplementedError, TypeError):
        return None
    if not isinstance(head, nn.Module) or head not in ends:
        return None
    params = list(head.parameters())
    if not params or any(p.requires_grad or isinstance(p, QuantizedWeight) for p in params):
        return None
    return head


def _separate_ends(model: nn.Module, reshard_after_forward: bool | int) -> list[tuple[nn.Module, bool | int]]:
    """The input embedding and output head to shard as units of their own, with each one's reshard setting.

    Only at stage 3 (stage 2 keeps every weight gathered until backward anyway), only for a model that names them
    (`get_input_embeddings` / `get_output_embeddings`, as transformers and peft models do; or that holds one, as a
    LightningModule holds its transformers model), and neither when they share a parameter (tied: one parameter
    cannot live in two units, so the root keeps both).
    """
    if reshard_after_forward is False:
        return []
    model = _names_its_ends(model)
    ends = []
    for getter, after_forward in (
        ("get_input_embeddings", reshard_after_forward),
        ("get_output_embeddings", False if reshard_after_forward is True else reshard_after_forward),
    ):
        try:
            module = getattr(model, getter)()
        except (AttributeError, NotImplementedError, TypeError):
            continue
        if isinstance(module, nn.Module) and not any(isinstance(m, FSDPModule) for m in module.modules()):
            ends.append((module, after_forward))
    if len(ends) == 2 and {id(p) for p in ends[0][0].parameters()} & {id(p) for p in ends[1][0].parameters()}:
        return []
    return ends


def _names_its_ends(model: nn.Module) -> nn.Module:
    """``model`` when it names its input embedding or output head, else the first module inside it that does (a
    LightningModule's or a user's wrapper around a transformers model), else ``model``."""
    for module in model.modules():
        for getter in ("get_input_embeddings", "get_output_embeddings"):
            try:
                if isinstance(getattr(module, getter)(), nn.Module):
                    return module
            except (AttributeError, NotImplementedError, TypeError):
                continue
    return model


@torch.no_grad()
def broadcast_module_states(module: nn.Module, mesh: DeviceMesh) -> None:
    """Copy the mesh's first rank's parameters and buffers to every rank (DDP's and DeepSpeed's init sync).

    Without it, ranks that built the model from different seeds would train different replicas (stages 0/1)
    or stitch one model from different inits (stages 2/3), silently.

    Args:
        module: the model, on any device (each tensor travels through the mesh's device and back).
        mesh: the 1-D data-parallel mesh.
    """
    group = mesh.get_group()
    src = dist.get_global_rank(group, 0)
    device = mesh_device(mesh)
    for t in (*module.parameters(), *module.buffers()):
        buf = t.detach().to(device)
        dist.broadcast(buf, src=src, group=group)
        if buf.data_ptr() != t.data_ptr():
            t.detach().copy_(buf)


def _replicate(model: nn.Module, plan: ZeroPlan, mesh: DeviceMesh) -> None:
    ReplicatedState(
        model,
        mesh,
        shard=plan.stage == 1,
        compute_dtype=torch_dtype(plan.compute_dtype),
        reduce_dtype=torch_dtype(plan.reduce_dtype),
        accum_dtype=torch_dtype(plan.grad_accum_dtype),
        master_device=torch.device("cpu") if plan.offload else None,
    )


def apply_zero(
    model: nn.Module,
    config: ZeroPlan | ConfigSource,
    *,
    mesh: DeviceMesh | None = None,
    block_types: BlockTypes | None = None,
    sync_module_states: bool = True,
) -> nn.Module:
    """Make `model` a ZeRO model for the config's stage, in place, and return it.

    Stage 0: data parallel; 1: + fp32 masters and optimizer state sharded; 2: + gradients sharded (FSDP2,
    weights kept gathered from forward to backward); 3: + weights sharded (FSDP2 per block, root last; hpZ
    with `zero_hpz_partition_size` k > 1). Mixed precision, offload, FP8 layers (the config's `fp8` block) and
    ZeRO++ come from the config. Parameter names do not change, so state dicts keep the model's own keys.

    Args:
        model: the model, on CPU, its accelerator, or the meta device (stages 2/3; see `init_sharded`).
        config: a `ZeroPlan`, a `TrainingConfig`, a preset name, a DeepSpeed config dict or the path to one.
        mesh: the 1-D data-parallel mesh; default all ranks of the initialized process group.
        block_types: module classes or class names to shard as separate units (stage 2/3); default the
            `_no_split_modules` of the model or of a transformers model inside it, else the repeated children of
            its `nn.ModuleList`s.
        sync_module_states: first copy the first rank's weights and buffers to every rank, as DDP and
            DeepSpeed do (skipped for a meta-device model, which `materialize_` initialises alike everywhere).

    Raises:
        ZeroSetupError: the model has no parameters, was already applied, `block_types` matches nothing, or
            FP8 finds no eligible layer.
        ConfigError: the hpZ group size does not divide the world size, a value is still "auto", or
            `fp8.all_gather` is set without fp8, below stage 3 or with hpZ.
    """
    mesh = data_parallel_mesh(mesh)
    return apply_plan(
        model, plan_for(config, mesh), mesh=mesh, block_types=block_types, sync_module_states=sync_module_states
    )


def apply_plan(
    model: nn.Module,
    plan: ZeroPlan,
    *,
    mesh: DeviceMesh,
    block_types: BlockTypes | None = None,
    sync_module_states: bool = True,
) -> nn.Module:
    """`apply_zero` for a plan already resolved for `mesh` (`setup_zero`'s step 2): nothing is resolved here.

    Args:
        model: the model, on CPU, its accelerator, or the meta device (stages 2/3).
        plan: the resolved plan; its world size is the mesh's.
        mesh: the 1-D data-parallel mesh.
        block_types: blocks to shard separately (see `apply_zero`).
        sync_module_states: first copy the first rank's weights and buffers to every rank (see `apply_zero`).

    Raises:
        ZeroSetupError: as `apply_zero`.
    """
    _check_model(model, plan.stage)
    if plan.host_memory_reuse:
        reuse_freed_host_memory()
        warn_thread_cache()
    elif plan.device_type == "cpu":  # the config's false: memory is the limit, freed blocks go back at once
        release_freed_host_memory()
    chunked = use_chunked_loss(model) if plan.chunked_loss else 0
    blocks = find_blocks(model, block_types) if plan.stage >= 2 or block_types is not None else []
    # A meta-device model has nothing to send: `materialize_` initialises it the same on every rank.
    if sync_module_states and mesh.size() > 1 and not any(p.is_meta for p in model.parameters()):
        broadcast_module_states(model, mesh)
    _convert_layers(model, plan, mesh)
    # After the conversions: an output layer they replaced (FP8, quantized) is no plain nn.Linear to switch.
    blocked = use_blocked_logits(model) if plan.blocked_logits else 0
    _store_parameters(model, torch_dtype(plan.compute_dtype))
    if plan.stage >= 2:
        _check_quantized_shards(model, plan, mesh)
        _shard(model, plan, mesh, blocks)
        # ZeRO++ swaps the collectives FSDP2 runs, not how it shards: qwZ / qgZ install on the sharded modules.
        install_zeropp(
            model,
            mesh,
            weights_block=plan.quantized_weights_block,
            gradients_block=plan.quantized_gradients_block,
            ranks_per_node=plan.ranks_per_node,
        )
        if mesh.device_type == "cpu":
            _gloo_collectives(model, plan.host_memory_reuse)
    else:
        _replicate(model, plan, mesh)
    if mesh.get_local_rank() == 0:
        logger.info(
            "ZeRO stage %d on %d ranks: %d blocks, compute %s, reduce %s%s%s",
            plan.stage,
            mesh.size(),
            len(blocks),
            plan.compute_dtype,
            plan.reduce_dtype,
            ", causal-LM loss in row chunks (chunked_loss)" if chunked else "",
            ", logits in column blocks where faster on CPU (blocked_logits)" if blocked else "",
        )
    return model
