"""`python -m benchmarks.big_model`: LoRA on a Llama-2-7B-shaped checkpoint, frozen base INT4 / NF4 at ZeRO-3, on CPU.

    python -m benchmarks.big_model --json [--format int4|nf4] [--layers 32] [--world-size 2] [--device cpu|cuda]

1. A randomly initialised checkpoint shaped like Llama-2-7B (hidden 4096, 32 layers, intermediate 11008, vocab
   32000, 32 heads; bf16 safetensors shards of at most 2 GB with their index) is written once and cached under
   `$BIG_MODEL_DIR` (default `benchmarks/results/.cache/`): tensor by tensor, each drawn, written and dropped, so
   the model is never built in memory (13.5 GB of disk at full size).
2. Per format, N gloo ranks (one thread each) run `ds_plugin.load_pretrained` at ZeRO-3 with that frozen format and
   peft LoRA r=16 on every projection (bf16 compute over fp32 LoRA masters; fp32 by default on a CPU without bf16
   units, `--dtype`; activation checkpointing per decoder layer unless `--gradient-checkpointing off`;
   `host_memory_reuse` off, so freed host memory goes back to the kernel), 2 AdamW steps at sequence length 64
   (one sequence per rank), then `save_adapter`; the saved adapter file is read back and must equal the engine's
   gathered LoRA weights, bit for bit.
3. bitsandbytes + peft's own QLoRA on the same checkpoint in one process (`from_pretrained` with NF4
   `BitsAndBytesConfig`, N threads, activation checkpointing as ours), where it runs on a CPU: its peak RSS and
   step time, or the one-line reason.

JSON per format: `params`, `world_size`, `format`, `checkpoint_bytes`, `load_s` (the load, quantization included,
slowest rank), `quantize_s` (of it, the quantizer's time, slowest rank), `first_step_s`, `step_s` (the second
step), `peak_rss_mb_per_rank` (`getrusage` max RSS, imports included; `peak_rss_mb_after_phase_per_rank`: that
peak as it stood after the load, setup, first forward, first backward, each step and the save, which shows the phase
that set it), `naive_fp32_bytes_per_rank` (what `from_pretrained(dtype=float32)` holds on every rank before ZeRO
shards anything), and `adapter_reloaded`. With
`--device cuda`: one rank on NCCL, quantized on the GPU, `peak_gpu_mb` added.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch

from ds_plugin._argparse import MAX_LOCAL_RANKS, MAX_TIMEOUT_S, ArgumentParser, count, number, output_dir, output_file
from ds_plugin.checkpoint.safetensors_files import safetensors_header, write_tensor_data
from ds_plugin.launch import run_ranks

__all__ = ["llama_tensors", "main", "write_checkpoint"]

FORMATS = ("int4", "nf4")
SEVEN_B = {"hidden": 4096, "layers": 32, "intermediate": 11008, "vocab": 32000, "heads": 32}
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SHARD_BYTES = 2 * 2**30
ROOT = Path(__file__).resolve().parent


def llama_tensors(shape: dict[str, int]) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor of a `LlamaForCausalLM` of `shape` (untied head, as Llama-2), in the order transformers saves.

    Args:
        shape: hidden, layers, intermediate, vocab, heads.
    """
    h, i, v = shape["hidden"], shape["intermediate"], shape["vocab"]
    out = [("model.embed_tokens.weight", (v, h))]
    for n in range(shape["layers"]):
        p = f"model.layers.{n}."
        out += [(f"{p}self_attn.{x}_proj.weight", (h, h)) for x in "qkvo"]
        out += [(f"{p}mlp.gate_proj.weight", (i, h)), (f"{p}mlp.up_proj.weight", (i, h))]
        out += [(f"{p}mlp.down_proj.weight", (h, i))]
        out += [(f"{p}input_layernorm.weight", (h,)), (f"{p}post_attention_layernorm.weight", (h,))]
    return [*out, ("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]


def _hf_config(shape: dict[str, int]) -> dict[str, Any]:
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=shape["hidden"], num_hidden_layers=shape["layers"],
                         intermediate_size=shape["intermediate"], vocab_size=shape["vocab"],
                         num_attention_heads=shape["heads"], num_key_value_heads=shape["heads"],
                         max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False,
                         architectures=["LlamaForCausalLM"], dtype="bfloat16")  # fmt: skip
    return config.to_dict()


def _write_file(path: Path, tensors: list[tuple[str, tuple[int, ...]]], seed: int, device: str = "cpu") -> None:
    text = safetensors_header([(name, torch.bfloat16, shape) for name, shape in tensors])
    gen = torch.Generator(device).manual_seed(seed)  # on a GPU the drawing is ~100x faster than one CPU thread
    with open(path, "wb") as f:
        f.write(text)
        for name, shape in tensors:
            if name.endswith("norm.weight"):
                t = torch.ones(shape, dtype=torch.bfloat16)
            else:  # Llama's initializer_range
                t = torch.empty(shape, dtype=torch.bfloat16, device=device).normal_(0.0, 0.02, generator=gen).cpu()
            write_tensor_data(f, t)
            del t


def write_checkpoint(where: Path, shape: dict[str, int], shard_bytes: int = SHARD_BYTES, device: str = "cpu") -> Path:
    """Write the checkpoint once (into a temporary folder, renamed when complete); return its folder.

    Args:
        where: the folder the checkpoint is cached in (its name says the shape).
        shape: hidden, layers, intermediate, vocab, heads.
        shard_bytes: the most bytes per safetensors file.
        device: where the random values are drawn ("cuda" when the run has a GPU; the file is the same format).
    """
    if (where / "model.safetensors.index.json").is_file():
        return where
    tmp = where.with_name(f"{where.name}.tmp-{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    files: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, t_shape in llama_tensors(shape):
        nbytes = math.prod(t_shape) * 2
        if files[-1] and size + nbytes > shard_bytes:
            files.append([])
            size = 0
        files[-1].append((name, t_shape))
        size += nbytes
    weight_map, total = {}, 0
    for k, tensors in enumerate(files):
        name = f"model-{k + 1:05d}-of-{len(files):05d}.safetensors"
        start = time.perf_counter()
        _write_file(tmp / name, tensors, seed=k, device=device)
        print(f"big_model: wrote {name} in {time.perf_counter() - start:.1f} s", file=sys.stderr)
        weight_map.update((t, name) for t, _ in tensors)
        total += sum(math.prod(s) * 2 for _, s in tensors)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (tmp / "config.json").write_text(json.dumps(_hf_config(shape), indent=2))
    os.replace(tmp, where)
    return where


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def _lora_config():
    import peft

    return peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=list(TARGETS))


def _zero_rank(rank: int, world: int, *, path: str, fmt: str, seq: int, steps: int, out: str, device: str,
               dtype: str = "bf16", checkpointing: bool = True) -> dict:  # fmt: skip
    import warnings

    warnings.simplefilter("ignore")
    import transformers
    from safetensors.torch import load_file

    import ds_plugin
    from ds_plugin.checkpoint.hf_stream import LoadStats, load_pretrained
    from ds_plugin.peft_adapters import full_state_dict

    transformers.logging.set_verbosity_error()
    # run_ranks gives gloo 2 minutes per collective; at 7B a rank may finish its load minutes before the other and
    # then waits in setup's first collective: the engine's 10 minutes, as a real launch has them.
    set_timeout = getattr(torch.distributed.distributed_c10d, "_set_pg_timeout", None)
    if set_timeout is not None and world > 1:
        set_timeout(datetime.timedelta(minutes=10))
    # host_memory_reuse off: glibc then unmaps every freed block of 1 MiB and up (a dequantized weight, gathered codes;
    # runtime/host_memory.py), so the peak RSS measured is what is live, not the heap's high-water mark with its
    # fragments (at 4 layers of this shape 0.35 GB less per rank); steps fault their buffers in again, a little slower.
    config = {"zero_optimization": {"stage": 3, "frozen_format": fmt}, "bf16": {"enabled": dtype == "bf16"},
              "gradient_clipping": 1.0, "host_memory_reuse": False}  # fmt: skip
    import peft  # noqa: F401  (imported before the clock starts: load_s is the load, not the imports)
    from transformers import LlamaForCausalLM  # noqa: F401

    stats = LoadStats()
    torch.manual_seed(0)  # LoRA's A matrices are drawn at random: the same in every run, so runs compare loss for loss
    start = time.perf_counter()
    load_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    model = load_pretrained(path, config, peft_config=_lora_config(), dtype=load_dtype, stats=stats)
    if checkpointing:
        _checkpoint_activations(model)
    load_s = time.perf_counter() - start
    # The peak so far after each phase: which phase set the run's peak.
    peaks = {"load": _peak_rss_mb()}
    engine = ds_plugin.initialize(model, config, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-4))
    peaks["setup"] = _peak_rss_mb()
    vocab = json.loads((Path(path) / "config.json").read_text())["vocab_size"]
    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    ids = torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(rank)).to(dev)
    times, losses = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        loss = engine(input_ids=ids, labels=ids).loss
        peaks.setdefault("forward", _peak_rss_mb())
        engine.backward(loss)
        peaks.setdefault("backward", _peak_rss_mb())
        engine.step()
        peaks[f"step{len(losses) + 1}"] = _peak_rss_mb()
        losses.append(loss.item())
        if dev.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    saved = ds_plugin.save_adapter(engine, Path(out) / fmt)  # collective; rank 0 writes
    gathered = full_state_dict(engine, trainable_only=True)  # collective; whole on rank 0
    peaks["save"] = _peak_rss_mb()
    reloaded = None
    if rank == 0:
        files = load_file(Path(saved) / "adapter_model.safetensors")
        ours = {k.replace(".default.", "."): v for k, v in gathered.items()}
        reloaded = files.keys() == ours.keys() and all(torch.equal(files[k].cpu(), ours[k].cpu()) for k in files)
    result = {
        "load_s": load_s,
        "quantize_s": stats.quantize_s,
        "read_bytes": stats.read_bytes,
        "times": times,
        "losses": losses,
        "peak_rss_mb": _peak_rss_mb(),
        "peak_rss_mb_after": {k: round(v, 1) for k, v in peaks.items()},
        "adapter_reloaded": reloaded,
    }
    if dev.type == "cuda":
        result["peak_gpu_mb"] = torch.cuda.max_memory_allocated() / 2**20
    return result


