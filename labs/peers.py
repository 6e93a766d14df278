"""Several nodes: when one node's run stops, every other node's ranks stop too.

A rank blocked in a gloo collective does not always notice that its peer on another node is gone: a receive that
was already waiting when the peer's connection closed waits out the process group's timeout (30 minutes). Seen on
two emulated CPU nodes (tests/test_multinode.py): after Ctrl-C on node 1, node 0's rank sat in gloo's allgather
(`UnboundBuffer::waitRecv`) with no connection left to its peer. So:

- the launcher of a node whose run is interrupted or fails writes STOP_KEY into the run's rendezvous store, the
  TCPStore every rank already talks to (`announce`);
- every rank of a run on several nodes watches for that key from a thread (`watch`) and stops when it appears, or
  when the store itself vanishes (node 0, which holds it, is gone) before the rank's training loop has finished;
- a node killed outright (power cut, SIGKILL to all its processes) announces nothing, and a dead host closes no
  connection: so each node's launcher counts in the store, about once a second while its run lasts (`heartbeat`),
  and a rank whose watcher sees another node's count stand still for HEARTBEAT_TIMEOUT_S stops too.
  The launcher beats, not the ranks: a rank's Python thread can be starved for tens of seconds by one long
  GIL-holding op (DeepSpeed's CPU Adam step), which would read as a dead node. A counter, not a time, is stored: no
  two machines' clocks are ever compared; each watcher times the counters on its own monotonic clock.

On one node the launcher already stops every rank itself (labs.supervisor), and `watch` does nothing.
"""
from __future__ import annotations

import contextlib
import datetime
import os
import socket
import sys
import threading
import time
from pathlib import Path

import torch.distributed as dist

STOP_KEY = "labs/stop"
HEARTBEAT_KEY = "labs/heartbeat/node{}"     # one counter per node, bumped by that node's launcher
POLL_S = 1.0                                # how often a rank looks, and a launcher beats
# How long another node's counter may stand still before a rank gives that node up. The process that beats does
# nothing else but copy its ranks' output, so a late beat means a stalled machine or network, never a busy one:
# 30 s lets swapping, a stalled file system or a store slow under many clients pass with a wide margin, and still
# stops the run 60 times sooner than gloo's 30-minute timeout. Tests shorten it through TIMEOUT_ENV.
HEARTBEAT_TIMEOUT_S = 30.0
TIMEOUT_ENV = "LABS_HEARTBEAT_TIMEOUT_S"


class Heartbeats:
    """Which node went silent, from readings of every other node's counter: node -> (count, when it last moved, on
    this process's monotonic clock). A counter still at 0 has not started (rendezvous can be slow): never silent."""

    def __init__(self, timeout_s: float = HEARTBEAT_TIMEOUT_S):
        self.timeout_s = timeout_s
        self.seen: dict[int, tuple[int, float]] = {}

    def silent(self, counts: dict[int, int], now: float) -> tuple[int, float] | None:
        """(node, seconds its counter stood still) for the first node silent for longer than the timeout, else None."""
        for node, count in counts.items():
            if node not in self.seen or self.seen[node][0] != count:
                self.seen[node] = (count, now)
            elif count and now - self.seen[node][1] > self.timeout_s:
                return node, now - self.seen[node][1]
        return None


_WATCHING: list = []        # this process's Watch, once it watches (stop_if_announced reads it)


class Watch:
    """A daemon thread polling the default process group's store for STOP_KEY and the other nodes' heartbeats."""

    def __init__(self, run_dir: Path, rank: int, store, others: list[int], timeout_s: float):
        self.run_dir, self.rank, self.store = run_dir, rank, store
        self.others = others                    # the other nodes, whose launchers' counters this rank reads
        self.heartbeats = Heartbeats(timeout_s)
        self.done = threading.Event()
        _WATCHING.append(self)
        threading.Thread(target=self._run, name="labs-peers", daemon=True).start()

    def announced(self) -> str | None:
        """The reason another node's launcher stored under STOP_KEY, or None (none yet, or the store is gone)."""
        try:
            return self.store.get(STOP_KEY).decode(errors="replace") if self.store.check([STOP_KEY]) else None
        except Exception:
            return None

    def stop_if_announced(self):
        """Stop this rank, with the other node's reason, if a stop was announced (from the watcher's thread, or from
        the rank's failure path: labs.peers.stop_if_announced)."""
        why = self.announced()
        if why is not None:
            self._stop(f"another node's run stopped ({why})")

    def finished(self):
        """The training loop is over: the store may close with node 0 from now on, which is no failure."""
        self.done.set()

    def _run(self):
        keys = [HEARTBEAT_KEY.format(node) for node in self.others]
        while not self.done.wait(POLL_S):
            try:
                self.stop_if_announced()
                now = time.monotonic()          # before reading: a reading returned late is never taken as older
                # multi_get waits for missing keys: until every node's exists, read them through add(key, 0), which
                # creates a missing one at 0
                found = self.store.multi_get(keys) if self.store.check(keys) else [self.store.add(k, 0) for k in keys]
                counts = dict(zip(self.others, map(int, found)))
            except Exception:                   # the store is gone: node 0 left, unless this run just finished
                if not self.done.wait(2 * POLL_S):
                    self._stop("the run's rendezvous store on node 0 is gone")
                return
            silent = self.heartbeats.silent(counts, now)
            if silent and not self.done.is_set():
                node, seconds = silent
                self._stop(f"node {node}'s launcher stopped answering: its heartbeat has not moved for {seconds:.0f} s"
                           " (the node was killed, or lost its network)")

    def _stop(self, why: str):
        message = f"labs: rank {self.rank} stops: {why}"
        (self.run_dir / f"rank{self.rank}.err").write_text(message + "\n")    # the launcher shows it first
        print(message, file=sys.stderr, flush=True)
        os._exit(1)                             # the main thread may be blocked in a collective that never returns


