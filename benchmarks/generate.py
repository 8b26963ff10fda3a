"""Generation speed under ZeRO-3: gathered once per call (`engine.generate`) vs once per token, vs unsharded.

``ds-plugin bench generate`` starts N gloo ranks (one thread each). Every rank builds the same random Llama (fp32,
config built here, nothing downloaded), keeps an unsharded copy, and puts the model under ZeRO-3 with the engine.
Each rank then generates greedily from its own prompts, three ways, each timed (the best of ``--repeats`` after a
warm-up, all ranks timing together):

* ``per_token_gather_s``: the prepared model's own ``generate``: FSDP2 gathers every unit before each token's
  forward and frees it after (what ZeRO-3 does without help);
* ``gathered_s``: ``engine.generate``: every unit gathered once for the call (``gathered_for_generation``);
* ``unsharded_s``: the unsharded copy's ``generate`` on each rank, no collective: the single-rank speed.

``tokens_identical`` says whether all three produced the same tokens on every rank (greedy, fp32).

    ds-plugin bench generate [--json] [--world-size 2] [--hidden 512] [--layers 8] [--new-tokens 32]
"""

from __future__ import annotations

import datetime
import json
import platform
import time
from pathlib import Path
from typing import Any

import torch

from ds_plugin._argparse import MAX_LOCAL_RANKS, ArgumentParser, count, output_file
from ds_plugin.launch import run_ranks

__all__ = ["main", "run"]


def _model(hidden: int, layers: int, vocab: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 64),
        max_position_embeddings=512,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def _best(fn: Any, repeats: int) -> tuple[float, Any]:
    import torch.distributed as dist

    out = fn()  # warm-up (and the tokens compared)
    best = float("inf")
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best, out


def _rank(rank: int, world: int, *, hidden: int, layers: int, vocab: int, batch: int, prompt: int, new: int,
          repeats: int) -> dict[str, Any]:  # fmt: skip
    import copy
    import warnings

    warnings.simplefilter("ignore")
    import transformers

    import ds_plugin

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    model = _model(hidden, layers, vocab).eval()
    unsharded = copy.deepcopy(model)
    engine = ds_plugin.initialize(model, {"zero_optimization": {"stage": 3}}, optimizer=torch.optim.AdamW)
    engine.eval()
    prompts = torch.randint(3, vocab, (batch, prompt), generator=torch.Generator().manual_seed(100 + rank))
    kwargs = {"max_new_tokens": new, "min_new_tokens": new, "do_sample": False, "pad_token_id": 0}
    per_token_s, per_token = _best(lambda: engine.module.generate(prompts, **kwargs), repeats)
    gathered_s, gathered = _best(lambda: engine.generate(prompts, **kwargs), repeats)
    unsharded_s, reference = _best(lambda: unsharded.generate(prompts, **kwargs), repeats)
    return {
        "per_token_gather_s": per_token_s,
        "gathered_s": gathered_s,
        "unsharded_s": unsharded_s,
        "tokens_identical": bool(torch.equal(gathered, reference) and torch.equal(per_token, reference)),
        "params": sum(p.numel() for p in unsharded.parameters()),
    }


def run(*, world_size: int = 2, hidden: int = 512, layers: int = 8, vocab: int = 8000, batch: int = 2,
        prompt: int = 16, new_tokens: int = 32, repeats: int = 2, timeout: float = 900) -> dict[str, Any]:  # fmt: skip
    """Run the three ways on ``world_size`` ranks; the report, with each rank's times and the slowest rank's."""
    ranks = run_ranks(_rank, world_size, timeout=timeout, hidden=hidden, layers=layers, vocab=vocab, batch=batch,
                      prompt=prompt, new=new_tokens, repeats=repeats)  # fmt: skip
    slowest = {k: max(r[k] for r in ranks) for k in ("per_token_gather_s", "gathered_s", "unsharded_s")}
    return {
        "benchmark": "generate",
        "date": datetime.date.today().isoformat(),
        "device": "cpu",
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "world_size": world_size,
        "model": {"params": ranks[0]["params"], "hidden": hidden, "layers": layers, "vocab": vocab, "dtype": "fp32"},
        "batch_per_rank": batch,
        "prompt_tokens": prompt,
        "new_tokens": new_tokens,
        **slowest,
        "speedup_vs_per_token": slowest["per_token_gather_s"] / slowest["gathered_s"],
        "vs_unsharded": slowest["gathered_s"] / slowest["unsharded_s"],
        "tokens_identical": all(r["tokens_identical"] for r in ranks),
        "per_rank": [{k: v for k, v in r.items() if k != "params"} for r in ranks],
    }


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print a summary, or JSON with ``--json``.

    Args:
        argv: command-line arguments (default: ``sys.argv[1:]``).
    """
    parser = ArgumentParser(prog="ds-plugin bench generate", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--world-size", type=count(1, MAX_LOCAL_RANKS), default=2)
    parser.add_argument("--hidden", type=count(), default=512)
    parser.add_argument("--layers", type=count(), default=8)
    parser.add_argument("--vocab", type=count(), default=8000)
    parser.add_argument("--batch", type=count(), default=2, help="prompts per rank")
    parser.add_argument("--prompt", type=count(), default=16, help="prompt tokens")
    parser.add_argument("--new-tokens", type=count(), default=32)
    parser.add_argument("--repeats", type=count(), default=2, help="timed runs per way; the best counts")
    parser.add_argument("--out", type=output_file, help="also write the JSON report here")
    args = parser.parse_args(argv)
    report = run(world_size=args.world_size, hidden=args.hidden, layers=args.layers, vocab=args.vocab,
                 batch=args.batch, prompt=args.prompt, new_tokens=args.new_tokens, repeats=args.repeats)  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(
        f"{report['model']['params'] / 1e6:.1f}M params, {args.world_size} ranks, {args.new_tokens} new tokens: "
        f"per-token gathering {report['per_token_gather_s']:.2f} s, gathered once {report['gathered_s']:.2f} s "
        f"({report['speedup_vs_per_token']:.1f}x faster), unsharded {report['unsharded_s']:.2f} s "
        f"(gathered is {report['vs_unsharded']:.2f}x its time); tokens identical: {report['tokens_identical']}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