def _cuda_rank(**kwargs: Any) -> dict:
    # One rank on NCCL in this process's child: the process group the GPU run needs.
    import torch.distributed as dist

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        return _zero_rank(0, 1, device="cuda", **kwargs)
    finally:
        dist.destroy_process_group()


def _cuda_worker(queue: Any, kwargs: dict) -> None:
    try:
        queue.put(("ok", _cuda_rank(**kwargs)))
    except BaseException as e:  # the parent reports it
        queue.put(("error", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"))


def _run_cuda(**kwargs: Any) -> dict:
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_cuda_worker, args=(queue, kwargs))
    proc.start()
    kind, value = queue.get()
    proc.join()
    if kind == "error":
        raise RuntimeError(value)
    return value


def _checkpoint_activations(model: Any) -> None:
    # transformers' activation checkpointing per decoder layer, non-reentrant (the inputs need no gradient), as
    # QLoRA recipes run (peft's prepare_model_for_kbit_training turns it on by default).
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def _qlora_rank(rank: int, world: int, *, path: str, seq: int, steps: int, threads: int,
                checkpointing: bool = True) -> dict:  # fmt: skip
    """bitsandbytes + peft QLoRA in one process: NF4 double-quantized base from from_pretrained, LoRA r=16."""
    import warnings

    warnings.simplefilter("ignore")
    torch.set_num_threads(threads)
    try:
        import peft
        from transformers import AutoModelForCausalLM, BitsAndBytesConfig

        quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                   bnb_4bit_compute_dtype=torch.bfloat16)  # fmt: skip
        start = time.perf_counter()
        base = AutoModelForCausalLM.from_pretrained(path, quantization_config=quant, dtype=torch.bfloat16,
                                                    device_map="cpu")  # fmt: skip
        model = peft.get_peft_model(base, _lora_config())
        if checkpointing:
            _checkpoint_activations(model)
        load_s = time.perf_counter() - start
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
        vocab = base.config.vocab_size
        ids = torch.randint(0, vocab, (world, seq), generator=torch.Generator().manual_seed(0))
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - t0)
        return {"load_s": load_s, "first_step_s": times[0], "step_s": times[-1], "peak_rss_mb": _peak_rss_mb()}
    except Exception as e:  # the benchmark reports why it cannot run here
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]}


