"""What the ranks on the hosts DeepSpeed's runner starts over ssh get of this host's environment.

`labs train --hostfile` without --node-rank hands the hosts to DeepSpeed's runner, which starts their ranks through
pdsh: a fresh ssh shell on each host, the launching host included. The runner exports to them only the variables
whose names start with MLFLOW, PYTHON, MV2, UCX or the accelerator's prefixes (NCCL on CUDA), then the lines of the
user's `.deepspeed_env` files (in ~, then in the working directory; DS_ENV_FILE renames them), which win
(deepspeed/launcher/runner.py, 0.19.8). labs' own settings for its ranks (labs.env: OMP_NUM_THREADS,
DS_PIN_MEMORY_BACKEND, PYTORCH_CUDA_ALLOC_CONF, LABS_*) and a user's TORCH_*, GLOO_* or DEEPSPEED_TIMEOUT would not
reach them. labs writes them, then the user's files' lines (which still win, as in DeepSpeed's order), into one file
in the working folder, points the runner at it (DS_ENV_FILE, which would otherwise hide the user's files), and
removes it when the launcher has exited: it may hold what the user keeps in those files.

    path, dropped = remote_env.write(env, work)    # work/.deepspeed_env.labs, owner-only; dropped: names left out
    env["DS_ENV_FILE"] = str(path)
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from labs import prefork

FILE = ".deepspeed_env.labs"
# Variables that change what a rank does, forwarded by the start of their names; not the host's own (PATH, HOME,
# CUDA_VISIBLE_DEVICES: each host has its own), not labs' warm-server socket, which lives on this host only, and no
# credential (a token or key a rank does not need would end up in the runner's logged command line).
FORWARDED = ("OMP_", "MKL_", "KMP_", "TORCH", "PYTORCH_", "DS_", "DEEPSPEED_", "LABS_", "GLOO_", "TRANSFORMERS_",
             "TOKENIZERS_PARALLELISM", "TRITON_", "GLIBC_TUNABLES", "CUDA_LAUNCH_BLOCKING")
NOT_FORWARDED = ("DS_ENV_FILE", prefork.SERVER_ENV)
CREDENTIAL = re.compile(r"TOKEN|KEY|SECRET|PASSWORD", re.IGNORECASE)
# The runner puts each value into a shell line, quoted with "..." only when it holds other characters than these
UNSAFE = set('"$`\\\n')


def forwarded(env: dict) -> tuple[dict, list[str]]:
    """The variables of `env` a remote rank needs, in name order, and the names of those left out because the
    runner's quoting cannot carry their values (a quote, $, backquote, backslash or newline)."""
    chosen = {key: value for key, value in sorted(env.items())
              if key.startswith(FORWARDED) and key not in NOT_FORWARDED and not CREDENTIAL.search(key)}
    dropped = [key for key, value in chosen.items() if UNSAFE & set(value)]
    return {key: value for key, value in chosen.items() if key not in dropped}, dropped


def write(env: dict, work: Path, home: Path | None = None) -> tuple[Path, list[str]]:
    """The file DS_ENV_FILE points the runner at: what `forwarded` keeps of `env`, then the lines of the user's own
    files (~/NAME, then ./NAME, NAME being DS_ENV_FILE's value in `env` or .deepspeed_env), which win. Owner-only."""
    kept, dropped = forwarded(env)
    lines = [f"{key}={value}" for key, value in kept.items()]
    name = env.get("DS_ENV_FILE") or ".deepspeed_env"
    for folder in (Path(home or os.path.expanduser("~")), Path.cwd()):
        user_file = folder / name
        if user_file.is_file():
            lines += [line for line in user_file.read_text().splitlines() if "=" in line]
    path = Path(work) / FILE
    path.touch(mode=0o600)
    path.write_text("".join(line + "\n" for line in lines))
    return path, dropped
