"""PNG curves of an RL run (one panel per metric family), redrawn every step."""

from __future__ import annotations

import logging
import math

logger = logging.getLogger("kiln.rl")


def plot_curves(history: list[dict], path: str) -> None:
    """reward, train-rollout mismatch, policy entropy, response length, the step time split and
    the gradient norm, one panel each."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed (pip install 'kiln[bench]'); skipping %s", path)
        return
    if not history:
        return
    steps = [h["step"] for h in history]

    def series(key: str) -> list[float]:
        return [h.get(key, math.nan) for h in history]

    fig, axes = plt.subplots(2, 3, figsize=(14, 7))
    ax = axes[0, 0]
    r = series("reward_mean")
    ax.plot(steps, r, marker=".", label="reward mean")
    if len(history) >= 5:
        ax.plot(steps[4:], [sum(r[i - 4:i + 1]) / 5 for i in range(4, len(r))], label="5-step avg")
    ax.set_title("reward")
    ax.legend()
    ax = axes[0, 1]
    kl = [max(h.get("train_rollout_kl", math.nan), 1e-12) for h in history]
    ax.plot(steps, kl, marker=".", label="train_rollout_kl")
    ax.plot(steps, [max(h.get("train_rollout_logprob_abs_diff", h.get("logprob_abs_diff", math.nan)), 1e-12)
                    for h in history], marker=".", label="|logprob diff|")
    ax.set_yscale("log")
    ax.set_title("train vs rollout mismatch")
    ax.legend()
    ax = axes[0, 2]
    ax.plot(steps, series("entropy"), marker=".")
    ax.set_title("policy entropy (nats / token)")
    ax = axes[1, 0]
    ax.plot(steps, series("response_len_mean"), marker=".")
    ax.set_title("response length (tokens)")
    ax = axes[1, 1]
    bottom = [0.0] * len(steps)
    for key, label in (("time_rollout_s", "rollout"), ("time_release_s", "release"), ("time_train_s", "train"),
                       ("time_resume_s", "resume"), ("time_sync_s", "sync")):
        if not any(key in h for h in history):
            continue
        vals = [h.get(key, 0.0) for h in history]
        ax.bar(steps, vals, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_title("step time (s)")
    ax.legend()
    ax = axes[1, 2]
    ax.plot(steps, series("grad_norm"), marker=".")
    ax.set_title("grad norm (before clipping)")
    for a in axes.flat:
        a.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
