"""Figures of chapter 4 (mixed precision): number formats, gradients against fp16's range, DeepSpeed's loss scale
step by step, a weight's drift with and without an fp32 master, and the model's memory by precision. One function
per idea; each draws on `ax` (or a new figure) and returns it."""
from __future__ import annotations

import math

import matplotlib.pyplot as plt
from matplotlib.ticker import MaxNLocator
import torch

COLORS = {"fp32": "#555", "fp16": "#d9822b", "bf16": "#2a7", "fp8-e4m3": "#7a5cc7", "fp8-e5m2": "#b5489a"}


def format_ranges(rows: list[dict], marks: dict | None = None, ax=None, title="what each format can hold"):
    """One bar per format on a log axis: subnormals (light) from the smallest subnormal to the smallest normal,
    normal numbers (solid) up to the largest. `marks`: {label: value} drawn as labelled vertical lines."""
    ax = ax or plt.subplots(figsize=(8, 3.2))[1]
    for i, row in enumerate(rows):
        color = COLORS.get(row["format"], "#888")
        low, normal, high = (math.log10(row[k]) for k in ("smallest_subnormal", "smallest_normal", "largest"))
        ax.barh(i, normal - low, left=low, color=color, alpha=0.35)
        ax.barh(i, high - normal, left=normal, color=color)
    for label, value in (marks or {}).items():
        ax.axvline(math.log10(value), color="#c2452d", lw=0.8, ls="--")
        ax.text(math.log10(value), 1.01, label, rotation=90, va="bottom", ha="center", fontsize=7, color="#c2452d",
                transform=ax.get_xaxis_transform())
    ax.set_yticks(range(len(rows)), [row["format"] for row in rows])
    ax.invert_yaxis()
    ax.set_xlabel("log10 of the magnitude (light: subnormal numbers, solid: normal numbers)")
    ax.set_title(title, pad=60 if marks else 6)
    ax.grid(axis="x", alpha=0.3)
    return ax


def rounding_error(curves: dict, ax=None, window=25, title="worst relative error of storing x"):
    """curves: {format: (xs, relative errors)} from labs.course.precision.relative_error, drawn as the largest error
    over each run of `window` neighbouring points (single points scatter between 0 and that bound). Overflow (inf,
    or nan for fp8 e4m3) is drawn at 10, underflow (error 1) where the curve meets 1."""
    ax = ax or plt.subplots(figsize=(7, 3.5))[1]
    for name, (xs, errors) in curves.items():
        shown = [min(e, 10.0) if math.isfinite(e) else 10.0 for e in errors]     # inf / nan: overflow, drawn at 10
        worst = [max(shown[i:i + window]) for i in range(0, len(shown), window)]
        ax.loglog(xs[::window], [max(e, 1e-9) for e in worst], label=name, color=COLORS.get(name), lw=1.2,
                  drawstyle="steps-post")
    ax.axhline(1, color="#888", lw=0.6)
    ax.text(ax.get_xlim()[0] * 10, 1.3, "stored as 0 (underflow)", fontsize=7, color="#555")
    ax.text(ax.get_xlim()[0] * 10, 13, "inf or nan (overflow)", fontsize=7, color="#555")
    ax.set(xlabel="x", ylabel="|stored - x| / x", title=title, ylim=(1e-9, 40))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncols=3)
    return ax


def gradients_vs_fp16(grads, smallest_subnormal: float, smallest_normal: float, largest: float,
                      scales=(1, 2 ** 16), ax=None, title="real gradients against fp16's range"):
    """Histogram of log2 |gradient| (nonzero entries), one per group when `grads` is {label: tensor}, with, for
    each loss scale s, the band of gradients fp16 can hold once multiplied by s: from smallest_subnormal / s (below:
    flushed to 0) to largest / s (above: inf)."""
    ax = ax or plt.subplots(figsize=(7, 3.5))[1]
    groups = grads if isinstance(grads, dict) else {"gradients": grads}
    values = [g[g != 0].abs().double().log2().numpy() for g in groups.values()]
    bins = torch.linspace(min(v.min() for v in values), max(v.max() for v in values), 121).numpy()
    for label, group, color in zip(groups, values, ("#4a90d9", "#e8a33d", "#888")):
        ax.hist(group, bins=bins, label=label, color=color, alpha=0.6)
    for scale, color in zip(scales, ("#c2452d", "#2a7")):
        shift = math.log2(scale)
        for bound, style in ((smallest_subnormal, "-"), (smallest_normal, ":"), (largest, "-")):
            ax.axvline(math.log2(bound) - shift, color=color, ls=style, lw=1)
        ax.plot([], [], color=color, label=f"fp16 range at loss scale 2^{shift:.0f} (dotted: smallest normal)")
    ax.set(xlabel="log2 |gradient|", ylabel="gradient entries" + (" (log scale)" if len(values) > 1 else ""),
           title=title, yscale="log" if len(values) > 1 else "linear")     # small groups stay visible
    ax.legend(fontsize=7, loc="upper left")
    return ax