def stop_if_announced():
    """Where a rank's training raised: if another node's stop was announced, stop as the watcher would, with that
    reason, not with the error. The other node's ranks leaving break a collective this rank was in, and the error
    (gloo: a closed connection) can come before this rank's watcher polls the store, up to POLL_S later. Seen on two
    emulated nodes (tests/test_multinode.py): node 0 reported a gloo traceback for a stop the test had announced."""
    for watch in _WATCHING:
        watch.stop_if_announced()


class _Nothing:
    def finished(self):
        pass


def local_world_size() -> int:
    """Ranks per node, from the launcher: torchrun's LOCAL_WORLD_SIZE, DeepSpeed's LOCAL_SIZE; else one node."""
    return int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or dist.get_world_size())


def watch(run_dir: Path, rank: int):
    """Start watching when this run spans several nodes (more ranks in the world than on this node). Node K holds
    ranks K*L .. K*L+L-1 (L ranks per node), under both launchers (labs.multinode.global_rank)."""
    per_node = local_world_size()
    if dist.get_world_size() <= per_node:
        return _Nothing()
    store = dist.distributed_c10d._get_default_store()
    while isinstance(store, dist.PrefixStore):      # torchrun and the process group prefix their keys; the launcher
        store = store.underlying_store              # writes STOP_KEY and its counter as they are
    others = [node for node in range(dist.get_world_size() // per_node) if node != rank // per_node]
    timeout_s = float(os.environ.get(TIMEOUT_ENV) or HEARTBEAT_TIMEOUT_S)
    return Watch(run_dir, rank, store, others, timeout_s)


@contextlib.contextmanager
def heartbeat(nodes):
    """While the block runs, bump this node's counter in the run's store about once a second (from a thread of
    the launcher's process). `nodes`: a labs.multinode.Nodes, or None (one host: nothing to do). DeepSpeed's
    runner starting every node from one (no node rank) beats for none: the other nodes run no labs process."""
    if nodes is None or nodes.node_rank is None:
        yield
        return
    stopped = threading.Event()
    threading.Thread(target=_beat, args=(nodes.host, nodes.port, HEARTBEAT_KEY.format(nodes.node_rank), stopped),
                     name="labs-heartbeat", daemon=True).start()
    try:
        yield
    finally:
        stopped.set()                       # the thread beats no more (it may still be connecting: never waited for)


def _beat(host: str, port: int, key: str, stopped: threading.Event):
    """Every POLL_S, store this launcher's count of beats under `key`. The store closes with node 0's run, at every
    run's end too, and c10d prints a C++ trace for each call that finds it gone: so each beat first checks that the
    store still answers (`_answers`), and the count is `set` (which awaits no reply), not `add`ed. Any error:
    connect again (giving up would make a live node look dead to every other)."""
    beats, store = 0, None
    while not stopped.wait(POLL_S):
        try:
            _answers(host, port, timeout_s=5.0)
            store = store or _client(host, port, timeout_s=5.0)
            beats += 1
            store.set(key, str(beats))
        except Exception:
            store = None


def announce(host: str, port: int, reason: str, timeout_s: float = 5.0) -> bool:
    """Tell the other nodes' ranks to stop; False when the store is gone already (its node stopped first)."""
    try:
        _client(host, port, timeout_s).set(STOP_KEY, reason)
        return True
    except Exception:
        return False


def _client(host: str, port: int, timeout_s: float):
    """A client of the run's store; a store that is gone fails at once and quietly (`_answers`), where c10d's own
    client would retry until its timeout and print a C++ trace for every try."""
    _answers(host, port, timeout_s)
    return dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))


def _answers(host: str, port: int, timeout_s: float):
    """OSError unless the store's port accepts a connection (opened and closed, nothing sent)."""
    socket.create_connection((host, port), timeout=timeout_s).close()
