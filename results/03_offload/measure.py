"""Chapter 3's offload measurements on a GPU host: the tiny preset under ZeRO-3 without offload and with each
offload config (one rank per GPU, bf16 as the files say), where each rank's tensors live, step times, and
DeepSpeed's CPU Adam with 1 thread against the launcher's repaired thread count.

    PYTHONPATH=$PWD python results/03_offload/measure.py results/03_offload/h200x2.json

The JSON is rewritten after each piece, so a time-out leaves what was measured; errors are recorded, not raised.
"""
from __future__ import annotations

import datetime
import json
import os
import sys
import time
import traceback
from pathlib import Path

from labs import CONFIGS, RUNS, config, env, launch, offload

CONFIG_FILES = ["zero3.json", "zero2_offload_optimizer.json", "zero3_offload_optimizer.json", "zero3_offload_all.json"]
STEPS = 12
ADAM_NUMEL = 100_000_000


def main(out: Path):
    started = time.time()
    info = env.report()
    result = dict(
        what="tiny preset (9.8 M parameters), 2 ranks = one per GPU, bf16, micro-batch 2, sequence 64, "
             f"{STEPS} steps; timings are medians after 2 warm-up steps",
        how=f"python {' '.join(sys.argv)} (labs.launch.run per config; labs.offload.cpu_adam_step_seconds)",
        when=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        host={k: info.get(k) for k in ("python", "torch", "cuda", "cpu_cores", "gpus", "deepspeed", "transformers",
                                       "deepspeed_ops")},
        runs={}, cpu_adam=[], nvme=None, errors=[])

    def save():
        out.write_text(json.dumps(result, indent=1) + "\n")

    save()
    for name in CONFIG_FILES:
        try:
            run = launch.run(preset="tiny", config=CONFIGS / name, steps=STEPS, out=RUNS / "03_offload_gpu" / name[:-5],
                             stream=False)
            s = run.summary
            result["runs"][name[:-5]] = dict(
                config=name, precision=s["precision"], world_size=s["world_size"], device=s["device"],
                median_step_time_s=s["median_step_time_s"], tokens_per_s_per_gpu=s["tokens_per_s_per_gpu"],
                peak_memory_bytes=s["peak_memory_bytes"], memory_kind=s["memory_kind"],
                state_bytes=s["state_bytes"], zero_buffers=s["zero_buffers"], losses=run.losses,
                step_times_s=[m["step_time_s"] for m in run.metrics],
                environment=json.loads((run.path / "environment.json").read_text()))
        except Exception:
            result["errors"].append(f"{name}: {traceback.format_exc()[-3000:]}")
        save()

    cores = os.cpu_count() or 1
    ranks = len(info["gpus"]) or 2          # labs starts one rank per GPU, or 2 CPU ranks
    for threads in sorted({1, max(1, cores // ranks), cores}):
        try:
            seconds = offload.cpu_adam_step_seconds(threads, numel=ADAM_NUMEL)
            result["cpu_adam"].append(dict(threads=threads, numel=ADAM_NUMEL, median_step_s=seconds))
        except Exception:
            result["errors"].append(f"cpu_adam threads={threads}: {traceback.format_exc()[-3000:]}")
        save()

    ready, reason = offload.nvme_ready()
    result["nvme"] = dict(ready=ready, reason=reason)
    if ready:
        try:
            swap = RUNS / "03_offload_gpu" / "nvme_swap"
            swap.mkdir(parents=True, exist_ok=True)
            z = "zero_optimization."
            path = config.write(config.variant(config.load(CONFIGS / "zero3_nvme.json"), {
                z + "offload_optimizer.nvme_path": str(swap), z + "offload_param.nvme_path": str(swap)}),
                RUNS / "03_offload_gpu" / "zero3_nvme_here.json")
            run = launch.run(preset="tiny", config=path, steps=STEPS, out=RUNS / "03_offload_gpu" / "zero3_nvme",
                             stream=False)
            s = run.summary
            result["nvme"].update(nvme_path=f"{swap} (the machine's local disk)",
                                  median_step_time_s=s["median_step_time_s"], state_bytes=s["state_bytes"],
                                  peak_memory_bytes=s["peak_memory_bytes"], losses=run.losses)
        except Exception:
            result["errors"].append(f"nvme: {traceback.format_exc()[-3000:]}")
    result["seconds"] = round(time.time() - started)
    save()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
