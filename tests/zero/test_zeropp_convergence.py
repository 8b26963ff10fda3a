"""ZeRO++ (qwZ + hpZ + qgZ) trains like ZeRO-3: 100 steps of a tiny LM on 4 ranks as 2 nodes x 2.

The data is the byte stream of examples/data/tiny_corpus.txt, so there is something to learn and the final
losses mean something (random tokens would pin every run at log(vocab) and make the comparison empty).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ds_plugin.launch import run_ranks

pytestmark = [pytest.mark.slow, pytest.mark.long]

CORPUS = Path(__file__).resolve().parents[2] / "examples" / "data" / "tiny_corpus.txt"
STEPS, SEQ, PER_RANK = 100, 32, 8
# Measured (torch 2.13, CPU; the first 100 steps of a 200-step run are this run: constant lr, per-step batches): at
# step 100 ZeRO-3's mean loss is at 0.49 of its start (limit 0.75) and ZeRO++'s last-20 mean is within 0.68% (bf16)
# and 0.32% (fp16) of ZeRO-3's (limit 1%). At 200 steps the bf16 gap was 1.14%: bf16 drift grows with the steps.
# A run that does not step stays near 1.0 of its start and fails the first check.


def _batch(data: torch.Tensor, step: int, rank: int, world: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    starts = torch.randint(0, len(data) - SEQ, (world * PER_RANK,), generator=g)[rank::world]
    return torch.stack([data[s : s + SEQ] for s in starts.tolist()])


def _worker(rank: int, world: int) -> dict:
    import warnings

    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel

    import ds_plugin

    warnings.simplefilter("ignore")
    transformers.logging.set_verbosity_error()
    data = torch.frombuffer(bytearray(CORPUS.read_bytes()), dtype=torch.uint8).long()
    zeropp = {"zero_quantized_weights": True, "zero_hpz_partition_size": "auto", "zero_quantized_gradients": True}
    out = {}
    for dtype in ("bf16", "fp16"):
        for name, extra in (("zero3", {}), ("zeropp", zeropp)):
            torch.manual_seed(0)
            cfg = GPT2Config(
                n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=SEQ, bos_token_id=0, eos_token_id=0
            )
            config = {
                "zero_optimization": {"stage": 3, **extra},
                dtype: {"enabled": True},
                "gradient_clipping": 1.0,
            }
            engine = ds_plugin.initialize(
                GPT2LMHeadModel(cfg), config, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3)
            )
            losses = []
            for step in range(STEPS):
                x = _batch(data, step, rank, world)
                loss = engine(input_ids=x, labels=x).loss
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
            out[dtype, name] = losses
    return out


@pytest.mark.timeout(900)
def test_zeropp_converges_like_zero3():
    # Peer memory reads off: qgZ quantizes its in-node hop too, as between GPUs (the harder case; between CPU ranks
    # of one host that hop is summed plain, which only removes rounding).
    results = run_ranks(_worker, 4, timeout=850, env={"LOCAL_WORLD_SIZE": "2", "DS_PLUGIN_CMA": "0"})
    for dtype in ("bf16", "fp16"):
        # Each rank's own loss differs (different data); average the last 20 steps over all ranks.
        final = {
            name: sum(sum(r[dtype, name][-20:]) / 20 for r in results) / len(results) for name in ("zero3", "zeropp")
        }
        first = sum(r[dtype, "zero3"][0] for r in results) / len(results)
        assert final["zero3"] < 0.75 * first, (dtype, first, final)  # it really learned something
        assert abs(final["zeropp"] - final["zero3"]) / final["zero3"] < 0.01, (dtype, final)
