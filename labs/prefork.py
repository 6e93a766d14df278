"""A warm start for CPU launches: one process per labs process that has imported what a CPU launcher and its ranks
import (torch, DeepSpeed, transformers' Qwen2), and forks the launcher (labs.fork_launcher) of each run from there.

    process = prefork.start(command, env)     # command: [python, "-m", "labs.fork_launcher", ...]; a Popen look-alike

labs.fork_launcher spares each rank the imports; this spares the launcher. Started as a fresh interpreter, a CPU
launcher spends about 5 s of CPU importing before it forks a rank, a quarter of a tiny 2-rank run's CPU (2-core VM,
2026-12-07). A notebook or test session that launches many runs pays it once here.

A launcher forked from here gets what `python -m labs.supervisor python -m labs.fork_launcher ...` gets: a session
of its own (labs stops a run with SIGTERM to the launcher's process group, then SIGKILL), SIGTERM when its parent
dies, default signal handling, stdout and stderr on the pipe labs reads, the run's environment and working folder,
no other file descriptor (stdin is /dev/null, where the exec'd launcher inherits labs' own; neither reads it), and
labs' own modules imported afresh (an edit to labs/ between two runs of one notebook reaches the ranks, as it would
with a new interpreter): only third-party modules come from the server. It exits as that interpreter would (its exit
code, a traceback for an exception), except that it skips the wait for non-daemon threads at the very end.

A server serves the labs process that started it: when that process is gone (its stdin, a pipe that process holds,
closes, however it ended), that process's launchers take SIGTERM from it and stop their ranks. It is
started with the first run's environment: variables read when an interpreter starts or imports (PYTHONPATH,
GLIBC_TUNABLES, DS_ACCELERATOR, ...) are fixed from then on, so a run whose environment differs in any other than
the per-run ones below gets a server of its own, and an idle one is retired.

That process's children use its server too (SERVER_ENV names it, with a digest of its environment): a test's or a
notebook cell's `labs train` then starts warm, as its parent's runs do, where it would pay the imports again (about
35 such launches in `make test`). A child's launcher gets SIGTERM from the server when that child exits, however it
ended, and runs on when the parent retires the server or exits: the server then takes no more requests and exits
once the children's launchers have ended. A child whose runs' environment differs, or whose parent's server is gone
or refuses it, starts its own. Should the server itself die, every launcher it forked takes SIGTERM (parent death).

This module is labs' side; labs.prefork_server is the server's (and says how the two talk).
"""
from __future__ import annotations

import array
import contextlib
import hashlib
import json
import os
import secrets
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

from labs import prefork_server, supervisor

# Variables that may differ between the runs one server serves, since nothing reads them before the fork: the rank's
# threads (labs.rank.forked sets torch's and OpenMP's from OMP_NUM_THREADS; the server itself runs with one), the
# ranks per node, pytest's name of the test now running (it changes in its process for every test), and labs' own
# settings (labs' modules are imported afresh after the fork).
PER_RUN_VARIABLES = ("OMP_NUM_THREADS", "LOCAL_SIZE", "PYTEST_CURRENT_TEST")
PER_RUN_PREFIX = "LABS_"
SERVER_ENV = "LABS_PREFORK_SERVER"      # "NAME:DIGEST ...": the servers this process uses, for its children
LAUNCHER = ["-m", "labs.fork_launcher"]
START_TIMEOUT_S = 300       # the imports take 5-8 s on a 2-core VM; far more on a loaded host


