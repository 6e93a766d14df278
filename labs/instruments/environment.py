"""What a launcher told each rank: the environment variables that place it in the job (`rank_env`).

    launch.run(..., instruments=("rank_env",))   ->   run.summary["rank_env"][rank]["env"]["LOCAL_RANK"], ...

torchrun sets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK (the node's rank), ROLE_*, MASTER_ADDR,
MASTER_PORT and TORCHELASTIC_*; DeepSpeed's launcher sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_* and its own
CROSS_RANK / CROSS_SIZE / LOCAL_SIZE. The communication settings (NCCL_*, TORCH_NCCL_*, ...) are kept as they were.
"""
from __future__ import annotations

import os
import socket

from labs.train import Instrument

PLACEMENT = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
             "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT", "CROSS_RANK", "CROSS_SIZE", "LOCAL_SIZE")
PREFIXES = ("TORCHELASTIC_", "NCCL_", "TORCH_NCCL_", "TORCH_DISTRIBUTED_", "GLOO_", "DEEPSPEED_")
SETTINGS = ("OMP_NUM_THREADS", "DS_ACCELERATOR", "CUDA_VISIBLE_DEVICES", "PYTHONPATH")


def launcher_environment(environ=None) -> dict:
    """The variables above that are set, sorted by name."""
    environ = os.environ if environ is None else environ
    return {k: environ[k] for k in sorted(environ)
            if k in PLACEMENT or k in SETTINGS or k.startswith(PREFIXES)}


class RankEnv(Instrument):
    """Records, before any process group exists, what the launcher put in this rank's environment."""
    name = "rank_env"

    def __init__(self):
        self.found = {}

    def before_engine(self):
        self.found = dict(host=socket.gethostname(), pid=os.getpid(), parent_pid=os.getppid(),
                          env=launcher_environment())

    def summary(self) -> dict:
        return self.found
