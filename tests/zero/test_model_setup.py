"""Model setup around the engine: meta-device init and materialisation, block discovery, rank-0 weight sync,
global-norm clipping, and the one-line errors of setup without a process group or with a stepped optimizer.

Most checks need no process group and run in the test process; the two that need one share a spawn of 4 gloo ranks
(hpZ needs a secondary group smaller than the world).
"""

from __future__ import annotations

import pytest
import torch
from _dist import run_ranks
from _tiny import full_params, gpt2, llama, zero_config
from torch import nn

from ds_plugin.kernels.cross_entropy import causal_lm_loss
from ds_plugin.zero.apply import apply_zero
from ds_plugin.zero.init import materialize_, meta_init
from ds_plugin.zero.mesh import ZeroSetupError
from ds_plugin.zero.optimizer import build_optimizer, clip_grad_norm_
from ds_plugin.zero.wrap import find_blocks
from tests._memory import resident_bytes

# ---------------------------------------------------------------------------------------------- no process group


def test_apply_zero_without_process_group_says_how_to_start_one():
    with pytest.raises(ZeroSetupError, match="init_process_group") as info:
        apply_zero(nn.Linear(2, 2), zero_config(3))
    assert "\n" not in str(info.value)


def test_meta_init_allocates_nothing():
    make = lambda: nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(8)])  # noqa: E731  (128 MiB of fp32)
    warm = make()  # kept alive: the builds below cannot reuse its (resident) memory
    before = resident_bytes()
    with meta_init():
        lazy = make()
    grown_meta = resident_bytes() - before
    before = resident_bytes()
    eager = make()
    grown_eager = resident_bytes() - before
    assert all(p.is_meta for p in lazy.parameters()) and not any(p.is_meta for p in eager.parameters())
    assert grown_eager > 100 * 2**20, "the measurement does not see real allocations"
    assert grown_meta < 8 * 2**20, f"meta build grew the process by {grown_meta / 2**20:.1f} MiB"
    del warm


def test_materialize_plain_model_matches_eager_construction():
    make = lambda: nn.Sequential(nn.Linear(8, 32), nn.Embedding(10, 32), nn.Linear(32, 4))  # noqa: E731
    torch.manual_seed(4)
    eager = make()
    with meta_init():
        lazy = make()
    materialize_(lazy, seed=4)
    for (name, a), (_, b) in zip(eager.named_parameters(), lazy.named_parameters(), strict=True):
        assert torch.equal(a, b), name


def test_materialize_wrapped_transformers_model_uses_its_own_init():
    # A wrapper (a LightningModule, a user's module) around a transformers model: the model inside initialises
    # as it would at the root (post_init's scheme, same seed -> same weights), the wrapper's own layers reset.
    class Wrapper(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lm = gpt2()
            self.extra = nn.Linear(4, 4)

    with meta_init():
        alone = gpt2()
        wrapped = Wrapper()
    materialize_(alone, seed=7)
    materialize_(wrapped, seed=7)
    for (name, a), (_, b) in zip(alone.named_parameters(), wrapped.lm.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    assert not any(p.is_meta for p in wrapped.extra.parameters())
    assert wrapped.extra.weight.abs().max() <= 0.5  # Linear(4, 4)'s reset bound is 1/sqrt(4)


def test_find_blocks():
    assert [type(b).__name__ for b in find_blocks(gpt2())] == ["GPT2Block", "GPT2Block"]

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Linear(4, 4)
            self.layers = nn.ModuleList([nn.Sequential(nn.Linear(4, 4)) for _ in range(3)])

    net = Net()
    assert find_blocks(net) == list(net.layers)
    assert find_blocks(net, block_types=[nn.Linear]) == [net.stem, *[layer[0] for layer in net.layers]]
    assert find_blocks(net, block_types="Sequential") == list(net.layers)
    with pytest.raises(ZeroSetupError, match="no submodule is a Conv2d"):
        find_blocks(net, block_types=[nn.Conv2d])

    class Wrapper(nn.Module):  # a user's (or Lightning's, or peft's) module around a transformers model
        def __init__(self) -> None:
            super().__init__()
            self.heads = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])  # what the fallback would also take
            self.lm = gpt2()

    assert [type(b).__name__ for b in find_blocks(Wrapper())] == ["GPT2Block", "GPT2Block"]


