"""Figures of measured runs, drawn from run folders and recorded results (matplotlib; one function per idea).
Figures of the memory model alone are in labs.course.memory_figures."""
from __future__ import annotations

import matplotlib.pyplot as plt

from labs.instruments.comm import VOLUME_FACTOR


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


def loss_and_rate(run, ax=None, title="loss and the learning rate each step used"):
    """One run's loss per step, and on a second axis the learning rate each step's update used; the steps whose loss
    was computed on the initial weights (every earlier update had rate 0) are shaded."""
    ax = ax or plt.subplots(figsize=(6, 3.5))[1]
    steps, rates = [r["step"] for r in run.metrics], [r["lr"] for r in run.metrics]
    initial = [s for s, earlier in zip(steps, (rates[:i] for i in range(len(rates)))) if not any(earlier)]
    ax.axvspan(min(steps) - 0.5, max(initial) + 0.5, color="#ddd", label="loss on the initial weights")
    ax.plot(steps, [r["loss"] for r in run.metrics], marker=".", color="C0", label="loss")
    ax.set(xlabel="optimizer step", ylabel="loss (nats per token)", title=title)
    rate_ax = ax.twinx()
    rate_ax.plot(steps, rates, marker="s", markersize=3, color="C3", alpha=0.7, label="learning rate used")
    rate_ax.set_ylabel("learning rate")
    rate_ax.set_ylim(bottom=0)
    lines, labels = [a + b for a, b in zip(ax.get_legend_handles_labels(), rate_ax.get_legend_handles_labels())]
    ax.legend(lines, labels, fontsize=8, loc="lower left")
    ax.grid(alpha=0.3)
    return ax


def pair_gaps(pairs: dict, ax=None, floor=1e-6, tolerances=None,
              title="|loss difference| per step, one lever at a time"):
    """pairs: {label: (run, reference)}; the absolute loss difference at every common step, on a symmetric-log axis
    (linear below `floor`) so that exact zeros, bit-identical runs, stay on the plot. tolerances: {label: one bound
    per step}, drawn dashed in the pair's colour where it is above 0."""
    ax = ax or plt.subplots(figsize=(6, 3.5))[1]
    for i, (label, (run, reference)) in enumerate(pairs.items()):
        base = {r["step"]: r["loss"] for r in reference.metrics}
        steps = [r["step"] for r in run.metrics if r["step"] in base]
        ax.plot(steps, [abs(r["loss"] - base[r["step"]]) for r in run.metrics if r["step"] in base],
                marker="ox^sv"[i % 5], markersize=5 + 2 * (len(pairs) - i), alpha=0.8, color=f"C{i}", label=label)
        bound = (tolerances or {}).get(label)
        if bound:
            above = [(step, b) for step, b in zip(steps, bound) if b > 0]
            if above:
                ax.plot(*zip(*above), ls="--", color=f"C{i}", alpha=0.8, label=f"tolerance: {label}")
    ax.set_yscale("symlog", linthresh=floor)
    ax.set_ylim(bottom=0)
    ax.set(xlabel="optimizer step", ylabel="|difference| (nats per token)", title=title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")       # the gaps open late and high: the early steps sit on zero
    return ax


def throughput_bars(rows: list[dict], labels: list[str], ax=None, title="tokens/s per GPU"):
    """Bars of tokens/s per GPU with the MFU written on each bar."""
    ax = ax or plt.subplots(figsize=(7, 3.5))[1]
    values = [r["tokens_per_s_per_gpu"] for r in rows]
    bars = ax.barh(labels, values, color=["#888" if "stock" in label else "#2a7" for label in labels])
    for bar, row in zip(bars, rows):
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {row['mfu']:.1%} MFU", va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set(xlabel="tokens/s per GPU", title=title, xlim=(0, max(values) * 1.25))
    ax.grid(axis="x", alpha=0.3)
    return ax


def time_breakdown(rows: list[dict], labels: list[str], ax=None, title="where a step's time goes (per 8k tokens)"):
    """Stacked bars from DeepSpeed's wall_clock_breakdown timers, scaled to the same tokens per GPU, so runs with
    different micro-batches compare: forward, backward, optimizer step, and the rest (data, logging, sync)."""
    ax = ax or plt.subplots(figsize=(7, 3.2))[1]
    per = 8192
    left = [0.0] * len(rows)
    for key, color in (("fwd_ms", "#4a90d9"), ("bwd_ms", "#e8a33d"), ("step_ms", "#c2452d"), ("other_ms", "#bbb")):
        widths = []
        for row in rows:
            scale = per / (row["tokens_per_step"] / row["gpus"])
            timed = sum(row[k] or 0 for k in ("fwd_ms", "bwd_ms", "step_ms"))
            value = max(0.0, row["step_s"] * 1000 - timed) if key == "other_ms" else (row[key] or 0)
            widths.append(value * scale)
        ax.barh(labels, widths, left=left, color=color, label=key[:-3])
        left = [a + b for a, b in zip(left, widths)]
    ax.invert_yaxis()
    ax.set(xlabel="milliseconds per 8,192 tokens per GPU", title=title)
    ax.legend(ncols=4, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.22), frameon=False)
    return ax