def run(args: Any) -> dict:
    """Write (or find) the checkpoint, run every format, then QLoRA; returns the report."""
    from ds_plugin.checkpoint.hf_stream import SafetensorsCheckpoint, naive_load_bytes

    shape = {**SEVEN_B, **{k: v for k, v in vars(args).items() if k in SEVEN_B and v is not None}}
    cache = Path(os.environ.get("BIG_MODEL_DIR") or ROOT / "results" / ".cache")
    tag = "llama2-7b-shaped" if shape == SEVEN_B else "llama-" + "-".join(f"{k}{v}" for k, v in shape.items())
    torch.set_num_threads(args.world_size)
    start = time.perf_counter()
    path = write_checkpoint(cache / tag, shape, device=args.device)
    written_s = time.perf_counter() - start
    print(f"big_model: checkpoint {path} ready ({written_s:.1f} s)", file=sys.stderr)
    ckpt = SafetensorsCheckpoint(path)
    params = sum(math.prod(e.shape) for e in ckpt.entries.values())
    checkpoint_bytes = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    naive = naive_load_bytes(path, torch.float32)
    out_dir = Path(args.adapter_dir or cache / f"{tag}-adapters")
    runs = []
    for fmt in args.format:
        kwargs = {"path": str(path), "fmt": fmt, "seq": args.seq, "steps": args.steps, "out": str(out_dir),
                  "dtype": args.dtype, "checkpointing": args.gradient_checkpointing == "on"}  # fmt: skip
        if args.device == "cuda":
            ranks = [_run_cuda(**kwargs)]
        else:
            ranks = run_ranks(
                _zero_rank, args.world_size, timeout=args.timeout, start_method="spawn", device="cpu", **kwargs
            )
        print(f"big_model: {fmt} finished, {time.perf_counter() - start:.1f} s since the start", file=sys.stderr)
        runs.append({
            "params": params,
            "world_size": len(ranks),
            "format": fmt,
            "checkpoint_bytes": checkpoint_bytes,
            "load_s": round(max(r["load_s"] for r in ranks), 2),
            "quantize_s": round(max(r["quantize_s"] for r in ranks), 2),
            "first_step_s": round(max(r["times"][0] for r in ranks), 2),
            "step_s": round(max(r["times"][-1] for r in ranks), 2),
            "peak_rss_mb_per_rank": [round(r["peak_rss_mb"], 1) for r in ranks],
            "peak_rss_mb_after_phase_per_rank": [r["peak_rss_mb_after"] for r in ranks],
            "naive_fp32_bytes_per_rank": naive,
            "read_bytes_per_rank": [r["read_bytes"] for r in ranks],
            "losses": [round(x, 4) for x in ranks[0]["losses"]],
            "adapter_reloaded": ranks[0]["adapter_reloaded"],
            **({"peak_gpu_mb": round(ranks[0]["peak_gpu_mb"], 1)} if args.device == "cuda" else {}),
        })  # fmt: skip
    qlora = None
    if args.qlora:
        qlora = run_ranks(_qlora_rank, 1, timeout=args.timeout, start_method="spawn", path=str(path), seq=args.seq,
                          steps=args.steps, threads=args.world_size,
                          checkpointing=args.gradient_checkpointing == "on")[0]  # fmt: skip
    return {
        "benchmark": "big_model",
        "date": datetime.date.today().isoformat(),
        "device": args.device,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "torch": torch.__version__,
        "shape": shape,
        "checkpoint": str(path),
        "checkpoint_written_s": round(written_s, 1),
        "seq": args.seq,
        "dtype": args.dtype,
        "gradient_checkpointing": args.gradient_checkpointing == "on",
        "steps": args.steps,
        "host_memory_reuse": False,
        "runs": runs,
        "bnb_qlora": qlora,
    }


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m benchmarks.big_model` (`ds-plugin bench big-model`)."""
    parser = ArgumentParser(prog="ds-plugin bench big-model", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the JSON report only")
    parser.add_argument("--format", choices=FORMATS, action="append", help="a frozen format (repeatable; default both)")
    parser.add_argument("--layers", type=count(), help="decoder layers (default 32)")
    parser.add_argument("--hidden", type=count(), help="hidden size (default 4096; small values for tests)")
    parser.add_argument("--intermediate", type=count(), help="MLP width (default 11008)")
    parser.add_argument("--vocab", type=count(), help="vocabulary (default 32000)")
    parser.add_argument("--heads", type=count(), help="attention heads (default 32)")
    parser.add_argument("--world-size", type=count(1, MAX_LOCAL_RANKS), default=2)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: one rank on NCCL")
    parser.add_argument("--seq", type=count(), default=64)
    parser.add_argument(
        "--gradient-checkpointing",
        choices=("on", "off"),
        default="on",
        help="activation checkpointing per decoder layer, here and in the QLoRA run (on, as QLoRA recipes train)",
    )
    parser.add_argument(
        "--dtype",
        choices=("auto", "bf16", "fp32"),
        default="auto",
        help="compute dtype (auto: bf16 on a GPU or a CPU with bf16 units, else fp32, which holds the unquantized "
        "embedding, head and norms at twice the bytes)",
    )
    parser.add_argument("--steps", type=count(2), default=2)
    parser.add_argument("--no-qlora", dest="qlora", action="store_false", help="skip bitsandbytes + peft QLoRA")
    parser.add_argument(
        "--adapter-dir", type=output_dir, help="where the adapters are saved (default beside the cached checkpoint)"
    )
    parser.add_argument("--out", type=output_file, help="also write the JSON report to this file")
    parser.add_argument(
        "--timeout", type=number(0, MAX_TIMEOUT_S, above_minimum=True), default=6 * 3600.0,
        help="seconds for each run's processes",
    )  # fmt: skip
    args = parser.parse_args(argv)
    args.format = args.format or list(FORMATS)
    if args.dtype == "auto":
        from ds_plugin.runtime.cpu_bf16 import fast_compute_dtype

        args.dtype, why = fast_compute_dtype(args.device)
        print(f"big_model: computing in {args.dtype} ({why}; --dtype to choose)", file=sys.stderr)
    report = run(args)
    text = json.dumps(report, indent=2)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    if not args.json:
        for r in report["runs"]:
            print(f"{r['format']}: load {r['load_s']} s (quantize {r['quantize_s']} s), steps {r['first_step_s']} s /"
                  f" {r['step_s']} s, peak RSS per rank {r['peak_rss_mb_per_rank']} MB", file=sys.stderr)  # fmt: skip
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
