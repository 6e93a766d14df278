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
