"""Figures and tables of the memory model alone (chapter 01), drawn from labs.memory."""
from __future__ import annotations

import matplotlib.pyplot as plt

from labs import memory, models
from labs.memory import activations
from labs.table import Table

GiB, GB = memory.GiB, memory.GB


def layer_table(dims: dict, tokens: int, kernels="stock", dtype_bytes=2) -> Table:
    """One decoder layer's saved tensors: bytes per token and MiB for `tokens` tokens."""
    rows = [dict(tensor=name, bytes_per_token=b, MiB=b * tokens / 2 ** 20)
            for name, b in activations.layer_saved_tensors(dims, kernels, dtype_bytes).items()]
    total = sum(r["bytes_per_token"] for r in rows)
    rows.append(dict(tensor="one layer", bytes_per_token=total, MiB=total * tokens / 2 ** 20))
    return Table(rows, formats=dict(bytes_per_token=",", MiB=",.1f"))


def per_gpu_vs_gpus(preset="qwen2.5-7b", gpus=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024), ax=None, **setting):
    """Peak memory per GPU against the number of GPUs, one line per ZeRO stage (log-log), with the
    paper's model states dashed: ZeRO-1/2 flatten out at the parameters every GPU keeps, ZeRO-3 keeps
    falling until activations (which do not shard) dominate."""
    ax = ax or plt.subplots(figsize=(7, 4))[1]
    colors = ("#4c72b0", "#dd8452", "#55a868", "#c44e52")
    for stage, color in zip(range(4), colors):
        ests = [memory.estimate(preset, stage=stage, gpus_per_node=min(n, 8), nodes=max(1, n // 8), **setting)
                for n in gpus]
        ax.plot(gpus, [e.total_per_gpu_bytes / GiB for e in ests], marker="o", color=color,
                label=f"ZeRO-{stage} peak")
        ax.plot(gpus, [e.paper_model_states_per_gpu_bytes / GiB for e in ests], ls="--", color=color, alpha=0.7,
                label=f"ZeRO-{stage} paper model states")
    ax.axhline(memory.GPUS["H200"] / GiB, color="black", lw=1)
    ax.text(gpus[0], memory.GPUS["H200"] / GiB * 1.08, "H200", fontsize=8)
    ax.axhline(memory.GPUS["H100"] / GiB, color="grey", lw=1)
    ax.text(gpus[0], memory.GPUS["H100"] / GiB * 0.8, "H100 80GB", fontsize=8)
    ax.set(xscale="log", yscale="log", xlabel="GPUs (8 per node)", ylabel="GiB per GPU",
           title=f"{preset}: memory per GPU vs GPUs ({_describe(setting)})")
    ax.title.set_fontsize(9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, ncol=2)
    return ax


def activations_vs_seq_len(preset="qwen2.5-7b", seq_lens=(512, 1024, 2048, 4096, 8192, 16384, 32768), micro_batch=1,
                           ax=None):
    """Activation + loss memory at its worst (the loss backward) against sequence length."""
    dims = models.shape(preset)
    ax = ax or plt.subplots(figsize=(7, 4))[1]
    for checkpointing, loss, style in (("none", "hf", "-"), ("full", "hf", "--"), ("none", "liger", "-."),
                                       ("full", "liger", ":")):
        values = []
        for seq in seq_lens:
            saved = sum(activations.activation_bytes(dims, micro_batch, seq, checkpointing).values())
            values.append((saved + sum(activations.loss_bytes(dims, loss, micro_batch, seq).values())) / GiB)
        ax.plot(seq_lens, values, style, marker="o", label=f"checkpointing {checkpointing}, loss {loss}")
    ax.set(xscale="log", yscale="log", xlabel="sequence length (tokens)", ylabel="GiB per GPU",
           title=f"{preset}: saved activations + loss, micro-batch {micro_batch} (they do not shard with ZeRO)")
    ax.set_xticks(seq_lens, [f"{s // 1024}k" if s >= 1024 else str(s) for s in seq_lens])
    ax.title.set_fontsize(9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return ax


def _describe(setting: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in setting.items()) or "defaults"