# ------------------------------------------------------------------------------------------------ labs' side
class Server:
    """One warm server, as labs sees it: the process, the socket to it, its log, how many of its launchers run."""

    def __init__(self, env: dict):
        self.control, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.log, self.running = tempfile.TemporaryFile(), 0
        self.name = f"labs-prefork-{os.getpid()}-{secrets.token_hex(8)}"     # its socket for this process's children
        # stdin: the pipe whose end this process holds until it exits; a session of its own: a Ctrl-C in a terminal
        # reaches labs, which stops its runs, not the server
        self.process = subprocess.Popen([sys.executable, "-m", "labs.prefork_server", str(theirs.fileno()), self.name],
                                        env=dict(env, OMP_NUM_THREADS="1"), stdin=subprocess.PIPE, stdout=self.log,
                                        stderr=self.log, pass_fds=[theirs.fileno()], start_new_session=True)
        self.pid = self.process.pid
        theirs.close()
        try:
            self.control.settimeout(START_TIMEOUT_S)
            with contextlib.suppress(OSError):
                if self.control.recv(64) == prefork_server.READY:
                    self.control.settimeout(None)
                    return
            raise RuntimeError(f"labs.prefork: the warm server failed to start:\n{self.log_tail()}")
        except BaseException:
            self.process.kill()
            self.retire()
            raise

    def log_tail(self) -> str:
        self.log.seek(0)
        return self.log.read()[-4000:].decode(errors="replace")

    def alive(self) -> bool:
        return self.process.poll() is None

    def retire(self):
        """Close its stdin and socket: the server exits, once the launchers it forked for this process's children
        have ended (this process's own, if any, take SIGTERM). Not waited for: it may serve a child for hours."""
        self.control.close()
        self.process.stdin.close()


class ParentServer:
    """The server of the labs process that started this one, as Server is used: a connection to it."""

    def __init__(self, name: str):
        self.name, self.control, self.running = name, socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET), 0
        try:
            self.control.connect("\0" + name)
            self.pid, uid, _ = prefork_server.peer(self.control)
            if uid != os.geteuid():     # not labs' server: whoever took the name after it, another user
                raise ConnectionRefusedError(f"{name} is another user's")
        except OSError:
            self.control.close()
            raise

    def log_tail(self) -> str:
        return "(its log is with the labs process that started it)"

    def alive(self) -> bool:
        return not _readable(self.control.fileno(), 0)      # a live server never writes to it: EOF if it is gone

    def retire(self):
        self.control.close()


class Launch:
    """What labs.supervisor.run uses of a subprocess.Popen: pid, stdout, wait(timeout), poll(), returncode."""

    def __init__(self, server: Server, stdout, status_fd: int):
        self.server, self.stdout, self._status = server, stdout, status_fd
        self.pid, self.returncode, self._said = None, None, b""
        server.running += 1

    def read_pid(self):
        while not self._said.endswith(b"\n") and (chunk := os.read(self._status, 1)):
            self._said += chunk
        if not self._said.startswith(b"pid "):
            raise RuntimeError(f"labs.prefork: the warm server did not start the launcher ({self._said.decode()!r}):"
                               f"\n{self.server.log_tail()}")
        self.pid, self._said = int(self._said.split()[1]), b""

    def poll(self):
        if self.returncode is None and _readable(self._status, 0):
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.wait(0)
        return self.returncode

    def wait(self, timeout=None):
        if self.returncode is not None:
            return self.returncode
        if not _readable(self._status, timeout):
            raise subprocess.TimeoutExpired("labs.fork_launcher", timeout)
        while chunk := os.read(self._status, 64):
            self._said += chunk
        if not self._said.startswith(b"exit "):
            # The server died: the launcher took SIGTERM (parent death) and is stopping its ranks; it is not our
            # child, so wait for it by its pid (stop() escalates to SIGKILL if it takes too long).
            deadline = None if timeout is None else time.monotonic() + timeout
            while _exists(self.pid):
                if deadline is not None and time.monotonic() > deadline:
                    raise subprocess.TimeoutExpired("labs.fork_launcher", timeout)
                time.sleep(0.1)
            print(f"labs.prefork: the warm server (pid {self.server.pid}) ended during the run; its log "
                  f"ended:\n{self.server.log_tail()}", file=sys.stderr, flush=True)
        self.close(int(self._said.split()[1]) if self._said.startswith(b"exit ") else -signal.SIGTERM)
        return self.returncode

    def close(self, returncode: int):
        self.returncode = returncode
        with _lock:
            self.server.running -= 1
        os.close(self._status)


