"""Compile DeepSpeed's CPU Adam op into TORCH_EXTENSIONS_DIR before the first run that needs it.

    python tools/build_cpu_adam.py      # `make .venv/.installed` starts it once torch and DeepSpeed are installed

Any run with an offloaded optimizer would compile it on first use (labs.env.ops_to_build); done here, on a 2-core VM it
takes the core pip leaves idle while the rest of the course's packages install. The rank that would have built it
then loads this build, since the sources and flags are the same. On a GPU host DeepSpeed's CUDA accelerator builds
its own variant on first use: nothing is built here."""
import os
import signal
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")
# Stopped (make's time limit), exit through Python's finally blocks: torch's build removes its lock file there, which
# a build killed outright leaves behind for every later load to wait on forever.
signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

import torch  # noqa: E402

if torch.cuda.is_available():
    print("a GPU host: CPU Adam is built on first use, with the CUDA accelerator's flags")
else:
    from deepspeed.accelerator import get_accelerator

    get_accelerator().create_op_builder("CPUAdamBuilder").load()
    print(f"CPU Adam built in {os.environ.get('TORCH_EXTENSIONS_DIR')}")
