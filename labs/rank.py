"""What every process that torchrun starts runs: `python -m labs.rank RUN_DIR` (or `forked(RUN_DIR)`, below).

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


def run(run_dir: Path):
    """Train as this rank, then stop the rank's own helper processes."""
    # Die with torchrun, however it ends (even SIGKILL): no rank may outlive its run.
    supervisor.die_with_parent(signal.SIGKILL)
    supervisor.name_process(f"labs rank {os.environ.get('RANK', '0')}")
    if os.getppid() == 1:
        sys.exit("labs.rank: the launcher is already gone")
    try:
        spec = json.loads((run_dir / "run.json").read_text())
        train.main(run_dir, instruments.build(spec["instruments"], run_dir, spec))
    except BaseException:
        peers.stop_if_announced()       # a collective another node's stop broke: say so (see there), not the error
        (run_dir / f"rank{os.environ.get('RANK', '0')}.err").write_text(traceback.format_exc())
        raise
    # The interpreter's shutdown, which the callers skip (see below), is also what stops daemon helper processes
    # (multiprocessing's atexit hook): ZenFlow's overlapped CPU optimizer is one, and left alive it keeps the
    # launcher's output pipe open, so labs never returns.
    for child in multiprocessing.active_children():
        if child.daemon:
            child.terminate()
            child.join(timeout=10)
    sys.stdout.flush()
    sys.stderr.flush()


def forked(run_dir: str):
    """A rank forked from labs.fork_launcher, which imported everything above first. It starts with the launcher's
    signal handlers (torch's agent turns SIGTERM into an exception): a rank takes signals as a fresh process would.
    Returning ends the process without the interpreter's shutdown (multiprocessing's os._exit)."""
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    run(Path(run_dir))


if __name__ == "__main__":
    run(Path(sys.argv[1]))
    # Every file is written and the process group is gone: leave without the interpreter's shutdown, where a C++
    # thread left joinable by a CPU backend (gloo, DeepSpeed's shm comm op) now and then aborts the process
    # ("terminate called without an active exception", exit -6) after all the work is done.
    os._exit(0)