def predicted_vs_measured(measured: list[float], predicted: list[float], labels: list[str], ax=None, band=0.10,
                          unit="GiB", title="peak memory: labs.memory versus measured", label_off=0.05):
    """Scatter of predicted against measured values, the diagonal and a +-band (log axes when the values span
    more than a factor of 20, as CPU MiB and GPU GiB do). Only the points further than `label_off` from the
    diagonal are named (the rest would pile up on one another); the legend says how many points there are."""
    ax = ax or plt.subplots(figsize=(5, 5))[1]
    low, high = min(measured + predicted), max(measured + predicted)
    log = high / max(low, 1e-9) > 20
    low, top = (low * 0.7, high * 1.4) if log else (0, high * 1.1)
    ax.fill_between([low, top], [low * (1 - band), top * (1 - band)], [low * (1 + band), top * (1 + band)],
                    color="#2a7", alpha=0.12, label=f"within {band:.0%}")
    ax.plot([low, top], [low, top], color="#888", lw=1)
    ax.scatter(measured, predicted, color="#2a7", zorder=3, label=f"{len(measured)} cases")
    named = sorted((abs(y / x - 1), x, y, label) for x, y, label in zip(measured, predicted, labels)
                   if x and abs(y / x - 1) > label_off)
    for i, (_, x, y, label) in enumerate(named):
        ax.annotate(label, (x, y), fontsize=7, xytext=(6, -10 - 9 * (i % 3)), textcoords="offset points",
                    arrowprops=dict(arrowstyle="-", color="#999", lw=0.5))
    ax.set(xlabel=f"measured ({unit})", ylabel=f"predicted ({unit})", title=title, xlim=(low, top), ylim=(low, top))
    if log:
        ax.set(xscale="log", yscale="log")
    ax.grid(alpha=0.3, which="both")
    ax.legend(loc="upper left", fontsize=8, title_fontsize=7,
              title=f"named: off by more than {label_off:.0%}" if named else f"none off by more than {label_off:.0%}")
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


# ---------------------------------------------------------------------------------------------- FSDP2 vs ZeRO
def loss_gap(differences: dict, tolerances: dict, ax=None, title="|loss FSDP2 - loss DeepSpeed| per step"):
    """differences: {label: [|difference| per step]}, tolerances: {label: tolerance}. One line per pair on a log
    axis (exact agreement drawn at the bottom), its tolerance dashed in the same colour."""
    ax = ax or plt.subplots(figsize=(6, 3.2))[1]
    floor = 1e-7
    for label, values in differences.items():
        line, = ax.plot(range(1, len(values) + 1), [max(v, floor) for v in values], marker=".", label=label)
        ax.axhline(tolerances[label], color=line.get_color(), linestyle="--", lw=1)
    ax.set(yscale="log", xlabel="optimizer step", ylabel="|difference| (nats)", title=title)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, title=f"dashed: bf16 tolerance; at {floor:.0e}: exactly 0", title_fontsize=7)
    return ax


def held_bytes_pairs(rows: list[dict], ax=None, title="bytes each rank holds after backward (rank 0)"):
    """Stacked bars from labs.course.fsdp_vs_zero.held_rows: for every row of the mapping, FSDP2 next to DeepSpeed,
    parameters / gradients / optimizer states in MiB, with labs.memory's predicted total as a black tick."""
    ax = ax or plt.subplots(figsize=(8, 3.6))[1]
    names = list(dict.fromkeys(r["row"] for r in rows))
    colors = {"params_bytes": "#4a90d9", "grads_bytes": "#e8a33d", "optimizer_bytes": "#c2452d"}
    for i, name in enumerate(names):
        for j, engine in enumerate(("fsdp2", "deepspeed")):
            row = next(r for r in rows if r["row"] == name and r["engine"] == engine)
            x, bottom = i + (j - 0.5) * 0.38, 0.0
            for key, color in colors.items():
                ax.bar(x, row[key] / 2**20, 0.36, bottom=bottom, color=color, hatch="" if j == 0 else "//",
                       edgecolor="white", label=key.removesuffix("_bytes") if i == 0 and j == 0 else None)
                bottom += row[key] / 2**20
            ax.hlines(row["predicted_bytes"] / 2**20, x - 0.18, x + 0.18, colors="black",
                      label="labs.memory" if i == 0 and j == 0 else None)
    ax.set_xticks(range(len(names)), [f"{n}\n(FSDP2 | DeepSpeed //)" for n in names], fontsize=7)
    ax.set(ylabel="MiB on rank 0", title=title)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7)
