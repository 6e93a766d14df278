"""What every process that torchrun starts runs: `python -m labs.rank RUN_DIR`.

It wires the two halves together: the rank loop (labs.train) and the instruments the run asked for
(labs.instruments), then leaves the way a finished rank must. Any failure is written to RUN_DIR/rankN.err,
so the launcher can show the rank that failed first with its own traceback.
"""
import gc

gc.disable()    # start-up makes ~700,000 objects and next to no garbage: labs.train.main turns the collector back on
                # once the engine is built (train.settle_startup_objects)

import json
import multiprocessing
import os
import signal
import sys
import traceback
from pathlib import Path

from labs import instruments, peers, supervisor, train

if __name__ == "__main__":
    # Die with torchrun, however it ends (even SIGKILL): no rank may outlive its run.
    supervisor.die_with_parent(signal.SIGKILL)
    if os.getppid() == 1:
        sys.exit("labs.rank: the launcher is already gone")
    run_dir = Path(sys.argv[1])
    try:
        spec = json.loads((run_dir / "run.json").read_text())
        train.main(run_dir, instruments.build(spec["instruments"], run_dir, spec))
    except BaseException:
        peers.stop_if_announced()       # a collective another node's stop broke: say so (see there), not the error
        (run_dir / f"rank{os.environ.get('RANK', '0')}.err").write_text(traceback.format_exc())
        raise
    # Every file is written and the process group is gone: leave without the interpreter's shutdown, where a C++
    # thread left joinable by a CPU backend (gloo, DeepSpeed's shm comm op) now and then aborts the process
    # ("terminate called without an active exception", exit -6) after all the work is done.
    # The shutdown skipped here is also what stops daemon helper processes (multiprocessing's atexit hook): ZenFlow's
    # overlapped CPU optimizer is one, and left alive it keeps the launcher's output pipe open, so labs never returns.
    for child in multiprocessing.active_children():
        if child.daemon:
            child.terminate()
            child.join(timeout=10)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