def loss_scale_history(records: list[dict], ax=None, title="DeepSpeed's loss scale, step by step"):
    """The scale each step ran at (log2, a step line), overflowing steps marked (skipped: no weight update),
    hysteresis left after each step, and the loss on a second axis."""
    ax = ax or plt.subplots(figsize=(8, 3.5))[1]
    steps = [r["step"] for r in records]
    ax.step(steps, [math.log2(r["scale"]) for r in records], where="mid", color="#2a7", label="log2 loss scale")
    over = [r for r in records if r["overflow"]]
    ax.scatter([r["step"] for r in over], [math.log2(r["scale"]) for r in over], color="#c2452d", marker="x", s=60,
               zorder=3, label="overflow: step skipped")
    for r in records:
        ax.annotate(str(r["hysteresis"]), (r["step"], math.log2(r["scale"])), xytext=(0, 6),
                    textcoords="offset points", ha="center", fontsize=7, color="#555")
    ax.set(xlabel="step (numbers: hysteresis left after the step)", ylabel="log2 loss scale", title=title)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))          # steps and powers of two are whole numbers
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylim(min(math.log2(r["scale"]) for r in records) - 1, max(math.log2(r["scale"]) for r in records) + 1)
    twin = ax.twinx()
    twin.plot(steps, [r["loss"] for r in records], color="#888", marker=".", lw=0, label="loss of the step's batch")
    if all("probe_loss" in r for r in records):
        twin.plot(steps, [r["probe_loss"] for r in records], color="#555", lw=1,
                  label="loss on a fixed held-out batch, after the step")
    twin.set_ylabel("loss (nats per token)")
    lines = ax.get_legend_handles_labels()
    more = twin.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], fontsize=8, loc="lower left")
    ax.grid(alpha=0.3)
    return ax


def weight_drift(result: dict, ax=None, title=None):
    """A weight receiving the same small update every step (labs.course.precision.drift): exact, kept in the
    format alone, and the format's copy of an fp32 master."""
    ax = ax or plt.subplots(figsize=(7, 3.5))[1]
    rows, name = result["rows"], result["format"]
    steps = [r["step"] for r in rows]
    ax.plot(steps, [r["exact"] for r in rows], color="#555", lw=1, ls="--", label="exact")
    ax.plot(steps, [r["alone"] for r in rows], color="#c2452d", label=f"{name} alone: each update rounded away")
    ax.plot(steps, [r["copy"] for r in rows], color=COLORS.get(name), label=f"{name} copy of an fp32 master")
    ax.set(xlabel="step", ylabel="weight", title=title or f"+{result['update']:g} per step, kept in {name}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return ax


def recorded_losses(rows: list[dict], labels: list[str], ax=None, title="recorded loss per step"):
    """Loss curves of recorded GPU cases (labs.bench.results rows, which carry their per-step losses)."""
    ax = ax or plt.subplots(figsize=(6, 3.5))[1]
    for row, label in zip(rows, labels):
        ax.plot(range(1, len(row["losses"]) + 1), row["losses"], marker=".", label=label,
                color=COLORS.get(row["precision"]))
    ax.set(xlabel="optimizer step", ylabel="loss (nats per token)", title=title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return ax


def memory_by_precision(parts: dict, measured: dict | None = None, limit: tuple | None = None, ax=None,
                        title="peak per GPU by precision (labs.memory)", reserved: dict | None = None):
    """Stacked bars, one per label: {label: {part: GiB}} at the predicted peak; `measured`: {label: GiB} drawn
    as black ticks (the recorded peak allocated, where a run exists), `reserved` as grey ticks (the peak the
    caching allocator reserved); `limit`: (label, GiB) drawn as a dashed line (what a GPU can use)."""
    ax = ax or plt.subplots(figsize=(7, 3.2))[1]
    names = list(parts)
    left = [0.0] * len(names)
    colors = {"params": "#4a90d9", "grads": "#e8a33d", "optimizer": "#c2452d", "activations": "#2a7",
              "buffers": "#bbb"}
    for part, color in colors.items():
        widths = [parts[n].get(part, 0.0) for n in names]
        ax.barh(names, widths, left=left, color=color, label=part)
        left = [a + b for a, b in zip(left, widths)]
    for ticks, color in ((reserved, "#999"), (measured, "black")):
        for i, name in enumerate(names):
            if ticks and name in ticks:
                ax.plot([ticks[name]] * 2, [i - 0.4, i + 0.4], color=color, lw=2)
    if limit:
        ax.axvline(limit[1], color="#c2452d", ls="--", lw=1)
        ax.text(limit[1], len(names) - 0.5, f" {limit[0]}", color="#c2452d", fontsize=8, va="bottom")
    ax.invert_yaxis()
    ax.set(xlabel="GiB per GPU (ticks, measured on H200: black allocated, grey reserved)", title=title)
    ax.legend(ncols=5, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.25), frameon=False)
    ax.grid(axis="x", alpha=0.3)
    return ax
