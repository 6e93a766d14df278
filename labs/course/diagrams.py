"""Diagrams of how ZeRO works, drawn by code (matplotlib) so that the book and the chapters show one picture:

- `zero_stages()`: what each rank holds at ZeRO-0..3. Every cell's area is bytes: the width is the parameters
  (Psi), the heights are bytes per parameter from `labs.memory` (the ZeRO paper's 2 + 2 + K), and a rank's
  filled part is what it keeps. The numbers printed beside each row come from the same function as the boxes.
- `zero3_timeline()`: one ZeRO-3 step, layer by layer, on a communication lane and a compute lane: all-gather,
  compute, release in forward; all-gather, compute, reduce-scatter in backward; then the optimizer step; once
  without prefetch and once with it. The durations are schematic (unit lengths you can change), not measured.
"""
from __future__ import annotations

from dataclasses import dataclass

import matplotlib.pyplot as plt
from matplotlib.patches import Rectangle

from labs.memory.accounting import paper_model_states_bytes
from labs.table import Table

CATEGORIES = ("parameters", "gradients", "optimizer states")
COLORS = {"parameters": "#4c72b0", "gradients": "#dd8452", "optimizer states": "#55a868",
          "all-gather": "#4c72b0", "forward": "#8172b3", "backward": "#c44e52", "reduce-scatter": "#dd8452",
          "optimizer step": "#55a868"}


def bytes_per_param(stage: int, ranks: int, k: float = 12, param_bytes=2, grad_bytes=2) -> dict:
    """Bytes per parameter of the model that one rank holds, by category, at a ZeRO stage (the paper's accounting,
    `labs.memory.paper_model_states_bytes`, asked one category at a time). Their sum is that function's total."""
    one = dict(params=1, stage=stage, world=ranks)
    return {"parameters": paper_model_states_bytes(**one, k=0, param_bytes=param_bytes, grad_bytes=0),
            "gradients": paper_model_states_bytes(**one, k=0, param_bytes=0, grad_bytes=grad_bytes),
            "optimizer states": paper_model_states_bytes(**one, k=k, param_bytes=0, grad_bytes=0)}


def stage_table(ranks: int = 4, k: float = 12, stages=(0, 1, 2, 3)) -> Table:
    """The numbers `zero_stages` draws: bytes per parameter per rank, by category and in total."""
    rows = [dict(stage=f"ZeRO-{stage}", **bytes_per_param(stage, ranks, k),
                 total=paper_model_states_bytes(1, stage, ranks, k=k)) for stage in stages]
    return Table(rows, formats={c: "g" for c in (*CATEGORIES, "total")})


def zero_stages(ranks: int = 4, k: float = 12, stages=(0, 1, 2, 3)):
    """Rows: ZeRO stages; columns: ranks. In each cell the three model states stacked, 2, 2 and K bytes high
    (K = 12 for mixed-precision AdamW: fp32 master weights, momentum, variance) across all Psi parameters;
    the solid part is what this rank keeps: everything (replicated) or its 1/N slice (partitioned)."""
    full = bytes_per_param(0, 1, k)
    height = sum(full.values())
    fig, axes = plt.subplots(len(stages), ranks, figsize=(2.2 * ranks + 2.6, 1.55 * len(stages) + 0.9),
                             squeeze=False, sharex=True, sharey=True)
    for row, stage in enumerate(stages):
        held = bytes_per_param(stage, ranks, k)
        for rank in range(ranks):
            _stage_cell(axes[row][rank], full, held, rank, ranks)
        axes[row][0].set_ylabel(f"ZeRO-{stage}", rotation=0, ha="right", va="center", fontsize=11)
        total = paper_model_states_bytes(1, stage, ranks, k=k)
        parts = " + ".join(f"{held[c]:g}" for c in CATEGORIES)
        axes[row][-1].text(1.08, 0.5, f"{parts}\n= {total:g} bytes per\nparameter per rank",
                           transform=axes[row][-1].transAxes, va="center", fontsize=9)
    for rank in range(ranks):
        axes[0][rank].set_title(f"rank {rank}", fontsize=10)
        axes[-1][rank].set_xlabel("parameters (Psi)", fontsize=8)
    for ax in axes.flat:
        ax.set(xlim=(0, 1), ylim=(0, height), xticks=[], yticks=[])
    handles = [Rectangle((0, 0), 1, 1, color=COLORS[c]) for c in CATEGORIES]
    fig.legend(handles, [f"{c} ({full[c]:g} B/param)" for c in CATEGORIES], loc="lower center", ncol=3,
               fontsize=9, frameon=False)
    fig.suptitle(f"What each of {ranks} ranks holds at each ZeRO stage (area = bytes; solid = kept by this rank)",
                 fontsize=11)
    fig.subplots_adjust(left=0.1, right=0.8, top=0.88, bottom=0.14, wspace=0.08, hspace=0.12)
    return fig


def _stage_cell(ax, full: dict, held: dict, rank: int, ranks: int):
    """One rank at one stage: each category is a band `full[c]` high; solid over the part this rank keeps."""
    bottom = 0.0
    for category in CATEGORIES:
        band = full[category]
        ax.add_patch(Rectangle((0, bottom), 1, band, facecolor="none", edgecolor=COLORS[category], lw=0.8,
                               ls=":"))
        if held[category] >= band:                      # replicated: the whole band
            ax.add_patch(Rectangle((0, bottom), 1, band, color=COLORS[category], alpha=0.85))
        elif held[category] > 0:                        # partitioned: this rank's contiguous slice
            width = held[category] / band
            ax.add_patch(Rectangle((rank * width, bottom), width, band, color=COLORS[category], alpha=0.85))
        bottom += band


