"""Chapter 9's readings of round 6 (one H200, Qwen2.5-3B shape, 8 sequences of 4,096 tokens per GPU per step):
DeepSpeed's autotuner on labs' loop (`labs autotune`, runs s and v) against labs' planner, whose picks the
`labs bench` invocations t, u and w measured. Every figure is read from the files in results/gpu.

    autotune_report.experiments(autotune_report.LABS_RUN)   # the autotuner's candidates, with labs.memory's peak
    autotune_report.autotuner_estimate(autotune_report.LABS_RUN)   # what its own memory model assumed
    autotune_report.planner_picks()                         # labs' planner for the same GPU, with zero runs
"""
from __future__ import annotations

import json
import re
from pathlib import Path

from labs import RESULTS, memory
from labs.bench import autotune, planner
from labs.course import gpu_report

LABS_RUN = RESULTS / "gpu" / "2026-12-02_s_autotune_3b_1xh200"       # Liger loss and kernels, no checkpointing
STOCK_RUN = RESULTS / "gpu" / "2026-12-02_v_autotune_stock_3b_1xh200"  # HF's loss, kernels and full checkpointing
BENCH = dict(neighbours="t_autotune_neighbours_3b_1xh200", repeat="u_autotune_neighbours_repeat_3b_1xh200",
             best="w_autotune_best_3b_1xh200")
GPU_MEMORY = "H200"


def found(folder: Path) -> dict:
    return json.loads((folder / "autotune.json").read_text())


def predicted_estimate(folder: Path, experiment: str, micro_batch: int, grad_accum: int) -> memory.MemoryEstimate:
    """labs.memory's estimate for the config the autotuner ran as `experiment` (its options, shape and sequence), at
    this micro-batch and accumulation."""
    run = found(folder)
    config = json.loads((folder / "results" / experiment / "ds_config.json").read_text())
    options = run["options"]
    return memory.estimate(run["preset"], gpus_per_node=run["gpus"], seq_len=run["seq_len"], micro_batch=micro_batch,
                           grad_accum=grad_accum, activation_checkpointing=options["activation_checkpointing"],
                           loss=options["loss"], kernels=options["kernels"], ds_config=config)


def predicted_peak_gib(folder: Path, experiment: str, micro_batch: int, grad_accum: int) -> float:
    """labs.memory's peak per GPU for that config (predicted_estimate's)."""
    return predicted_estimate(folder, experiment, micro_batch, grad_accum).total_per_gpu_bytes / 2**30


def experiments(folder: Path) -> list[dict]:
    """The autotuner's candidates, read again from its results folder with today's labs.bench.autotune (the stored
    autotune.json is what the host wrote), each with labs.memory's peak for the config the autotuner really ran and
    whether it says that config fits the card (`MemoryEstimate.fits`)."""
    spec = json.loads(next((folder / "results").glob("*/labs_run/run.json")).read_text())
    rows = []
    for row in autotune.collect(folder / "results", spec)["experiments"]:
        predicted = predicted_estimate(folder, row["name"], row["micro_batch"], row["grad_accum"])
        rows.append(dict(row, predicted_gib=predicted.total_per_gpu_bytes / 2**30,
                         memory_says_fits=predicted.fits(memory.parse_bytes(GPU_MEMORY)),
                         outcome="out of memory" if "OutOfMemoryError" in row.get("error", "") else
                         ("stopped" if "error" in row else "ran")))
    return rows


def autotuner_estimate(folder: Path) -> dict:
    """What the autotuner's own memory model assumed, from its log (its "GB" are GiB: it divides by 1024^3): the
    GPU's memory, one sequence's activations, and per stage the model states it counts (the memory it says a stage
    requires minus one sequence's activations) and the largest micro-batch it expects to fit, or that it skipped
    the stage. It counts Adam as 4 + 4 + 8 bytes per parameter whenever fp16 is off (bf16 included)."""
    log = (folder / "autotune.log").read_text(errors="replace")
    gpu = _gib(*re.search(r"Memory per GPU in the system is ([\d.]+) ([KMGT]B)", log).groups())
    activation = _gib(*re.search(r"requires at least ([\d.]+) ([KMGT]B) activation memory for micro batch size 1",
                                 log).groups())
    stages = {}
    for stage, required, unit in re.findall(r"runable with ZERO (\d) \(which requires at least ([\d.]+) ([KMGT]B)", log):
        stages[int(stage)] = dict(states_gib=_gib(required, unit) - activation)
    for stage, largest in re.findall(r"Start tuning for space z(\d), calculated_max_micro_batch_size = (\d+)", log):
        stages[int(stage)]["largest_micro_batch"] = int(largest)
    for stage in re.findall(r"No need to tune Zero stage (\d)", log):
        stages[int(stage)]["skipped"] = True
    return dict(gpu_gib=gpu, activation_gib_per_sequence=activation, stages=stages)


def _gib(value: str, unit: str) -> float:
    """The autotuner's sizes in GiB: it prints binary units (1024-based) with decimal names (memory_to_string)."""
    return float(value) * 1024.0 ** ("KMGT".index(unit[0]) - 2)


def bench_rows(name: str) -> dict[str, dict]:
    return gpu_report.by_case(BENCH[name], ok_only=True)


def planner_picks(batch_per_gpu=8) -> dict[str, dict]:
    """labs' planner for this GPU and batch, with zero trial runs: each side's first choice, and labs' first choice
    within the autotuner's space (DeepSpeed ZeRO-2/3, no checkpointing: what run s tried)."""
    plans = planner.plan("qwen2.5-3b", gpus=1, gpu_memory=GPU_MEMORY, batch_per_gpu=batch_per_gpu)
    first = {side: next(p for p in plans if p["side"] == side) for side in ("stock", "labs")}
    first["labs, autotuner's space"] = next(p for p in plans if p["side"] == "labs" and "-zero" in p["case"]
                                            and "-cknone-" in p["case"])
    return first
