"""Chapter 10's readings of ZenFlow with labs.zenflow_columns (fp32 masters for the columns it updates on the GPU):
the tiny model on a CPU (results/cpu/zenflow_columns, tools/zenflow_columns_freeze.py) and round 18 on one H200
(results/gpu/zenflow_finetune_1xh200/round18, tools/gpu_round18.jobs: rounds 15-17's pipeline, fine-tuned with the fix
and, as the control on the same host, without it).

    zenflow_columns_report.cpu_shares()          # which weights moved, chosen columns and the rest, each way
    zenflow_columns_report.round18_target()      # the offload target's loss and speed, with the fix
    zenflow_columns_report.caught_up("ft_zfc64")  # the no-offload step whose loss ZenFlow reaches by step 64
"""
from __future__ import annotations

import json

from labs import RESULTS, memory
from labs.course import zenflow_report as z

CPU = RESULTS / "cpu" / "zenflow_columns" / "result.json"
ROUND18 = z.FINETUNE / "round18"
# no offload; ZenFlow interval 4 with the fix, choosing once and every 4 steps; the control: DeepSpeed's bf16 columns
ROUND18_RUNS = ("ft_ref64", "ft_zfc64", "ft_zfc_sel4_64", "ft_zf64_ds")
LABELS = dict(zip(ROUND18_RUNS, ("labs, no offload", "ZenFlow + fp32 columns, chosen once",
                                 "ZenFlow + fp32 columns, chosen every 4 steps", "ZenFlow, DeepSpeed's bf16 columns")))


def cpu_shares() -> dict:
    """The CPU measurement as recorded: when, where, the commands, and per run the moved share and the distance to no
    offload's weights of the columns chosen at step 1 ("chosen") and of the other elements ("rest")."""
    return json.loads(CPU.read_text())


def round18_target() -> dict:
    """The offload target over round 18's fine-tunes (zenflow_report.round14_target), the loss judged over steps
    49-64: with the fix choosing once and every 4 steps, and the control."""
    return z.round14_target(ROUND18, ROUND18_RUNS, z.WINDOW15, "round 18, 64 steps", LABELS)


def peaks() -> dict[str, dict]:
    """Each round 18 run's GPU peak (torch.cuda.max_memory_allocated) and labs.memory's prediction for the code it ran
    (the control: DeepSpeed's bf16 columns), in bytes."""
    return {name: dict(measured=max(json.loads((ROUND18 / name / "summary.json").read_text())["peak_memory_bytes"]),
                       predicted=memory.from_run(ROUND18 / name, zenflow_columns="deepspeed" if name == "ft_zf64_ds"
                                                 else "labs").total_per_gpu_bytes)
            for name in ROUND18_RUNS}


def caught_up(name: str, window: int = 8, folder=ROUND18) -> int:
    """The first step k at which no offload's (`ft_ref64`'s) mean loss over steps k-window+1 .. k is at or below
    `name`'s mean over its last `window` steps, in a round's folder: how many of no offload's steps ZenFlow's are worth."""
    runs = z.finetune_runs(folder, ("ft_ref64", name))
    reference, losses = runs["ft_ref64"]["losses"], runs[name]["losses"]
    late = sum(losses[-window:]) / window
    return next(k for k in range(window, len(reference) + 1) if sum(reference[k - window:k]) / window <= late)