def test_clip_grad_norm_single_process_matches_torch():
    torch.manual_seed(0)
    a, b = nn.Linear(5, 7), nn.Linear(5, 7)
    a(torch.randn(3, 5)).pow(2).sum().backward()
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        pb.grad = pa.grad.clone()
    want = nn.utils.clip_grad_norm_(a.parameters(), 0.1)
    got = clip_grad_norm_(list(b.parameters()), 0.1)
    assert torch.allclose(got, want)
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.allclose(pa.grad, pb.grad)
    # A norm under the limit: nothing is scaled (torch multiplies by 1.0; the same bits either way).
    before = [p.grad.clone() for p in b.parameters()]
    assert torch.allclose(clip_grad_norm_(list(b.parameters()), 1e3), nn.utils.clip_grad_norm_(a.parameters(), 1e3))
    for pa, pb, old in zip(a.parameters(), b.parameters(), before, strict=True):
        assert torch.equal(pb.grad, old) and torch.equal(pa.grad, pb.grad)


def test_stepped_optimizer_cannot_be_rebuilt():
    p = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    p.grad = torch.ones(2)
    opt.step()
    with pytest.raises(ZeroSetupError, match="already stepped"):
        build_optimizer(opt, [nn.Parameter(torch.ones(2))], {id(p): nn.Parameter(torch.ones(2))})


def _unseeded_ranks(rank: int, world: int) -> dict:
    out = {}
    for stage in (1, 3):
        for sync in (True, False):
            torch.manual_seed(100 + rank)  # every rank draws a different init, as an unseeded script would
            model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
            rank0_init = [p.detach().clone() for p in model.parameters()]
            torch.distributed.broadcast_object_list(rank0_init, src=0)  # what rank 0 drew
            apply_zero(model, zero_config(stage), sync_module_states=sync)
            got = list(full_params(model).values())
            out[(stage, sync)] = all(torch.equal(a, b) for a, b in zip(got, rank0_init, strict=True))
    return out


def _four_ranks(rank: int, world: int) -> dict:
    return {"unseeded": _unseeded_ranks(rank, world), "sharded": _sharded_after_forward(rank, world)}


@pytest.fixture(scope="module")
def four_ranks() -> list[dict]:
    return run_ranks(_four_ranks, 4, timeout=240)


def test_every_rank_starts_from_rank0_weights(four_ranks):
    # DDP and DeepSpeed copy rank 0's weights at setup; without it, stage 0/1 replicas would silently diverge.
    for rank, r in enumerate(four_ranks):
        res = r["unseeded"]
        assert res[(1, True)] and res[(3, True)], res
        if rank > 0:  # with the copy turned off, ranks 1-3 keep (stage 1) or contribute (stage 3) their own draw
            assert not res[(1, False)] and not res[(3, False)], res


class _EmbedThenBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)  # owned by the root: no block claims it
        self.blocks = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return h.sum()


class _Wrapped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = llama()

    def forward(self, **kwargs):
        return self.inner(**kwargs)


