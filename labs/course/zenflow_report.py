"""Chapter 9's readings of the recorded ZenFlow runs on one H200 (results/gpu/zenflow_1xh200, the Qwen2.5-3B shape,
8 sequences of 4,096 tokens per optimizer step, 20 steps at a constant lr of 1e-5, same data and seed): losses and
speed per run, what the host's OOM killer reported before labs.zenflow_host, and the host memory sampled since.

    zenflow_report.zenflow_runs()                      # round 4: plain offload, ZenFlow before and after the layout fix
    zenflow_report.zenflow_runs(zenflow_report.ROUND10)  # round 10: one host, the overlap fixed, its three yardsticks
    zenflow_report.host_memory("zf_overlap20")         # least available host memory, each process then
"""
from __future__ import annotations

import json
import re

from labs import RESULTS
from labs.course import host_samples
from labs.metrics import read_jsonl

FOLDER = RESULTS / "gpu" / "zenflow_1xh200"
ROUND4 = ("off20", "zf_sync20", "zf_fix20")
# Round 10 (2026-12-03, one host, tools/gpu_round10.jobs): ZenFlow with its overlapped CPU step and labs.zenflow_host,
# ZenFlow without the overlap, plain offload, and labs without offload at 4 x 2 sequences (the same tokens per step).
ROUND10 = ("zf_overlap20", "zf_sync20b", "off20b", "ref20")


def zenflow_runs(names=ROUND4, folder=FOLDER, cycle=4) -> dict[str, dict]:
    """Per run: losses, seconds since the end of step 1 (a warm-up: allocator, first kernels, ZenFlow's optimizer
    process) at the end of each step, tokens/s, and how far the loss fell from step 1 to the mean of the last 5 steps.
    ZenFlow's steps alternate (the CPU update every `cycle`-th step is slow), so speed is the mean over whole cycles
    after the first (steps 5-20), not a median; the same steps for every run, so runs compare like for like."""
    runs = {}
    for name in names:
        metrics = read_jsonl(folder / name / "metrics.jsonl")
        losses, seconds = [m["loss"] for m in metrics], [m["step_time_s"] for m in metrics]
        timed = seconds[cycle:]
        assert len(timed) % cycle == 0, f"{name}: {len(timed)} steps after the first cycle is not whole cycles"
        summary = json.loads((folder / name / "summary.json").read_text())
        runs[name] = dict(losses=losses, elapsed_s=[sum(seconds[1:k + 1]) for k in range(len(seconds))],
                          step_s=seconds, tokens_per_s_per_gpu=len(timed) * summary["tokens_per_step"] / sum(timed),
                          fall=losses[0] - sum(losses[-5:]) / 5, tokens_per_step=summary["tokens_per_step"],
                          params=summary["params"], micro_batch=summary["micro_batch"],
                          grad_accum=summary["gradient_accumulation"],
                          peak_gpu_gib=max(summary["peak_memory_bytes"]) / 2**30)      # one entry per rank
    return runs


def zenflow_oom(folder=FOLDER / "zf_mem") -> dict:
    """ZenFlow with overlap_step on a 126 GiB host, before labs.zenflow_host: what the kernel's OOM killer reported
    for each process it ended (resident anonymous and shared memory, GiB) and the least free memory vmstat saw (GiB)."""
    killed = [dict(anon_gib=int(re.search(r"anon-rss:(\d+)kB", line)[1]) / 2**20,
                   shmem_gib=int(re.search(r"shmem-rss:(\d+)kB", line)[1]) / 2**20)
              for line in (folder / "log.txt").read_text().splitlines() if "Out of memory: Killed process" in line]
    free_mib = [int(line.split()[3]) for line in (folder / "vmstat.txt").read_text().splitlines()
                if line.split() and line.split()[0].isdigit()]          # vmstat -S M: column 4 is free MiB
    return dict(killed=killed, least_free_gib=min(free_mib) / 1024)


def host_memory(name: str, folder=FOLDER) -> dict:
    """labs.course.host_samples.read for one run of this folder (the host's `free -g`: round10_free.txt), with the
    lines labs.zenflow_host printed in the job's output."""
    found = host_samples.read(folder / name, free_txt=folder / "round10_free.txt")
    lines = (folder / name / "job.log").read_text().splitlines()
    return dict(found, labs_lines=[line for line in lines if line.startswith("labs: ZenFlow")])
