"""Rounds 8 and 9's allocator records (results/gpu/peak_allocations_1xh200): what was alive on the GPU at a run's
peak, by the code that allocated it, beside labs.memory's prediction, part by part (chapter 1).

    peak_records.runs()                       # each recorded run: its peak, labs.memory's then and now
    peak_records.breakdown("fsdp2_ckfull_mb8_7b")   # the peak's blocks in labs.memory's parts, against its moment
    peak_records.changed("zero2_ck9_mb8_3b")  # labs.memory's parts then and now, at the moment each named

Each run folder holds the run's summary, metrics, resolved config, the instrument's file (peak_allocations_rank0.json:
every live block at the peak with its stack) and comparison.json (labs.memory's prediction as the code stood when the
run was made: "then").
"""
from __future__ import annotations

import json
import re

import matplotlib.pyplot as plt

from labs import RESULTS, memory
from labs.memory import peak
from labs.memory.estimate import from_run
from labs.runfolder import Run

RECORDS = RESULTS / "gpu" / "peak_allocations_1xh200"
PARTS = ("params", "optimizer", "grads", "buffers", "activations")


def runs() -> list[dict]:
    """One row per recorded run: the measured peak (torch.cuda.max_memory_allocated), the record's replayed peak,
    labs.memory's peak and moment when the run was made (then) and now."""
    rows = []
    for folder in sorted(p for p in RECORDS.iterdir() if (p / "comparison.json").exists()):
        then = _then(folder.name)
        now = from_run(Run(folder))
        summary = json.loads((folder / "summary.json").read_text())
        rows.append(dict(run=folder.name, case=then["case"], preset=then["preset"], micro_batch=summary["micro_batch"],
                         grad_accum=summary["gradient_accumulation"], measured_bytes=then["max_memory_allocated_bytes"],
                         replayed_bytes=then["replayed_peak_bytes"],
                         predicted_then_bytes=then["planner_prediction_bytes"],
                         moment_then=then["predicted_peak_phase"],
                         predicted_now_bytes=now.total_per_gpu_bytes, moment_now=now.peak_phase))
    return rows


def part(label: str, reduce_lines: tuple[int, int]) -> str:
    """Which of labs.memory's parts a block of an FSDP2 run belongs to, by the code that allocated it.
    FSDP2's foreach_reduce allocates twice per layer: first the reduce-scatter's input (the layer's unsharded fp32
    gradient, a buffer), then its output (the layer's gradient shard, kept until the step); `reduce_lines` are the
    two call sites' line numbers in the recorded torch, in that order. What no rule names is an activation."""
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
    """An FSDP2 record's blocks at the peak, added up into labs.memory's parts, against those parts in labs.memory's
    moment now and in the moment it named when the run was made."""
    folder = RECORDS / run
    record = json.loads((folder / "peak_allocations_rank0.json").read_text())
    lines = sorted({int(m) for g in record["groups"] for m in re.findall(r":(\d+) foreach_reduce", g["label"][:200])
                    if "allocate" in g["label"].split(" < ")[0]})
    measured = dict.fromkeys(PARTS, 0)
    for group in record["groups"]:
        measured[part(group["label"], tuple(lines[:2]))] += group["bytes"]
    return [dict(row, measured_bytes=measured[row["part"]]) for row in changed(run)]


def changed(run: str) -> list[dict]:
    """labs.memory's parts for a recorded run, then and now, each at the moment it named as the peak."""
    then = _then(run)
    now = from_run(Run(RECORDS / run))
    return [dict(part=name, then_bytes=then["predicted_phases"][then["predicted_peak_phase"]][name],
                 now_bytes=now.phases[now.peak_phase][name]) for name in PARTS]


def first_reduce(run: str) -> dict:
    """What decides when a ZeRO-2 run's first reduce bucket fills: its bucket size, whether the head is tied (a tied
    head's gradient arrives last), a decoder layer's parameters, and the layers backward finishes before then."""
    recorded = Run(RECORDS / run)
    est, dims = from_run(recorded), recorded.spec["dims"]
    acts, knobs = est.breakdown, est.breakdown["knobs"]
    layer_params = memory.layout.decoder_layer_params(dims)
    layers = peak.layers_before_first_reduce(dict(head=dims["vocab_size"] * dims["hidden_size"],
                                                  layer_params=layer_params), dims, knobs)
    return dict(bucket_elements=int(knobs["reduce_bucket_size"]), tied=dims["tie_word_embeddings"],
                layer_params=layer_params, layers_before=layers, layers=dims["num_hidden_layers"],
                kept_whole=dims["num_hidden_layers"] - acts["checkpointed_layers"],
                per_layer_activation_bytes=acts["per_layer_bytes"])


def plot(run: str, ax=None):
    """Stacked bars: the record's parts at the peak, labs.memory's when the run was made, and now."""
    rows = breakdown(run)
    then, now = _then(run)["predicted_peak_phase"], moment(run)
    ax = ax or plt.subplots(figsize=(7.5, 4.6))[1]
    columns = (("measured_bytes", "allocator record\n(replayed peak)"), ("then_bytes", f"labs.memory then\n({then})"),
               ("now_bytes", f"labs.memory now\n({now})"))
    for column, (key, _) in enumerate(columns):
        bottom = 0.0
        for i, row in enumerate(rows):
            height = row[key] / memory.GiB
            ax.bar(column, height, bottom=bottom, color=f"C{i}", label=row["part"] if column == 0 else None, width=0.6)
            if height > 3:
                ax.text(column, bottom + height / 2, f"{height:.1f}", ha="center", va="center", fontsize=8)
            bottom += height
        ax.text(column, bottom + 1, f"{bottom:.1f} GiB", ha="center")
    ax.set_ylim(0, bottom * 1.15)
    ax.set_xticks(range(len(columns)), [label for _, label in columns])
    ax.set_ylabel("GiB")
    ax.set_xlim(-0.6, len(columns) + 0.4)
    ax.legend(loc="upper right", fontsize=8)
    ax.set_title(f"What is alive at the peak: {run} (thin slices: buffers, activations)", fontsize=10)
    return ax


def moment(run: str) -> str:
    """The moment labs.memory names for the run's peak now."""
    return from_run(Run(RECORDS / run)).peak_phase


def _then(run: str) -> dict:
    return json.loads((RECORDS / run / "comparison.json").read_text())
