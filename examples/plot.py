"""The demo's picture: train and held-out loss, and tokens/s, per optimizer step (matplotlib, Agg)."""

from __future__ import annotations

import os
from typing import Sequence


def plot_training(path: str, train_losses: Sequence[float], held_out: Sequence[tuple[int, float]],
                  tokens_per_s: Sequence[float], title: str) -> str:
    """Write a two-panel PNG to ``path`` (directories created) and return its absolute path.

    ``train_losses[i]`` and ``tokens_per_s[i]`` belong to step ``i + 1``; ``held_out`` is a list of
    ``(step, loss)`` points.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = list(range(1, len(train_losses) + 1))
    fig, (ax_loss, ax_speed) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True,
                                            gridspec_kw={"height_ratios": [2, 1]})
    ax_loss.plot(steps, train_losses, color="tab:blue", linewidth=1.2, label="train (global batch mean)")
    if held_out:
        ax_loss.plot([s for s, _ in held_out], [v for _, v in held_out], "o-", color="tab:orange",
                     label="held-out (unseen stdlib modules)")
    ax_loss.set_ylabel("cross-entropy (nats / byte)")
    ax_loss.set_title(title, fontsize=10)
    ax_loss.grid(alpha=0.3)
    ax_loss.legend()
    ax_speed.plot(steps, tokens_per_s, color="tab:green", linewidth=1.0)
    ax_speed.set_ylabel("tokens / s")
    ax_speed.set_xlabel("optimizer step")
    ax_speed.grid(alpha=0.3)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return os.path.abspath(path)
