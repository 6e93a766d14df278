"""What a launcher hands each process: `python -m labs.course.omp_probe` prints one JSON line with the rank and
the OMP_NUM_THREADS it found (no torch import: the probe must be quick). Chapter 3 starts it under torchrun, the
deepspeed launcher and accelerate (labs.course.offload.launcher_threads)."""
import json
import os

if __name__ == "__main__":
    print("omp-probe " + json.dumps({"rank": os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")),
                                     "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS")}), flush=True)
