"""labs' copy of ZeRO-3's updated weights (labs.offload_copy: the masters page-locked in place, the cast on the GPU)
against DeepSpeed's, on chapter 10's 7B row: Qwen2.5-7B on one real H100 80GB, ZeRO-3 with 70% of the optimizer
offloaded, 8 x 1, 25 layers checkpointed, 32,768 tokens per optimizer step, 6 steps from random weights each
(results/gpu/one_card_7b_1xh100):

- round 31 (one host): the copy's parts over 10^9 parameters from pageable and from page-locked masters
  (tools/offload_step_parts.py), then the row with DeepSpeed's copy, labs' copy, and DeepSpeed's again;
- round 33 (a third machine): the committed default, LABS_OFFLOAD_COPY unset.

    offload_copy_report.run(folder)       # one run's side, copy, split, speed, timers, memory and losses
    offload_copy_report.copy_ab()         # round 31: the three runs and the copy's parts scaled to the 7B
    offload_copy_report.predicted_saving_s()   # exercise 10.5's answer, from round 29's parts
    offload_copy_report.default_run()     # round 33

labs.course.offload_vs_stock puts labs' row against stock's offload setups (rounds 32 and 34-36, labs.course
.stock_search) and shows both in chapter 10.
"""
from __future__ import annotations

import json

from labs import memory
from labs.course.one_card_runs import (H100, allocator, cpu_model, median_timers, offloaded, offloaded_params,
                                       round28_run, round_parts, sub_group_size)
from labs.metrics import read_jsonl

ROUND31 = H100 / "round31"
COPY_RUNS = ("ds_copy", "labs_copy", "ds_copy_again")                 # round 31, in the order they ran
# labs' copy stopped waiting after each sub-group at commit d913324: runs started earlier that recorded "gpu" waited
OVERLAPPED_SINCE = "2026-12-06T12:56:30+0000"
DEFAULT_RUN = H100 / "round33" / "default_copy"       # round 33: the committed default, LABS_OFFLOAD_COPY unset


def run(run_dir) -> dict:
    """One run: engine side, copy, split, offloaded share (the setting, and of the parameters), sub-group size,
    checkpointing, PyTorch's allocator setting, tokens/s, MFU, GPU peak against labs.memory, the median forward,
    backward and optimizer step (steps 3-6), and the loss at every step."""
    summary = json.loads((run_dir / "summary.json").read_text())
    spec = json.loads((run_dir / "run.json").read_text())
    recorded = json.loads((run_dir / "environment.json").read_text())
    seconds = median_timers(run_dir)
    ds_config = json.loads((run_dir / "ds_config.json").read_text())
    share, size = offloaded(ds_config), sub_group_size(ds_config)
    # Runs before labs' copy became the default (2026-12-06) recorded only the variable; since, the copy made too.
    made = recorded.get("offload_copy") or recorded.get("LABS_OFFLOAD_COPY")
    labs_copy = made in ("gpu", "gpu-wait") and not spec["stock"]
    overlapped = labs_copy and made == "gpu" and recorded.get("started", "") >= OVERLAPPED_SINCE
    return dict(run=run_dir.name, side="stock" if spec["stock"] else "labs",
                # "labs'": waiting after each sub-group's copy (rounds 31-36, and LABS_OFFLOAD_COPY=gpu-wait)
                copy="labs' overlapped" if overlapped else "labs'" if labs_copy else "DeepSpeed's",
                batch=f"{summary['micro_batch']} x {summary['gradient_accumulation']}",
                offloaded=share, sub_group_size=size, offloaded_params=offloaded_params(share, size, spec["preset"]),
                checkpointed=summary["activation_checkpointing"], loss=summary["loss"],
                allocator=allocator(run_dir, recorded),
                tokens_per_step=summary["tokens_per_step"], tokens_per_s=summary["tokens_per_s_per_gpu"],
                mfu=summary["mfu"], mfu_causal=summary["mfu_causal"],
                gpu_gib=max(summary["peak_memory_bytes"]) / 2**30,
                predicted_gpu_gib=memory.from_run(run_dir).total_per_gpu_bytes / 2**30,
                fwd_s=seconds["fwd"], bwd_s=seconds["bwd"], optimizer_step_s=seconds["step"],
                losses=[m["loss"] for m in read_jsonl(run_dir / "metrics.jsonl")])


def copy_ab() -> dict:
    """Round 31: the three runs, labs' copy over each DeepSpeed run, and the copy's parts per 10^9 parameters
    (fp32 from pageable and from page-locked masters, the page-locking itself, DeepSpeed's cast copy) scaled to the
    parameters the row offloads."""
    runs = {name: run(ROUND31 / name) for name in COPY_RUNS}
    parts = round_parts("31")
    labs_run = runs["labs_copy"]
    params = json.loads((ROUND31 / "labs_copy" / "summary.json").read_text())["params"]
    params_offloaded = labs_run["offloaded_params"] * params          # whole sub-groups: 71.4% at the 70% setting
    keys = ("copy_to_gpu_bf16_pageable_s", "copy_to_gpu_bf16_s", "copy_to_gpu_fp32_pageable_s", "register_s",
            "copy_to_gpu_fp32_registered_s", "cpu_adam_s", "cast_on_host_s")
    per = {k[:-2]: parts[k] for k in keys}
    return dict(runs=runs, cpu_model=cpu_model(ROUND31 / "cpu.txt"), offloaded_params=params_offloaded, per_1e9=per,
                scaled={k[:-2]: parts[k] * params_offloaded / parts["numel"] for k in keys},
                # GB/s of fp32 from pageable and from page-locked memory; DeepSpeed's copy as its two halves: the cast
                # on the host, then the bf16 result (a pageable temporary) crossing at the pageable rate
                pageable_gb_s=4 / per["copy_to_gpu_fp32_pageable"], locked_gb_s=4 / per["copy_to_gpu_fp32_registered"],
                cast_then_cross_s=per["cast_on_host"] + per["copy_to_gpu_fp32_pageable"] / 2,
                predicted_saving_s=predicted_saving_s(),
                speedups=[labs_run["tokens_per_s"] / runs[n]["tokens_per_s"] for n in ("ds_copy", "ds_copy_again")],
                step_saved_s=[runs[n]["optimizer_step_s"] - labs_run["optimizer_step_s"]
                              for n in ("ds_copy", "ds_copy_again")])


def predicted_saving_s() -> float:
    """Exercise 10.5's answer: round 29's parts (tools/offload_step_parts.py on another host, 10^9 parameters), the
    cast copy DeepSpeed makes less the uncast fp32 copy from page-locked memory, scaled to the parameters whose
    optimizer state round 28's 7B row offloaded (the row chapter 10's sizing section prints)."""
    parts = round_parts("29")
    _, params_offloaded, _ = round28_run()
    return (parts["copy_to_gpu_bf16_s"] - parts["copy_to_gpu_fp32_s"]) * params_offloaded / parts["numel"]


def default_run() -> dict:
    """Round 33: the committed default (LABS_OFFLOAD_COPY unset) on the same row, with what its run folder recorded."""
    recorded = json.loads((DEFAULT_RUN / "environment.json").read_text())
    return dict(run(DEFAULT_RUN), variable=recorded["LABS_OFFLOAD_COPY"], recorded_copy=recorded["offload_copy"],
                cpu_model=cpu_model(DEFAULT_RUN.parent / "cpu.txt"))
