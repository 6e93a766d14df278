"""What the ranks on the hosts DeepSpeed's runner starts over ssh get of this host's environment.

`labs train --hostfile` without --node-rank hands the hosts to DeepSpeed's runner, which starts their ranks through
pdsh: a fresh ssh shell on each host, the launching host included. The runner exports to them only the variables
whose names start with MLFLOW, PYTHON, MV2, UCX or the accelerator's prefixes (NCCL on CUDA), plus the lines of a
`.deepspeed_env` file in ~ or the working directory (deepspeed/launcher/runner.py, 0.19.8). labs' own settings for
its ranks (labs.env: OMP_NUM_THREADS, DS_PIN_MEMORY_BACKEND, PYTORCH_CUDA_ALLOC_CONF, LABS_*) and a user's TORCH_*
or DEEPSPEED_TIMEOUT would not reach them. labs writes them into the run's own file and points the runner at it
(DS_ENV_FILE), after the lines of the user's `.deepspeed_env` files, which that variable would otherwise hide.

    env["DS_ENV_FILE"] = str(remote_env.write(env, work))      # work/deepspeed_env, kept in the run folder
"""
from __future__ import annotations

import os
from pathlib import Path

from labs import prefork

FILE = "deepspeed_env"
# Variables that change what a rank does, forwarded by the start of their names; not the host's own (PATH, HOME,
# CUDA_VISIBLE_DEVICES: each host has its own), and not labs' warm-server socket, which lives on this host only.
FORWARDED = ("OMP_", "MKL_", "KMP_", "TORCH", "PYTORCH_", "DS_", "DEEPSPEED_", "LABS_", "HF_", "TRANSFORMERS_",
             "TRITON_", "GLIBC_TUNABLES", "CUDA_LAUNCH_BLOCKING")
NOT_FORWARDED = ("DS_ENV_FILE", prefork.SERVER_ENV)
# The runner puts each value into a shell line, quoted with "..." only when it holds other characters than these
UNSAFE = set('"$`\\\n')


def forwarded(env: dict) -> dict:
    """The variables of `env` a remote rank needs, in name order; values the runner's quoting cannot carry are left
    out (a value with a quote, $, backquote, backslash or newline)."""
    return {key: value for key, value in sorted(env.items())
            if key.startswith(FORWARDED) and key not in NOT_FORWARDED and not UNSAFE & set(value)}


def write(env: dict, work: Path, home: Path | None = None) -> Path:
    """The run's file of KEY=VALUE lines for DeepSpeed's runner: the user's ~/.deepspeed_env and ./.deepspeed_env
    lines first (as the runner would have read them), then what `forwarded` keeps of `env`, which wins."""
    lines = []
    for folder in (Path(home or os.path.expanduser("~")), Path.cwd()):
        user_file = folder / ".deepspeed_env"
        if user_file.is_file():
            lines += [line for line in user_file.read_text().splitlines() if "=" in line]
    lines += [f"{key}={value}" for key, value in forwarded(env).items()]
    path = Path(work) / FILE
    path.write_text("".join(line + "\n" for line in lines))
    return path