# ---------------------------------------------------------------------------------------------- checkpointing
def recompute_tradeoff(measured: list[dict], predicted_7b: list[dict], ax=None,
                       title="activation checkpointing: memory kept vs compute added"):
    """The memory-versus-compute curve: for k checkpointed layers, the share of the decoder's saved activations
    still kept against the FLOPs added per step. Measured on real layers (labs.course.recompute.measured_rows)
    and, for a 7B model, from labs.memory and the FLOP formula (recompute.qwen7b_rows)."""
    ax = ax or plt.subplots(figsize=(6, 3.8))[1]
    x = [100 * r["extra_compute"] for r in measured]
    y = [100 * r["saved_fraction"] for r in measured]
    ax.plot(x, y, marker="o", color="#2a7", label=f"tiny layers, measured (k of {measured[-1]['k']})")
    for row, xi, yi in zip(measured, x, y):       # below left, off the falling line; the 7B labels go above right
        ax.annotate(f"k={row['k']}", (xi, yi), fontsize=7, xytext=(-5, -11), textcoords="offset points",
                    ha="right", color="#2a7")
    base = predicted_7b[0]["decoder_bytes"]
    x7, y7 = [100 * r["extra_compute"] for r in predicted_7b], [100 * r["decoder_bytes"] / base for r in predicted_7b]
    ax.plot(x7, y7, marker="s", ls="--", color="#c62",
            label=f"Qwen-7B: labs.memory bytes, formula FLOPs (k of {predicted_7b[-1]['k']})")
    for row, xi, yi in zip(predicted_7b, x7, y7):
        ax.annotate(f"k={row['k']}", (xi, yi), fontsize=7, xytext=(6, 4), textcoords="offset points", color="#c62")
    ax.set(xlabel="FLOPs added (% of the decoder's FLOPs per step, no checkpointing)",
           ylabel="saved activations kept (%)", title=title, ylim=(0, 105))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return ax


def resumed_losses(runs: dict, checkpoint_step: int, reference: str, tolerance: float, axes=None,
                   title="a crashed run, resumed and resharded"):
    """runs: {label: Run}. Left, the loss per step of each, the checkpoint the resumed runs start from marked;
    right, each run's |loss difference| from the `reference` run after the checkpoint, with the tolerance (a
    symmetric log scale: linear near 0, so an identical loss is drawn at 0 itself)."""
    axes = axes if axes is not None else plt.subplots(1, 2, figsize=(11, 3.6))[1]
    loss_curves(runs, ax=axes[0], title=title)
    axes[0].axvline(checkpoint_step, color="#888", ls=":", lw=1)
    base = dict(zip((m["step"] for m in runs[reference].metrics), runs[reference].losses))
    colors = {line.get_label(): line.get_color() for line in axes[0].get_lines()}
    for label, run in runs.items():
        if label == reference:
            continue
        steps = [m["step"] for m in run.metrics if m["step"] > checkpoint_step and m["step"] in base]
        gaps = [abs(run.losses[s - 1] - base[s]) for s in steps]
        axes[1].plot(steps, gaps, marker="o", label=label, color=colors.get(label))
    axes[1].axhline(tolerance, color="#c62", ls="--", lw=1, label=f"tolerance {tolerance:g}")
    axes[1].set_yscale("symlog", linthresh=tolerance / 1e3)
    axes[1].set(xlabel="optimizer step", ylabel=f"|loss - {reference}| (0 = identical)",
                title=f"after the checkpoint (step {checkpoint_step})", ylim=(0, tolerance * 30))
    axes[1].xaxis.get_major_locator().set_params(integer=True)
    axes[1].grid(alpha=0.3)
    axes[1].legend(fontsize=8)
    return axes


def checkpoint_sizes(rows: list[dict], ax=None, title="bytes per parameter on disk"):
    """Bars from labs.course.checkpoints.size_rows: measured bytes per parameter of each format, with labs.memory's
    bytes per parameter marked."""
    ax = ax or plt.subplots(figsize=(7, 3))[1]
    rows = [r for r in rows if r["per_param"] is not None]
    y = range(len(rows))
    ax.barh(y, [r["per_param"] for r in rows], color="#2a7", label="measured")
    ax.scatter([r["expected_per_param"] for r in rows], y, color="black", marker="|", s=300, zorder=3,
               label="expected (labs.memory's bytes per parameter)")
    ax.set_yticks(list(y), [r["format"] for r in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set(xlabel="bytes per parameter", title=title)
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    return ax


def loss_fall(curves: dict, ax=None, title="how far the loss fell", ylabel="loss fallen (nats)"):
    """curves: {label: [value per step]}. How far training moved the loss, step by step, one line per recipe or
    engine (dashed: the DeepSpeed-like ones, whose labels say "on grid" or name a ZeRO stage)."""
    ax = ax or plt.subplots(figsize=(6, 3.5))[1]
    for label, values in curves.items():
        dashed = "on grid" in label or "zero" in label.lower()
        ax.plot(range(1, len(values) + 1), values, marker=".", linestyle="--" if dashed else "-", label=label)
    ax.set(xlabel="optimizer step", ylabel=ylabel, title=title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return ax
