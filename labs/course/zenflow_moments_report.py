"""Chapter 9's readings of ZenFlow's CPU Adam with labs.zenflow_moments (one set of moments, updates counted): what
DeepSpeed's step count does to an update, what the second set costs in host memory (round 12's record, measured, and
labs.memory), and the loss on the tiny model on a CPU (results/cpu/zenflow_moments, tools/zenflow_moments_loss.py).

    zenflow_moments_report.moves(ZenFlowCPUAdam._sequential_step)   # each update's move, in learning rates
    zenflow_moments_report.optimizer_process_memory()                # round 12's moments, measured and predicted
    zenflow_moments_report.loss_rows()                                # the CPU measurement, per run and seed
"""
from __future__ import annotations

import json

import torch

from labs import RESULTS, memory
from labs.course import host_samples
from labs.course import zenflow_report as z

CPU = RESULTS / "cpu" / "zenflow_moments" / "result.json"
WINDOW = 16                       # the loss is judged over the last 16 of 48 steps
LABELS = {"no_offload": "labs, no offload",
          "sequential_deepspeed": "ZenFlow sequential, DeepSpeed's count",
          "sequential_labs": "ZenFlow sequential, counted updates",
          "overlap_deepspeed": "ZenFlow overlapped, DeepSpeed's two sets and count",
          "overlap_one_set": "ZenFlow overlapped, one set, DeepSpeed's count",
          "overlap_labs": "ZenFlow overlapped, one set, counted updates"}
# one lever at a time: (from, to)
LEVERS = {"count, sequential": ("sequential_deepspeed", "sequential_labs"),
          "one set, overlapped": ("overlap_deepspeed", "overlap_one_set"),
          "count, overlapped": ("overlap_one_set", "overlap_labs")}


def moves(step, updates: int = 16, interval: int = 4, lr: float = 1e-2) -> list[float]:
    """ZenFlow's sequential CPU Adam step (`step`: DeepSpeed's ZenFlowCPUAdam._sequential_step or
    labs.zenflow_moments.sequential_step) run by DeepSpeed's own CPU Adam on one weight with a steady gradient of 1,
    handed the engine's step at each update (interval, 2 x interval, ...) as ZenFlow hands it: how far each update
    moves the weight, in learning rates. Adam's answer is 1 every time."""
    from deepspeed.ops.adam.zenflow_cpu_adam import ZenFlowCPUAdam

    weight = torch.nn.Parameter(torch.ones(8))
    adam = ZenFlowCPUAdam([weight], lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, adamw_mode=True)
    found = []
    for k in range(1, updates + 1):
        before = weight.detach()[0].item()
        weight.grad = torch.ones(8)
        step(adam, k * interval)
        found.append((before - weight.detach()[0].item()) / lr)
    return found


def optimizer_process_memory(name: str = "zf_fast20", free: str = "round12_free.txt") -> dict:
    """Round 12's ZenFlow run on one H200 (the 3B, before labs.zenflow_moments): the optimizer process's private
    memory at the host's tightest second (its moments, GiB), the parameters, and labs.memory's host figure for the
    node with DeepSpeed's two sets and with one (bytes)."""
    folder = z.FOLDER / name
    held = host_samples.read(folder, free_txt=z.FOLDER / free)["at_tightest"]
    two, one = (memory.from_run(folder, zenflow_moments=m) for m in ("deepspeed", "labs"))
    return dict(private_gib=held[("ZenFlow's optimizer process", "RssAnon")], params=two.params,
                host_two_sets=two.host_per_node_bytes, host_one_set=one.host_per_node_bytes)


def record() -> dict:
    """The CPU measurement as recorded: when, where, how, the commands and every run's per-step losses per seed."""
    return json.loads(CPU.read_text())


def late_means(found: dict | None = None) -> dict[str, dict[str, float]]:
    """Per run and seed, the mean loss over the last WINDOW steps."""
    found = found or record()
    return {name: {seed: sum(losses[-WINDOW:]) / WINDOW for seed, losses in seeds.items()}
            for name, seeds in found["losses"].items()}


def loss_rows(found: dict | None = None) -> list[dict]:
    """One row per run: the late mean loss per seed, its mean over the seeds and the gap to no offload (nats)."""
    late = late_means(found)
    reference = late["no_offload"]
    rows = []
    for name, seeds in late.items():
        row = {"run": LABELS[name]} | {f"seed {s}": f"{v:.3f}" for s, v in seeds.items()}
        mean_gap = sum(v - reference[s] for s, v in seeds.items()) / len(seeds)
        rows.append(row | {"gap to no offload": "" if name == "no_offload" else f"{mean_gap:+.3f}"})
    return rows


def lever_gains(found: dict | None = None) -> dict[str, list[float]]:
    """Per lever (LEVERS), how much lower the late mean loss is with it than without, per seed (nats)."""
    late = late_means(found)
    return {lever: [late[before][s] - late[after][s] for s in late[before]] for lever, (before, after) in LEVERS.items()}
