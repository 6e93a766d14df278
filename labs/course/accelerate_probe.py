"""What accelerate makes of a launch on each process, without training: `accelerate launch ... -m
labs.course.accelerate_probe FOLDER`. Each process writes FOLDER/probe<rank>.json with the number of processes and
the distributed type its Accelerator() sees as a script would create it, then again after a PartialState with the
gloo backend came first (the CPU fix chapter 8's accelerate routes use; on a GPU host that part is skipped).
"""
import json
import os
import sys
from pathlib import Path

import torch
from accelerate import Accelerator, PartialState
from accelerate.state import AcceleratorState

from labs import env


def seen(accelerator) -> dict:
    return dict(num_processes=accelerator.num_processes, distributed_type=str(accelerator.distributed_type.value),
                mixed_precision=accelerator.mixed_precision)


if __name__ == "__main__":
    folder = Path(sys.argv[-1])
    # With --use_deepspeed, Accelerator() starts DeepSpeed's comm layer, which on a CPU compiles its shared-memory op
    # first (34-41 s on 2 cores, once per environment) for a method training never calls: as labs.course.route_rank
    env.skip_shm_comm_op()
    plain = seen(Accelerator())
    fixed = None                     # a GPU host needs no fix: accelerate finds NCCL there
    if not torch.cuda.is_available():
        AcceleratorState._reset_state(reset_partial_state=True)
        PartialState(backend="gloo")
        fixed = seen(Accelerator())
    (folder / f"probe{os.environ.get('RANK', '0')}.json").write_text(json.dumps(dict(plain=plain, gloo_first=fixed)))
    sys.stdout.flush()
    os._exit(0)      # no process group teardown to wait for: nothing was trained
