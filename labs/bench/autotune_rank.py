"""The script each rank of a DeepSpeed autotuner experiment runs (labs.bench.autotune starts the autotuner with it):

    deepspeed ... labs/bench/autotune_rank.py BASE_DIR --deepspeed_config CONFIG [--local_rank=N]

The autotuner hands every experiment its DeepSpeed config as CONFIG (base64 JSON, or a .json path for its first,
model-info run). This script puts that config beside the run's spec (BASE_DIR/run.json) in a run folder inside the
experiment's own results folder and runs labs' training loop there (labs.train), unchanged. DeepSpeed ends the
process itself once it has timed the profiled steps (its engine calls exit()).

Two things keep the autotuner's bookkeeping right: it marks an experiment failed when its stderr.log contains the
word "error" anywhere, so this rank's own stderr (warnings included) goes to a file in the run folder, and only a
real failure's traceback reaches the autotuner; and the run folder is written by every rank the same way (rename
into place), so no rank reads a half-written file.
"""
import base64
import json
import os
import signal
import sys
import traceback
from pathlib import Path

if __name__ == "__main__":
    sys.path.pop(0)       # this folder (labs/bench) is not a top-level package folder: import labs from PYTHONPATH
    from labs import supervisor, train

    supervisor.die_with_parent(signal.SIGKILL)        # no rank outlives the experiment's launcher
    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    base, config = Path(args[0]), args[args.index("--deepspeed_config") + 1]
    ds_config = json.loads(Path(config).read_text() if config.endswith(".json") else base64.urlsafe_b64decode(config))
    tuning = ds_config["autotuning"]
    run_dir = Path(tuning.get("metric_path") or tuning["model_info_path"]).parent / "labs_run"
    run_dir.mkdir(parents=True, exist_ok=True)
    rank = os.environ.get("RANK", "0")
    for name, content in (("run.json", (base / "run.json").read_text()), ("ds_config.json", json.dumps(ds_config))):
        partial = run_dir / f".{name}.rank{rank}"
        partial.write_text(content)
        partial.replace(run_dir / name)
    autotuner_stderr = os.dup(2)
    with open(run_dir / f"rank{rank}.stderr", "ab", buffering=0) as own_stderr:
        os.dup2(own_stderr.fileno(), 2)
        sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
        try:
            train.main(run_dir)
        except SystemExit:        # DeepSpeed's autotuning exit after the profiled steps (or its model-info run)
            raise
        except BaseException:
            os.write(autotuner_stderr, traceback.format_exc().encode())
            raise
