"""Figures the chapters show, drawn from run folders (matplotlib; one function per figure)."""
from __future__ import annotations

import matplotlib.pyplot as plt


def loss_curves(runs: dict, ax=None, title="training loss"):
    """runs: {label: Run}. One line per run, loss against step."""
    ax = ax or plt.subplots(figsize=(6, 3.5))[1]
    for label, run in runs.items():
        records = run.metrics
        ax.plot([r["step"] for r in records], [r["loss"] for r in records], marker=".", label=label)
    ax.set(xlabel="optimizer step", ylabel="loss (nats per token)", title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    return ax


# ---------------------------------------------------------------------------------------------- ZeRO stages
def state_bytes_bars(rows: list[dict], rank=0, ax=None, title="bytes held per rank: measured vs labs.memory"):
    """Grouped bars from labs.stages.state_rows: per ZeRO stage, params / grads / optimizer states of one rank,
    measured (solid) next to predicted (hatched)."""
    import numpy as np

    ax = ax or plt.subplots(figsize=(7, 3.8))[1]
    rows = [r for r in rows if r["rank"] == rank]
    stages = sorted({r["stage"] for r in rows})
    categories = ("params", "grads", "optimizer")
    width, x = 0.13, np.arange(len(stages))
    for i, category in enumerate(categories):
        got = [next(r["measured_bytes"] for r in rows if r["stage"] == s and r["category"] == category) for s in stages]
        want = [next(r["predicted_bytes"] for r in rows if r["stage"] == s and r["category"] == category)
                for s in stages]
        offset = (2 * i - 2.5) * width
        bars = ax.bar(x + offset, np.array(got) / 2**20, width, label=f"{category} measured")
        ax.bar(x + offset + width, np.array(want) / 2**20, width, color=bars[0].get_facecolor(), alpha=0.45,
               hatch="//", label=f"{category} predicted")
    ax.set_xticks(x, [f"ZeRO-{s}" for s in stages])
    ax.set(ylabel="MiB on this rank", title=f"{title} (rank {rank})")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7, ncols=3)
    return ax


def comm_volume_bars(rows: list[dict], ax=None, title="communication volume per rank per step"):
    """Stacked bars from labs.stages.comm_rows: the ZeRO paper's volume of each collective, in units of
    Psi x bytes per element, with the paper's 2 Psi / 3 Psi marked."""
    from labs.comm import VOLUME_FACTOR

    ax = ax or plt.subplots(figsize=(7.5, 3.5))[1]
    labels = [f"ZeRO-{r['run']}" if isinstance(r["run"], int) else str(r["run"]) for r in rows]
    x = range(len(rows))
    bottom = [0.0] * len(rows)
    for kind, factor in VOLUME_FACTOR.items():
        heights = [factor * r[f"{kind}_bytes"] / r["psi_bytes"] for r in rows]
        if any(h > 1e-3 for h in heights):
            label = f"{kind} (counts x2)" if factor == 2 else kind
            ax.bar(x, heights, bottom=bottom, width=0.6, label=label)
            bottom = [b + h for b, h in zip(bottom, heights)]
    ax.hlines([r["paper_psi"] for r in rows], [i - 0.4 for i in x], [i + 0.4 for i in x], colors="black",
              linestyles="--", label="ZeRO paper")
    ax.set_xticks(list(x), labels)
    ax.set_ylim(0, max(bottom + [r["paper_psi"] for r in rows]) * 1.15)
    ax.set(ylabel="volume / (Psi x bytes)", title=title)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return ax
