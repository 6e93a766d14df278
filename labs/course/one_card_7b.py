"""Chapter 10's last section, measured: Qwen2.5-7B on one GPU capped at an H100 80GB's memory (round 26,
results/gpu/one_card_7b_1xh200), ZeRO-3 with 70% of the optimizer offloaded, the one labs.bench.offload_plan setup that
fits an 80 GB card and the 126 GiB host the runs had, at three splits of the same 8 sequences per optimizer step.
From random weights, 6 steps each, the host sampled each second (tools/host_memory.sh).

    one_card_7b.rows()    # per split: layers checkpointed, tokens/s, GPU and host memory measured against labs.memory
"""
from __future__ import annotations

import json
import re
import statistics

from labs import RESULTS, memory
from labs.bench import offload_plan
from labs.course import host_samples
from labs.metrics import read_jsonl

FOLDER = RESULTS / "gpu" / "one_card_7b_1xh200"
RUNS = ("z3off70_7b", "z3off70_7b_4x2", "z3off70_7b_2x4")     # 8 x 1, 4 x 2, 2 x 4
FLUSHES = re.compile(r"(\d+) pytorch allocator cache flushes since last step")


def rows() -> list[dict]:
    """Per run: the split, layers checkpointed (and the fewest that fit the run's --gpu-memory by
    labs.bench.offload_plan), offloaded
    share, tokens/s per GPU (median of steps 3-6) and MFU (both conventions), the GPU peak
    (torch.cuda.max_memory_allocated) and PyTorch's reserved peak against labs.memory's prediction, the training
    rank's host memory at the host's tightest second (private plus shared, which holds the pinned buffers) against
    labs.memory's host figure, the host's total and least available memory (GiB), the median share of a step (3-6) in
    DeepSpeed's optimizer step timer (the CPU Adam step and the copies around it), and the allocator cache flushes
    DeepSpeed reported (a sign that the GPU peak pressed on the cap)."""
    found = []
    for name in RUNS:
        run_dir = FOLDER / name
        summary = json.loads((run_dir / "summary.json").read_text())
        ds_config = json.loads((run_dir / "ds_config.json").read_text())
        predicted = memory.from_run(run_dir)
        cap = json.loads((run_dir / "run.json").read_text())["gpu_memory_bytes"]          # --gpu-memory H100
        fewest = offload_plan.fewest_checkpointed(summary["preset"], ds_config, cap, summary["micro_batch"],
                                                  summary["gradient_accumulation"])
        host = host_samples.read(run_dir)
        tightest = host["at_tightest"]
        timed = read_jsonl(run_dir / "metrics.jsonl")[2:]                        # steps 3-6, as the median speed
        step_share = statistics.median(m["timers_ms"]["step"] / 1e3 / m["step_time_s"] for m in timed)
        found.append(dict(run=name, batch=f"{summary['micro_batch']} x {summary['gradient_accumulation']}",
                          checkpointed=summary["activation_checkpointing"], fewest_checkpointed=fewest["checkpointed"],
                          offloaded=ds_config["zero_optimization"]["offload_optimizer"]["ratio"],
                          tokens_per_s_per_gpu=summary["tokens_per_s_per_gpu"], mfu=summary["mfu"],
                          mfu_causal=summary["mfu_causal"], tokens_per_step=summary["tokens_per_step"],
                          gpu_gib=max(summary["peak_memory_bytes"]) / 2**30,
                          reserved_gib=max(summary["peak_reserved_bytes"]) / 2**30,
                          predicted_gpu_gib=predicted.total_per_gpu_bytes / 2**30,
                          host_gib=tightest[("training rank", "RssAnon")] + tightest[("training rank", "RssShmem")],
                          predicted_host_gib=predicted.host_per_node_bytes / 2**30,
                          host_total_gib=host["total_gib"], least_available_gib=host["least_available_gib"],
                          step_share=step_share,
                          cache_flushes=sum(int(n) for n in FLUSHES.findall((run_dir / "launch.log").read_text()))))
    return found
