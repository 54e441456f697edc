"""The loss curve of a drafter training run (`DIR/loss.png`), from its metrics.jsonl rows."""

from __future__ import annotations

import logging

logger = logging.getLogger("kiln.spec_train")


def _smooth(xs: list[float], w: int) -> list[float]:
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc += x
        if i >= w:
            acc -= xs[i - w]
        out.append(acc / min(i + 1, w))
    return out


def plot_losses(history: list[dict], path: str) -> None:
    """Left: training CE per drafter position (`loss_k`, moving average) and validation CE
    (`val_loss_k`, markers). Right: validation top-1 accuracy per position (`val_acc_k`)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed (pip install 'kiln[bench]'); skipping %s", path)
        return
    val = [h for h in history if "val_loss_k" in h]
    history = [h for h in history if "loss_k" in h]  # step 0 has only the validation loss
    if not history:
        return
    steps = [h["step"] for h in history]
    n = len(history[0]["loss_k"])
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 3.6))
    w = max(1, len(history) // 20)
    for k in range(n):
        line, = ax.plot(steps, _smooth([h["loss_k"][k] for h in history], w), label=f"position {k + 1} (train)")
        if val:
            ax.plot([h["step"] for h in val], [h["val_loss_k"][k] for h in val], "o", color=line.get_color(),
                    markersize=4)
            bx.plot([h["step"] for h in val], [h["val_acc_k"][k] for h in val], "o-", color=line.get_color(),
                    label=f"position {k + 1}")
    ax.set_title(f"cross-entropy (train, {w}-step average; dots: validation)")
    ax.set_xlabel("step")
    ax.legend(fontsize=8)
    bx.set_title("validation top-1 accuracy (teacher forced)")
    bx.set_xlabel("step")
    bx.set_ylim(0, 1)
    if val:
        bx.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
