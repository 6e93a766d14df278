"""Figures and tables of chapter 01 (memory math), drawn from labs.memory and from measured runs."""
from __future__ import annotations


import matplotlib.pyplot as plt

from labs import activations, memory, probe

GiB, GB = memory.GiB, memory.GB


def table(rows: list[dict], columns=None, formats=None) -> str:
    """A plain aligned text table (what checked notebook cells print)."""
    columns = columns or list(rows[0])
    formats = formats or {}
    cells = [[formats.get(c, "{}").format(row[c]) for c in columns] for row in rows]
    widths = [max(len(str(c)), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    line = lambda values: "  ".join(f"{v:>{w}}" for v, w in zip(values, widths))   # noqa: E731
    return "\n".join([line(columns), line(["-" * w for w in widths])] + [line(r) for r in cells])


def layer_table(dims: dict, tokens: int, kernels="stock", dtype_bytes=2) -> str:
    """One decoder layer's saved tensors: bytes per token and MiB for `tokens` tokens."""
    rows = [dict(tensor=name, bytes_per_token=b, MiB=b * tokens / 2 ** 20)
            for name, b in activations.layer_saved_tensors(dims, kernels, dtype_bytes).items()]
    total = sum(r["bytes_per_token"] for r in rows)
    rows.append(dict(tensor="one layer", bytes_per_token=total, MiB=total * tokens / 2 ** 20))
    return table(rows, formats=dict(bytes_per_token="{:,}", MiB="{:,.1f}"))


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
    dims = memory.models.shape(preset)
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


def measured_vs_predicted(rows: list[dict], gpu_rows=None):
    """Left: bytes each CPU rank's engine holds (labs.probe) next to labs.memory's prediction, per stage and
    category (what each ZeRO stage partitions shows as the bars shrink). Right (if any GPU results): measured
    GPU peaks (torch.cuda.max_memory_allocated, max over ranks) against the predicted peak, with a ±10% band."""
    panels = 2 if gpu_rows else 1
    fig, axes = plt.subplots(1, panels, figsize=(8.5 + 5 * (panels - 1), 4), squeeze=False)
    ax = axes[0][0]
    categories = ("params", "grads", "optimizer")
    series = (("predicted (rank 0)", "predicted_bytes", 0, "#bbbbbb"), ("measured rank 0", "measured_bytes", 0, "#4c72b0"),
              ("measured rank 1", "measured_bytes", 1, "#dd8452"))
    stages = sorted({r["stage"] for r in rows})
    for i, (label, key, rank, color) in enumerate(series):
        xs, heights = [], []
        for s_i, stage in enumerate(stages):
            for c_i, category in enumerate(categories):
                row = next(r for r in rows if r["stage"] == stage and r["rank"] == rank and r["category"] == category)
                xs.append(s_i * 4 + c_i + (i - 1) * 0.27)
                heights.append(row[key] / 2 ** 20)
        ax.bar(xs, heights, width=0.27, color=color, label=label)
    ax.set_xticks([s_i * 4 + c_i for s_i in range(len(stages)) for c_i in range(3)],
                  [f"{short}\n\nZeRO-{stage}" if c_i == 1 else short for stage in stages
                   for c_i, short in enumerate(("param", "grad", "optim"))], fontsize=8)
    ax.set(ylabel="MiB per rank", title="tiny preset, 2 CPU ranks: engine tensors vs labs.memory")
    ax.title.set_fontsize(10)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    if gpu_rows:
        ax = axes[0][1]
        for row in gpu_rows:
            ax.scatter(row["predicted_bytes"] / GiB, row["measured_bytes"] / GiB, color="#c44e52")
            ax.annotate(row["name"], (row["predicted_bytes"] / GiB, row["measured_bytes"] / GiB), fontsize=6)
        _diagonal(ax, [r["predicted_bytes"] / GiB for r in gpu_rows], band=0.10)
        ax.set(xlabel="predicted peak GiB", ylabel="measured max_memory_allocated GiB", title="GPU runs (results/)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def _diagonal(ax, values, band=0.05):
    low, high = min(values) * 0.8, max(values) * 1.2
    ax.plot([low, high], [low, high], color="black", lw=1)
    ax.fill_between([low, high], [low * (1 - band), high * (1 - band)], [low * (1 + band), high * (1 + band)],
                    color="grey", alpha=0.2, label=f"±{band:.0%}")
    ax.set(xscale="log", yscale="log")
    ax.grid(alpha=0.3, which="both")


def gpu_comparisons() -> list[dict]:
    """The committed GPU benchmark runs (results/gpu/*.json, labs bench): measured peak (max over ranks of
    torch.cuda.max_memory_allocated) against labs.memory's prediction for the same configuration."""
    from labs import results

    rows = []
    for row in results.rows(results.load_all()):
        predicted = results.predicted_peak_gib(row) * GiB
        measured = row["peak_gib"] * GiB
        rows.append(dict(name=f"{row['run'][11:12]}:{row['case']}", device=f"{row['gpus']} x {row['gpu']}",
                         measured_bytes=int(measured), predicted_bytes=int(predicted), ratio=measured / predicted))
    return rows


def probe_rows(runs: dict) -> list[dict]:
    return [row for run in runs.values() for row in probe.compare(run)]


def _describe(setting: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in setting.items()) or "defaults"
