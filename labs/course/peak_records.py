"""Round 8's allocator records (results/gpu/peak_allocations_1xh200): what was alive on the GPU at a run's peak, by
the code that allocated it, beside labs.memory's prediction, part by part (chapter 1).

    peak_records.runs()                       # each recorded run: its peak, labs.memory's then and now
    peak_records.breakdown("fsdp2_ckfull_mb8_7b")   # the peak's blocks in labs.memory's parts, against its phase

Each run folder holds the run's summary, metrics, resolved config, the instrument's file (peak_allocations_rank0.json:
every live block at the peak with its stack) and comparison.json (the prediction labs.memory made when it ran).
"""
from __future__ import annotations

import json
import re

import matplotlib.pyplot as plt

from labs import RESULTS, memory
from labs.memory.estimate import from_run
from labs.runfolder import Run

RECORDS = RESULTS / "gpu" / "peak_allocations_1xh200"
PARTS = ("params", "optimizer", "grads", "buffers", "activations")


def runs() -> list[dict]:
    """One row per recorded run: the measured peak (torch.cuda.max_memory_allocated), the record's replayed peak,
    labs.memory's peak when the run was made and now, with the moment it names."""
    rows = []
    for folder in sorted(p for p in RECORDS.iterdir() if (p / "comparison.json").exists()):
        then = json.loads((folder / "comparison.json").read_text())
        now = from_run(Run(folder))
        summary = json.loads((folder / "summary.json").read_text())
        rows.append(dict(run=folder.name, case=then["case"], preset=then["preset"], micro_batch=summary["micro_batch"],
                         grad_accum=summary["gradient_accumulation"], measured_bytes=then["max_memory_allocated_bytes"],
                         replayed_bytes=then["replayed_peak_bytes"], predicted_then_bytes=then["planner_prediction_bytes"],
                         predicted_now_bytes=now.total_per_gpu_bytes, moment_now=now.peak_phase))
    return rows


def part(label: str, reduce_lines: tuple[int, int]) -> str:
    """Which of labs.memory's parts a block of FSDP2's Liger path belongs to, by the code that allocated it.
    FSDP2's foreach_reduce allocates twice per layer: first the reduce-scatter's input (the layer's unsharded fp32
    gradient, a buffer), then its output (the layer's gradient shard, kept until the step); `reduce_lines` are the
    two call sites' line numbers in the recorded torch, in that order."""
    if "_init_sharded_param" in label:
        return "params"                        # the fp32 shards FSDP2 builds from the model's parameters
    if "torch/optim/" in label:
        return "optimizer"                     # Adam's exp_avg and exp_avg_sq
    if "foreach_reduce" in label:
        return "grads" if f":{reduce_lines[1]} foreach_reduce" in label else "buffers"
    if "wait_for_unshard" in label or "fused_linear_cross_entropy" in label:
        return "buffers"                       # gathered bf16 parameters; the head's gradient Liger made in forward
    return "activations"                       # the layer's forward (recomputed) and backward's temporaries


def breakdown(run: str) -> list[dict]:
    """The blocks alive at `run`'s peak, added up into labs.memory's parts, against those parts in the phase of
    labs.memory's prediction (now) that matches the recorded moment."""
    folder = RECORDS / run
    record = json.loads((folder / "peak_allocations_rank0.json").read_text())
    lines = sorted({int(m) for g in record["groups"] for m in re.findall(r":(\d+) foreach_reduce", g["label"][:200])
                    if "allocate" in g["label"].split(" < ")[0]})
    measured = dict.fromkeys(PARTS, 0)
    for group in record["groups"]:
        measured[part(group["label"], tuple(lines[:2]))] += group["bytes"]
    predicted = from_run(Run(folder)).phases[moment(run)]
    return [dict(part=name, measured_bytes=measured[name], predicted_bytes=predicted[name]) for name in PARTS]


def moment(run: str) -> str:
    """The moment labs.memory names for the run's peak now."""
    return from_run(Run(RECORDS / run)).peak_phase


def plot(run: str, ax=None):
    """Stacked bars: the record's parts at the peak beside labs.memory's."""
    rows = breakdown(run)
    ax = ax or plt.subplots(figsize=(6.5, 4.2))[1]
    for column, key in enumerate(("measured_bytes", "predicted_bytes")):
        bottom = 0.0
        for i, row in enumerate(rows):
            height = row[key] / memory.GiB
            ax.bar(column, height, bottom=bottom, color=f"C{i}", label=row["part"] if column == 0 else None, width=0.55)
            bottom += height
        ax.text(column, bottom + 1, f"{bottom:.1f} GiB", ha="center")
    ax.set_ylim(0, bottom * 1.12)
    ax.set_xticks([0, 1], ["measured at the peak\n(allocator record)", f"labs.memory\n({moment(run)})"])
    ax.set_ylabel("GiB")
    ax.set_xlim(-0.6, 2.2)
    ax.legend(loc="upper right", fontsize=8)
    ax.set_title(f"What is alive at the peak: {run}")
    return ax