def _readable(fd: int, timeout) -> bool:
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(None if timeout is None else timeout * 1000))


def _exists(pid: int) -> bool:
    """Whether `pid` still runs: not a zombie that no init reaps (a container without one), not gone."""
    try:
        return supervisor.stat_fields(pid)[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


_servers: dict[tuple, Server | ParentServer] = {}
_passed_over: set[str] = set()          # parents' servers that failed this process: not asked again
_lock = threading.Lock()


def start(command: list[str], env: dict) -> Launch:
    """Start `command` (python -m labs.fork_launcher ARGS) forked from this process's warm server for `env`. An
    interrupt while it starts stops the launcher, if the server started one, before it goes on."""
    assert command[1:3] == LAUNCHER, command
    env = {name: value for name, value in env.items() if name != SERVER_ENV}        # the ranks start no runs
    request = json.dumps({"argv": command[3:], "env": env, "cwd": os.getcwd()}).encode()
    out_read, out_write = os.pipe()
    status_read, status_write = os.pipe()
    ours, launch = [out_write, status_write, out_read, status_read], None
    try:
        with _lock:
            server = _server(env)
            launch = Launch(server, os.fdopen(out_read, "rb"), status_read)
            del ours[2:]                # the read ends are the launch's now
            try:
                _send(server, request, ours)
            except OSError:
                if not isinstance(server, ParentServer):
                    raise
                # the parent's server went away since this process connected, or refused it: start its own
                _passed_over.add(server.name)
                _servers.pop(_key(env)).retire()
                launch.server = server = _server(env)
                server.running += 1
                _send(server, request, ours)
        _close(ours)                    # the server has its copies: ours would keep the pipes open if it died
        launch.read_pid()
        return launch
    except BaseException:
        _close(ours)
        if launch is not None:
            # ignored while the half-started launch is cleaned up (main thread only)
            with supervisor.signals_handled((signal.SIGINT, signal.SIGTERM, signal.SIGHUP), signal.SIG_IGN):
                if launch.pid is None:
                    with contextlib.suppress(Exception):
                        launch.read_pid()          # the server answers at once (EOF if it never got the request)
                if launch.pid is not None:
                    supervisor.stop(launch)
                elif launch.returncode is None:
                    launch.close(-signal.SIGTERM)
            launch.stdout.close()
        raise


def _send(server, request: bytes, fds: list[int]):
    server.control.sendmsg([request], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])


def warm(env: dict):
    """Have a server for runs with environment `env` now (its own or its parent's), for this process's children;
    as before a run, an idle server for another environment is retired."""
    with _lock:
        _server(env)


def _close(fds: list[int]):
    while fds:
        os.close(fds.pop())


def _key(env: dict) -> tuple:
    """What a server's environment must match: every variable but the per-run ones."""
    return tuple(sorted((name, value) for name, value in env.items()
                        if name not in PER_RUN_VARIABLES and not name.startswith(PER_RUN_PREFIX)))


def _digest(key: tuple) -> str:
    return hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]


def _server(env: dict) -> Server | ParentServer:
    key = _key(env)
    if key in _servers and _servers[key].alive():
        return _servers[key]
    for other in [k for k, s in _servers.items() if s.running == 0 or not s.alive()]:
        _servers.pop(other).retire()                # at most one idle server per labs process
    offered = {}                                    # digest -> name: the servers this process's parent uses
    for entry in os.environ.get(SERVER_ENV, "").split():
        name, _, digest = entry.rpartition(":")
        offered[digest] = name
    try:
        if offered[_digest(key)] in _passed_over:
            raise KeyError(offered[_digest(key)])
        _servers[key] = ParentServer(offered[_digest(key)])
    except (KeyError, OSError):                     # none for this environment, or gone: this process starts its own
        _servers[key] = Server(env)
    os.environ[SERVER_ENV] = " ".join(f"{server.name}:{_digest(k)}" for k, server in _servers.items())
    return _servers[key]
