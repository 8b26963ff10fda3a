"""FP8 training converges like BF16 on a tiny causal decoder (150 steps, CPU, single process).

The model is written here (no downloads): 2 pre-norm blocks, hidden 128, MLP 512, so every projection is a
multiple of 128 and all recipes convert the same layers; embeddings, norms, attention's softmax and the lm_head
stay in bf16 autocast as in DeepSeek-V3. The data is a fixed second-order Markov chain over 64 tokens (entropy
~1.1 nats/token), which needs attention to look one token back; every run sees the same batches from the same
initial weights, so the loss difference is the precision's alone.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ds_plugin.precision.fp8_linear import Fp8Linear, convert_to_fp8_training

VOCAB, HIDDEN, HEADS, LAYERS, MLP = 64, 128, 4, 2, 512
SEQ, BATCH, STEPS, LR = 64, 16, 150, 3e-3
# 256 second-order contexts: still learning at step 150 (and at 300), so precision differences would show in the
# loss. Measured (torch 2.13, CPU): at 150 steps the loss is at 0.40 of its start (0.32 at 300) and the last-10 mean
# of blockwise / tensorwise is within 0.15% / 0.36% of bf16's (0.10% / 0.23% at 300): the thresholds below hold
# with room at either length, and a run that does not step stays near 1.0 of its start.
CONTEXT_CLASSES = 4


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(HIDDEN)
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN, bias=False)
        self.out = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.mlp_norm = nn.LayerNorm(HIDDEN)
        self.up = nn.Linear(HIDDEN, MLP, bias=False)
        self.down = nn.Linear(MLP, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(b, t, 3, HEADS, HIDDEN // HEADS).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(attn.transpose(1, 2).reshape(b, t, HIDDEN))
        return x + self.down(F.gelu(self.up(self.mlp_norm(x))))


class TinyDecoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.pos = nn.Embedding(SEQ, HIDDEN)
        self.blocks = nn.ModuleList(_Block() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(HIDDEN)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos(torch.arange(tokens.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.norm(x))


def _markov_stream(length: int, seed: int = 0) -> torch.Tensor:
    """Token i+1 is one of 4 successors of (token i-1 mod 4, token i), drawn with fixed skewed odds."""
    g = torch.Generator().manual_seed(seed)
    successors = torch.randint(0, VOCAB, (CONTEXT_CLASSES, VOCAB, 4), generator=g).tolist()
    choices = torch.multinomial(torch.tensor([0.55, 0.25, 0.15, 0.05]), length, replacement=True, generator=g)
    stream = [0, 1]
    for c in choices[2:].tolist():
        stream.append(successors[stream[-2] % CONTEXT_CLASSES][stream[-1]][c])
    return torch.tensor(stream)


def _train(recipe: str | None, stream: torch.Tensor) -> list[float]:
    torch.manual_seed(0)
    model = TinyDecoder()
    if recipe is not None:
        convert_to_fp8_training(model, recipe)
        assert sum(isinstance(m, Fp8Linear) for m in model.modules()) == 4 * LAYERS
    # fp32 master weights; bf16 autocast for everything that is not an fp8 GEMM, in every run.
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(STEPS):
        starts = torch.randint(0, len(stream) - SEQ - 1, (BATCH,), generator=g)
        window = torch.stack([stream[s : s + SEQ + 1] for s in starts.tolist()])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(window[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), window[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@pytest.mark.slow
@pytest.mark.long
# Half the time of the 300-step version; a generous limit so a loaded machine slows the test instead of failing it.
@pytest.mark.timeout(1800)
def test_fp8_loss_tracks_bf16() -> None:
    torch.set_num_threads(2)
    stream = _markov_stream(50_000)
    final = {}
    start = time.perf_counter()
    for name in ("bf16", "blockwise", "tensorwise"):
        losses = _train(None if name == "bf16" else name, stream)
        assert losses[-1] < 0.6 * losses[0], f"{name} did not learn: {losses[0]:.3f} -> {losses[-1]:.3f}"
        final[name] = sum(losses[-10:]) / 10
    elapsed = time.perf_counter() - start
    rel = {name: abs(final[name] - final["bf16"]) / final["bf16"] for name in ("blockwise", "tensorwise")}
    print(f"final loss (mean of last 10 of {STEPS}): {final}; relative to bf16: {rel}; {elapsed:.1f} s")
    assert rel["blockwise"] < 0.01
    assert rel["tensorwise"] < 0.02
