"""What every process that torchrun starts runs: `python -m labs.rank RUN_DIR` (or `forked(RUN_DIR)`, below).

It wires the two halves together: the rank loop (labs.train) and the instruments the run asked for
(labs.instruments), then leaves the way a finished rank must. Any failure is written to RUN_DIR/rankN.err,
so the launcher can show the rank that failed first with its own traceback.
"""
import gc

gc.disable()    # start-up makes ~700,000 objects and next to no garbage: labs.train.main turns the collector back on
                # once the engine is built (train.settle_startup_objects)

import ipaddress
import json
import multiprocessing
import os
import signal
import sys
import traceback
from pathlib import Path

import torch

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
    # Stop daemon helper processes here (ZenFlow's overlapped CPU optimizer is one: left alive, it keeps the
    # launcher's output pipe open, so labs never returns). Their usual stop, multiprocessing's exit hook, runs in the
    # interpreter's shutdown, which `python -m labs.rank` skips (see below).
    for child in multiprocessing.active_children():
        if child.daemon:
            child.terminate()
            child.join(timeout=10)
    sys.stdout.flush()
    sys.stderr.flush()


def forked(run_dir: str):
    """A rank forked from labs.fork_launcher, which imported everything above first. Set up as torchrun's spawned
    ranks are: a session of its own (torch's subprocess handler starts each rank with start_new_session), default
    signal handling (it inherits the agent's handlers, which turn SIGTERM into an exception; and torch's process
    wrapper would swallow the KeyboardInterrupt of Python's SIGINT handler, exiting 0), and the intra-op thread
    count of its OMP_NUM_THREADS (which torch read at import, in the launcher). Returning ends the process through
    multiprocessing: its exit hook, then os._exit, never the interpreter's shutdown (see below)."""
    os.setsid()
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL)
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    os.environ.update(no_name_lookups(os.environ))
    run(Path(run_dir))


def no_name_lookups(env) -> dict:
    """What a forked rank sets so that it never looks a host name up. The agent it was forked from has threads, and
    one may hold glibc's resolver lock at the fork: the rank's copy of that lock then stays locked, and its first
    getaddrinfo of a name waits for ever (seen 2026-12-07: a 4-rank run whose last rank hung in getaddrinfo
    ("localhost") on its way to the rendezvous store while the other three waited for it). A numeric address needs
    no lookup: where every rank runs on this host (one node, or emulated nodes whose store is on the loopback) the
    store's address becomes 127.0.0.1 and gloo takes the loopback interface rather than resolving this machine's
    name (a GLOO_SOCKET_IFNAME the user set is kept). Across hosts nothing changes."""
    address = env.get("MASTER_ADDR", "")
    one_host = (env.get("WORLD_SIZE") is not None and env.get("WORLD_SIZE") == env.get("LOCAL_WORLD_SIZE")) \
        or address == "localhost" or _is_loopback(address)
    if not one_host:
        return {}
    # torchrun --standalone names the store by this machine's name (socket.getfqdn()); its server listens on every
    # address of the host, the loopback's included
    changes = {"MASTER_ADDR": "127.0.0.1"} if address != "127.0.0.1" else {}
    if "GLOO_SOCKET_IFNAME" not in env and os.path.exists("/sys/class/net/lo"):
        changes["GLOO_SOCKET_IFNAME"] = "lo"
    return changes


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:          # a name: not known without a lookup
        return False


if __name__ == "__main__":
    run(Path(sys.argv[1]))
    # Every file is written and the process group is gone: leave without the interpreter's shutdown, where a C++
    # thread left joinable by a CPU backend (gloo, DeepSpeed's shm comm op) now and then aborts the process
    # ("terminate called without an active exception", exit -6) after all the work is done.
    os._exit(0)
