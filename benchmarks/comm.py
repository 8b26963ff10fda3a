"""`ds-plugin bench comm`: bytes per training step by collective and by intra/inter-node group, ZeRO-3 vs ZeRO++.

Four gloo ranks play two nodes of two ranks (LOCAL_WORLD_SIZE=2 in every rank, the variable torchrun sets).
Each config trains the same bf16 GPT-2 with AdamW; after one warm-up step the comms logger records two
steps, split into forward and backward regions, and the per-step mean is reported.

How bytes are counted: the comms logger's wire convention, i.e. what one rank sends under a ring algorithm
(all-gather: (n-1) x input; reduce-scatter: (n-1) x output; all-to-all: the input minus the chunk the rank
keeps; all-reduce: 2(n-1)/n x tensor), summed over all collectives of the step on rank 0 (every rank sends the
same amount). A collective whose group holds ranks of both nodes counts as inter-node in full; one whose group
stays inside a node counts as intra-node. Quantized collectives count their INT8/INT4 codes and bf16 scales.
Every config runs with `stage3_max_reuse_distance` 0, so each block is gathered in forward and again in backward
(what a model too big to keep them gathered in between does). Peer memory reads are off (`DS_PLUGIN_CMA=0`), so
qgZ's in-node hop is quantized, as between GPUs; on CPU ranks of one host it is summed plain by default.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
from typing import Any

import torch

from ds_plugin._argparse import ArgumentParser, count, output_file
from ds_plugin.launch import run_ranks
from ds_plugin.zero.cma import ENV as CMA_ENV

CONFIGS: dict[str, dict[str, Any]] = {
    "zero3": {"stage": 3},
    "qwz": {"stage": 3, "zero_quantized_weights": True},
    "hpz": {"stage": 3, "zero_hpz_partition_size": 2},
    "qgz": {"stage": 3, "zero_quantized_gradients": True},
    "zeropp": {
        "stage": 3,
        "zero_quantized_weights": True,
        "zero_hpz_partition_size": "auto",
        "zero_quantized_gradients": True,
    },
}
RANKS_PER_NODE = 2
WORLD = 4
GRADIENT_OPS = ("reduce_scatter", "all_to_all", "all_reduce")


def _model(n_layer: int, n_embd: int, seq: int):
    import warnings

    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel

    warnings.simplefilter("ignore")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=4, vocab_size=1024, n_positions=seq)
    return GPT2LMHeadModel(cfg)


def _spans_nodes(ranks: tuple[int, ...]) -> bool:
    return len({r // RANKS_PER_NODE for r in ranks}) > 1


def _train_step(engine, log, gen: torch.Generator, seq: int, *, logged: bool) -> None:
    x = torch.randint(0, 1024, (2, seq), generator=gen)
    with log.region("forward"):
        loss = engine(x, labels=x).loss
    with log.region("backward"):
        engine.backward(loss)
    engine.step()
    if logged:
        log.step()


def _rank_worker(rank: int, world: int, *, n_layer: int, n_embd: int, seq: int, steps: int) -> dict[str, Any]:
    import ds_plugin
    from ds_plugin.runtime.comms_logger import CommsLogger

    results: dict[str, Any] = {}
    gen = torch.Generator().manual_seed(rank)
    for name, zero in CONFIGS.items():
        model = _model(n_layer, n_embd, seq)
        params = sum(p.numel() for p in model.parameters())
        # Reuse distance 0: every block is gathered again in backward, as a big model's are (the volumes ZeRO++
        # is designed to cut). Under the default (1e9) this small model's blocks stay gathered from forward to
        # backward in every config, and no backward all-gather is left to compare.
        zero = {**zero, "stage3_max_reuse_distance": 0}
        cfg = {"zero_optimization": zero, "bf16": {"enabled": True}, "gradient_clipping": 0.0}
        engine = ds_plugin.initialize(model, cfg, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4))
        log = CommsLogger()

        # Warm-up first: lazy initialisation collectives are not part of a training step.
        _train_step(engine, log, gen, seq, logged=False)
        with log:
            for _ in range(steps):
                _train_step(engine, log, gen, seq, logged=True)
        groups = {label: ranks for label, ranks_list in log.groups().items() for ranks in ranks_list}
        inter = intra = allgather = gradient = bwd_inter_ag = 0
        for region in ("forward", "backward"):
            for (op, label), stat in log.summary(region)["total"].items():
                spans = _spans_nodes(groups[label])
                if spans:
                    inter += stat["bytes"]
                else:
                    intra += stat["bytes"]
                if op.startswith("all_gather"):
                    allgather += stat["bytes"]
                    if region == "backward" and spans:
                        bwd_inter_ag += stat["bytes"]
                elif op.startswith(GRADIENT_OPS):
                    gradient += stat["bytes"]
        results[name] = {
            "inter_node_bytes": inter // steps,
            "intra_node_bytes": intra // steps,
            "allgather_bytes": allgather // steps,
            "gradient_bytes": gradient // steps,
            "backward_inter_node_allgather_bytes": bwd_inter_ag // steps,
            "table": log.table() if rank == 0 else None,
        }
        results["_params"] = params
    return results


def run(n_layer: int = 4, n_embd: int = 256, seq: int = 128, steps: int = 2, timeout: float = 900) -> dict[str, Any]:
    """Measure every config on 4 ranks (2 simulated nodes) and return the report dict."""
    per_rank = run_ranks(
        _rank_worker,
        WORLD,
        timeout=timeout,
        # The collectives as they run between GPUs: with peer memory reads off, qgZ's in-node hop is quantized as it
        # is there (between CPU ranks of one host it is summed plain instead: `QuantizedReduceScatter.plain_in_node`).
        env={"LOCAL_WORLD_SIZE": str(RANKS_PER_NODE), CMA_ENV: "0"},
        n_layer=n_layer,
        n_embd=n_embd,
        seq=seq,
        steps=steps,
    )
    rank0 = per_rank[0]
    configs = {name: {k: v for k, v in rank0[name].items() if k != "table"} for name in CONFIGS}
    base = configs["zero3"]
    ratios = {
        "qwz_allgather_vs_zero3": configs["qwz"]["allgather_bytes"] / base["allgather_bytes"],
        "qgz_gradient_vs_zero3": configs["qgz"]["gradient_bytes"] / base["gradient_bytes"],
        "hpz_backward_inter_node_allgather_bytes": configs["hpz"]["backward_inter_node_allgather_bytes"],
        "zeropp_inter_node_vs_zero3": configs["zeropp"]["inter_node_bytes"] / base["inter_node_bytes"],
    }
    return {
        "world_size": WORLD,
        "nodes": WORLD // RANKS_PER_NODE,
        "ranks_per_node": RANKS_PER_NODE,
        "model": f"GPT2(n_layer={n_layer}, n_embd={n_embd}, seq={seq})",
        "params": rank0["_params"],
        "dtype": "bf16",
        "steps_measured": steps,
        "bytes_counted_as": (
            "bytes one rank sends per step under a ring algorithm (all-gather (n-1)x input, reduce-scatter "
            "(n-1)x output, all-to-all input minus the kept chunk), rank 0, forward + backward; a collective whose "
            "group spans both nodes counts as inter-node in full; quantized collectives count codes + bf16 scales"
        ),
        "peer_memory_reads": "off: qgZ's in-node hop quantized, as between GPUs",
        "configs": configs,
        "ratios": ratios,
        "torch": torch.__version__,
        "machine": platform.platform(),
        "date": datetime.date.today().isoformat(),
    }


def main(argv: list[str] | None = None) -> int:
    """Entry point of `ds-plugin bench comm`."""
    parser = ArgumentParser(prog="ds-plugin bench comm", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the JSON report only")
    parser.add_argument("--steps", type=count(), default=2, help="logged steps per config")
    parser.add_argument("--n-layer", type=count(), default=4)
    parser.add_argument("--n-embd", type=count(), default=256, help="GPT-2 width, a multiple of its 4 heads")
    parser.add_argument("--seq", type=count(), default=128)
    parser.add_argument("--out", type=output_file, help="also write the JSON report to this file")
    args = parser.parse_args(argv)
    if args.n_embd % 4:  # `_model` builds GPT-2 with 4 heads; the ranks would fail on it after starting up
        parser.error(f"argument --n-embd: {args.n_embd} is not a multiple of the 4 attention heads")
    report = run(args.n_layer, args.n_embd, args.seq, args.steps)
    text = json.dumps(report, indent=2)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as fh:
            fh.write(text + "\n")
    if args.json:
        print(text)
    else:
        print(f"{'config':<8}{'inter-node':>14}{'all-gather':>14}{'gradient':>14}{'bwd inter AG':>14}")
        for name, c in report["configs"].items():
            print(
                f"{name:<8}{c['inter_node_bytes']:>14,}{c['allgather_bytes']:>14,}{c['gradient_bytes']:>14,}"
                f"{c['backward_inter_node_allgather_bytes']:>14,}"
            )
        print(json.dumps(report["ratios"], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
