"""Several nodes: when one node's run stops, every other node's ranks stop too.

A rank blocked in a gloo collective does not always notice that its peer on another node is gone: a receive that
was already waiting when the peer's connection closed waits out the process group's timeout (30 minutes). Seen on
two emulated CPU nodes (tests/test_multinode.py): after Ctrl-C on node 1, node 0's rank sat in gloo's allgather
(`UnboundBuffer::waitRecv`) with no connection left to its peer. So:

- the launcher of a node whose run is interrupted or fails writes STOP_KEY into the run's rendezvous store, the
  TCPStore every rank already talks to (`announce`);
- every rank of a run on several nodes watches for that key from a thread (`watch`) and stops when it appears, or
  when the store itself vanishes (node 0, which holds it, is gone) before the rank's training loop has finished.

On one node the launcher already stops every rank itself (labs.supervisor), and `watch` does nothing.
"""
from __future__ import annotations

import datetime
import os
import sys
import threading
from pathlib import Path

import torch.distributed as dist

STOP_KEY = "labs/stop"
POLL_S = 1.0


class Watch:
    """A daemon thread polling the default process group's store for STOP_KEY."""

    def __init__(self, run_dir: Path, rank: int, store):
        self.run_dir, self.rank, self.store = run_dir, rank, store
        self.done = threading.Event()
        threading.Thread(target=self._run, name="labs-peers", daemon=True).start()

    def finished(self):
        """The training loop is over: the store may close with node 0 from now on, which is no failure."""
        self.done.set()

    def _run(self):
        while not self.done.wait(POLL_S):
            try:
                if self.store.check([STOP_KEY]):
                    self._stop(f"another node's run stopped ({self.store.get(STOP_KEY).decode(errors='replace')})")
            except Exception:                   # the store is gone: node 0 left, unless this run just finished
                if not self.done.wait(2 * POLL_S):
                    self._stop("the run's rendezvous store on node 0 is gone")
                return

    def _stop(self, why: str):
        message = f"labs: rank {self.rank} stops: {why}"
        (self.run_dir / f"rank{self.rank}.err").write_text(message + "\n")    # the launcher shows it first
        print(message, file=sys.stderr, flush=True)
        os._exit(1)                             # the main thread may be blocked in a collective that never returns


class _Nothing:
    def finished(self):
        pass


def local_world_size() -> int:
    """Ranks per node, from the launcher: torchrun's LOCAL_WORLD_SIZE, DeepSpeed's LOCAL_SIZE; else one node."""
    return int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or dist.get_world_size())


def watch(run_dir: Path, rank: int):
    """Start watching when this run spans several nodes (more ranks in the world than on this node)."""
    if dist.get_world_size() <= local_world_size():
        return _Nothing()
    store = dist.distributed_c10d._get_default_store()
    while isinstance(store, dist.PrefixStore):      # torchrun and the process group prefix their keys; the launcher
        store = store.underlying_store              # writes STOP_KEY as it is
    return Watch(run_dir, rank, store)


def announce(host: str, port: int, reason: str, timeout_s: float = 5.0) -> bool:
    """Tell the other nodes' ranks to stop; False when the store is gone already (its node stopped first)."""
    try:
        store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
        store.set(STOP_KEY, reason)
        return True
    except Exception:
        return False
