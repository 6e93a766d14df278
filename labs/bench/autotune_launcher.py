"""DeepSpeed's launcher for `labs autotune`, with the autotuner told the GPU memory labs caps each rank at.

    python -m labs.bench.autotune_launcher --autotuning tune --num_gpus=N ...   (what labs.bench.autotune starts)

The autotuner plans in the launcher process, before any rank exists: it reads the GPU's whole memory
(`Autotuner.get_gpu_memory_info`, the accelerator's total_memory) to decide which ZeRO stages can run and the largest
micro-batch to try. Under `--gpu-memory` (an 80 GB card's budget on an H200) each rank is capped, but the plan would
be made for the whole card. With GPU_MEMORY_ENV set, the autotuner plans for the cap instead.

DeepSpeed's scheduler notices a finished experiment by joining its thread for TIMEOUT seconds and then sleeping
TIMEOUT more (`ResourceManager.experiment_check`), with TIMEOUT 5: every experiment's end was seen up to 10 s late and
the next one waited for it. labs polls each second. Everything else is DeepSpeed's own launcher, unchanged.
"""
import os
import sys

from deepspeed.autotuning import autotuner, scheduler
from deepspeed.launcher import runner

from labs.bench.autotune import GPU_MEMORY_ENV


POLL_S = 1


def main():
    scheduler.TIMEOUT = POLL_S
    cap = os.environ.get(GPU_MEMORY_ENV)
    if cap:
        autotuner.Autotuner.get_gpu_memory_info = lambda self: int(cap)
    return runner.main()


if __name__ == "__main__":
    sys.exit(main())
