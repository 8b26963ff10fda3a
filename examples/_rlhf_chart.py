"""The chart `examples/rlhf.py` draws of its steps (`rlhf.png`): each step's training loss, with DPO's held-out
preference accuracy and reward-model score of samples, and PPO's rollout scores and KL to the reference, beside it.
"""

from __future__ import annotations

from pathlib import Path

from _recipe_common import pyplot, save_figure


def plot(results: dict, path: Path) -> None:
    """Draw `results` (step name -> its summary: curve, metric, before, after; DPO's evals, PPO's iterations) to
    `path`; nothing without matplotlib."""
    if (plt := pyplot()) is None:
        return
    titles = {"sft": "1. SFT (LoRA, INT4 base)", "reward": "2. reward model", "ppo": "3. PPO (actor loss)",
              "dpo": "3. DPO (INT8 reference)"}  # fmt: skip
    fig, axes = plt.subplots(1, len(results), figsize=(4.7 * len(results), 3.8), squeeze=False)
    for ax, (name, r) in zip(axes[0], results.items(), strict=True):
        ax.plot(r["curve"], lw=0.8)
        ax.set(xlabel="step", ylabel="train loss (mean over ranks)")
        ax.set_title(f"{titles[name]}\n{r['metric']} {r['before']:.2f} -> {r['after']:.2f}", fontsize=10)
        if name == "dpo":
            steps, acc, _, score = zip(*r["evals"], strict=True)
            twin = ax.twinx()
            twin.plot(steps, score, "o-", color="C1", label="reward-model score of samples (before, after)")
            twin.plot(steps, acc, "s--", color="C2", label="held-out preference accuracy (before, after)")
            twin.legend(loc="center left", fontsize=8)
        if name == "ppo":
            twin = ax.twinx()
            twin.plot([i["score"] for i in r["iterations"]], color="C1", lw=0.8, label="reward-model score of rollouts")
            twin.plot([i["kl"] for i in r["iterations"]], color="C2", lw=0.8, label="KL to the reference (nats)")
            twin.legend(loc="upper left", fontsize=8)
    save_figure(fig, path)