def _sharded_after_forward(rank: int, world: int) -> dict:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    out = {}
    free = {"stage3_max_reuse_distance": 0}
    for name, extra in (
        ("zero3", {}),
        ("hpz", {"zero_hpz_partition_size": 2}),
        ("zero3_free", free),
        ("hpz_free", {"zero_hpz_partition_size": 2, **free}),
    ):
        torch.manual_seed(0)
        model = _EmbedThenBlocks()
        apply_zero(model, zero_config(3, **extra))
        loss = model(torch.arange(4))
        # Between forward and backward: which parameters FSDP2 holds sharded (a DTensor) or gathered.
        out[name] = {
            "root": isinstance(model.embed.weight, DTensor),
            "block": isinstance(model.blocks[0].weight, DTensor),
        }
        loss.backward()
    # A transformers model names its input embedding and output head: untied (Llama), each is a unit of its own at
    # stage 3; tied (GPT-2), the root keeps the shared weight. Stage 2 keeps every weight gathered until backward.
    x = torch.arange(8).view(1, 8)
    # Wrapped in a module that names neither (a LightningModule holding the model): found inside it all the same.
    builds = (("llama3", llama, 3), ("gpt2_3", gpt2, 3), ("llama2", llama, 2), ("wrapped3", _Wrapped, 3))
    for name, build, stage in builds:
        model = build()
        apply_zero(model, zero_config(stage))
        inner = getattr(model, "inner", model)
        out["chunked_loss", name] = inner.loss_function is causal_lm_loss
        embedding, head = inner.get_input_embeddings(), inner.get_output_embeddings()
        loss = model(input_ids=x, labels=x).loss
        between = {
            "embedding": isinstance(embedding.weight, DTensor),
            "head": isinstance(head.weight, DTensor),
            "norm": isinstance(inner.model.norm.weight if name != "gpt2_3" else inner.transformer.ln_f.weight, DTensor),
        }
        loss.backward()
        out[name] = {
            "between": between,
            "after": isinstance(head.weight, DTensor) and isinstance(embedding.weight, DTensor),
            "units": sum(isinstance(m, FSDPModule) for m in (embedding, head)),
            "grads": all(p.grad is not None for p in model.parameters()),
        }
    stock = llama()
    apply_zero(stock, {**zero_config(1), "chunked_loss": False})
    out["chunked_loss", "off"] = stock.loss_function is causal_lm_loss
    return out


def test_root_stays_gathered_for_backward_unless_hpz(four_ranks):
    # The root (embeddings, head) is needed first by backward: keeping it gathered saves an all-gather per step, as
    # FSDP2's own default does. With hpZ the root keeps a secondary shard like the blocks. The blocks of this tiny
    # model are within DeepSpeed's default reuse distance (1e9), so they stay gathered too, hpZ or not; with
    # stage3_max_reuse_distance 0 every block is freed after its forward, the first one included.
    for res in (r["sharded"] for r in four_ranks):  # hpZ needs k=2 < the world
        assert res["zero3"] == {"root": False, "block": False}, res
        assert res["hpz"] == {"root": True, "block": False}, res
        assert res["zero3_free"] == {"root": False, "block": True}, res
        assert res["hpz_free"] == {"root": True, "block": True}, res


def test_untied_embedding_and_head_are_units_of_their_own_at_stage3(four_ranks):
    # The embedding is freed after forward like a block; the head stays gathered until its backward (used last in
    # forward, first in backward), then is freed; the final norm stays in the root. Everything trains.
    for res in (r["sharded"] for r in four_ranks):
        assert res["llama3"]["between"] == {"embedding": True, "head": False, "norm": False}, res
        assert res["llama3"]["units"] == 2 and res["llama3"]["after"], res
        assert res["wrapped3"] == res["llama3"], res
        # Tied (GPT-2): one weight, kept by the root and gathered from forward to backward.
        assert res["gpt2_3"]["between"] == {"embedding": False, "head": False, "norm": False}, res
        assert res["gpt2_3"]["units"] == 0, res
        # Stage 2: nothing is freed between forward and backward, so nothing is split off.
        assert res["llama2"]["between"] == {"embedding": False, "head": False, "norm": False}, res
        assert res["llama2"]["units"] == 0, res
        assert all(res[k]["grads"] for k in ("llama3", "gpt2_3", "llama2", "wrapped3")), res


def test_causal_lm_loss_is_chunked_unless_the_config_says_no(four_ranks):
    # apply_zero swaps transformers' causal-LM loss for the chunked one at every stage, inside a wrapper too;
    # `chunked_loss: false` keeps transformers' own.
    for res in (r["sharded"] for r in four_ranks):
        assert all(res["chunked_loss", name] for name in ("llama3", "gpt2_3", "llama2", "wrapped3")), res
        assert res["chunked_loss", "off"] is False, res