@dataclass(frozen=True)
class Event:
    lane: str           # "communication" or "compute"
    kind: str           # all-gather, forward, backward, reduce-scatter, optimizer step
    layer: int | None
    start: float
    end: float


# Schematic durations in time units: backward about twice forward; communication comparable to a forward.
DURATIONS = dict(gather=1.0, forward=1.5, backward=3.0, reduce_scatter=1.0, step=2.0)


def zero3_schedule(layers: int = 4, prefetch: bool = True, **durations) -> list[Event]:
    """A ZeRO-3 step as events on two lanes, each lane doing one thing at a time (a simple model of ZeRO-3's
    schedule, not a trace). A layer computes only once its parameters are gathered, and releases them when it ends; in backward
    its gradients are reduce-scattered when its backward ends. Without prefetch each all-gather waits for the
    previous layer's compute to end; with prefetch the next layer's all-gather is issued when the current
    layer's compute starts (one layer ahead), so it hides behind that compute. The optimizer step waits for
    the last reduce-scatter. Backward re-gathers every layer (a reuse distance of 0)."""
    t = {**DURATIONS, **durations}
    compute = [("forward", i) for i in range(layers)] + [("backward", i) for i in reversed(range(layers))]
    events, gathered = [], {}                     # gathered: position in `compute` -> its all-gather's end
    comm_free = compute_free = 0.0

    def comm(kind, layer, ready):
        nonlocal comm_free
        start = max(comm_free, ready)
        comm_free = start + t["gather" if kind == "all-gather" else "reduce_scatter"]
        events.append(Event("communication", kind, layer, start, comm_free))
        return comm_free

    for j, (phase, layer) in enumerate(compute):
        if j not in gathered:                     # not prefetched: gather now, after the previous compute
            gathered[j] = comm("all-gather", layer, compute_free)
        start = max(compute_free, gathered[j])
        compute_free = start + t[phase]
        events.append(Event("compute", phase, layer, start, compute_free))
        if prefetch and j + 1 < len(compute):
            gathered[j + 1] = comm("all-gather", compute[j + 1][1], start)
        if phase == "backward":
            comm("reduce-scatter", layer, compute_free)
    last = max(e.end for e in events)
    return events + [Event("compute", "optimizer step", None, last, last + t["step"])]


def zero3_timeline(layers: int = 4, **durations):
    """One ZeRO-3 step without and with prefetch, on the same time axis (schematic durations, see
    `zero3_schedule`). Dashed ticks mark where a layer's gathered parameters are released."""
    runs = {"without prefetch": zero3_schedule(layers, prefetch=False, **durations),
            "with prefetch (overlap)": zero3_schedule(layers, prefetch=True, **durations)}
    end = max(e.end for events in runs.values() for e in events)
    fig, axes = plt.subplots(2, 1, figsize=(11, 4.6), sharex=True)
    for ax, (title, events) in zip(axes, runs.items()):
        for e in events:
            y = 1 if e.lane == "communication" else 0
            ax.barh(y, e.end - e.start, left=e.start, height=0.6, color=COLORS[e.kind], edgecolor="white")
            label = e.kind[0].upper() + e.kind[1:3] if e.layer is None else f"{_short(e.kind)}{e.layer}"
            ax.text((e.start + e.end) / 2, y, label, ha="center", va="center", fontsize=7, color="white")
            if e.kind in ("forward", "backward"):
                ax.plot([e.end, e.end], [-0.4, 0.4], color="black", lw=0.8, ls="--")
        step_time = max(e.end for e in events)
        ax.axvline(step_time, color="black", lw=1)
        ax.set(yticks=[0, 1], yticklabels=["compute", "communication"], ylim=(-0.6, 1.6), xlim=(0, end * 1.02))
        ax.set_title(f"{title}: the step ends at {step_time:g} time units", fontsize=10, loc="left")
    t = {**DURATIONS, **durations}
    axes[-1].set_xlabel(f"time (schematic units: all-gather {t['gather']:g}, forward {t['forward']:g}, backward "
                        f"{t['backward']:g}, reduce-scatter {t['reduce_scatter']:g}, optimizer step {t['step']:g})")
    handles = [Rectangle((0, 0), 1, 1, color=COLORS[k]) for k in
               ("all-gather", "forward", "backward", "reduce-scatter", "optimizer step")]
    fig.legend(handles, ["all-gather (AG)", "forward (F)", "backward (B)", "reduce-scatter (RS)",
                         "optimizer step"], loc="lower center", ncol=5, fontsize=8, frameon=False)
    fig.suptitle(f"One ZeRO-3 step over {layers} layers: gather, compute, release (dashed), reduce-scatter",
                 fontsize=11)
    fig.subplots_adjust(left=0.11, right=0.98, top=0.86, bottom=0.2, hspace=0.45)
    return fig


def _short(kind: str) -> str:
    return {"all-gather": "AG", "forward": "F", "backward": "B", "reduce-scatter": "RS"}[kind]
