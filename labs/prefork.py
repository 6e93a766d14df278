"""A warm start for CPU launches: one process per labs process that has imported what a CPU launcher and its ranks
import (torch, DeepSpeed, transformers' Qwen2), and forks the launcher (labs.fork_launcher) of each run from there.

    process = prefork.start(command, env)     # command: [python, "-m", "labs.fork_launcher", ...]; a Popen look-alike

labs.fork_launcher spares each rank the imports; this spares the launcher. Started as a fresh interpreter, a CPU
launcher spends about 5 s of CPU importing before it forks a rank, a quarter of a tiny 2-rank run's CPU (2-core VM,
2026-12-07). A notebook or test session that launches many runs pays it once here.

What a launcher forked from here gets is what `python -m labs.supervisor python -m labs.fork_launcher ...` gets:
- its own session (labs stops a run with SIGTERM to the launcher's process group, then SIGKILL), SIGTERM when its
  parent dies, default signal handling, stdin from /dev/null, stdout and stderr to the pipe labs reads, no other file
  descriptor, the run's environment and working folder;
- labs' own modules imported afresh (an edit to labs/ between two runs of one notebook reaches the ranks, as it
  would with a fresh interpreter); only the third-party modules come from this server.
This server lives as long as the labs process that started it: it exits when its stdin (a pipe that process holds)
closes, however that process ended, and its launchers then take SIGTERM (parent death) and stop their ranks.
Variables read when an interpreter starts (PYTHONPATH, GLIBC_TUNABLES, ...) are the server's: a run whose
environment differs in any variable but THREAD_VARIABLES gets a server of its own.

Protocol: a Unix SEQPACKET socket pair. labs sends one message per run, the JSON request and two file descriptors
(the write ends of the output pipe and of a status pipe); the server forks, writes "pid N" to the status pipe, and
"exit CODE" (CODE negative for a signal, as Popen's returncode) when it reaps the launcher.
"""
from __future__ import annotations

import array
import importlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import traceback

from labs import supervisor

# Read by each rank (it sets its threads from it: labs.rank.forked) or on use, not when an interpreter starts.
THREAD_VARIABLES = ("OMP_NUM_THREADS", "LOCAL_SIZE")
LAUNCHER = ["-m", "labs.fork_launcher"]
READY = b"ready"
START_TIMEOUT_S = 300       # the imports take 5-8 s on a 2-core VM; far more on a loaded host


# ------------------------------------------------------------------------------------------------ labs' side
class Launch:
    """What labs.supervisor.run uses of a subprocess.Popen: pid, stdout, wait(timeout), poll(), returncode."""

    def __init__(self, pid: int, stdout, status_fd: int):
        self.pid, self.stdout, self._status, self.returncode = pid, stdout, status_fd, None

    def poll(self):
        if self.returncode is None and not select.select([self._status], [], [], 0)[0]:
            return None
        return self.wait()

    def wait(self, timeout=None):
        if self.returncode is None:
            if not select.select([self._status], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired("labs.fork_launcher", timeout)
            message = b""
            while chunk := os.read(self._status, 64):
                message += chunk
            os.close(self._status)
            # no exit line: the server itself was killed, and the launcher with it (parent death: SIGTERM)
            self.returncode = int(message.split()[1]) if message.startswith(b"exit ") else -signal.SIGTERM
        return self.returncode


_servers: dict[tuple, tuple[subprocess.Popen, socket.socket]] = {}
_lock = threading.Lock()


def start(command: list[str], env: dict) -> Launch:
    """Start `command` (python -m labs.fork_launcher ARGS) forked from this process's warm server for `env`."""
    assert command[1:3] == LAUNCHER, command
    out_read, out_write = os.pipe()
    status_read, status_write = os.pipe()
    request = json.dumps({"argv": command[3:], "env": env, "cwd": os.getcwd()}).encode()
    with _lock:
        control = _server(env)
        fds = array.array("i", [out_write, status_write])
        control.sendmsg([request], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
    os.close(out_write)
    os.close(status_write)
    line = b""
    while not line.endswith(b"\n") and (chunk := os.read(status_read, 1)):
        line += chunk
    if not line.startswith(b"pid "):
        os.close(status_read)
        os.close(out_read)
        raise RuntimeError(f"labs.prefork: the warm server did not start the launcher ({line!r})")
    return Launch(int(line.split()[1]), os.fdopen(out_read, "rb"), status_read)


def _key(env: dict) -> tuple:
    return tuple(sorted((k, v) for k, v in env.items() if k not in THREAD_VARIABLES))


def _server(env: dict) -> socket.socket:
    key = _key(env)
    if key in _servers and _servers[key][0].poll() is None:
        return _servers[key][1]
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    log = tempfile.TemporaryFile()
    # stdin: the pipe whose end this process holds until it exits; a session of its own: a Ctrl-C in a terminal
    # reaches labs, which stops its runs, not the server
    server = subprocess.Popen([sys.executable, "-m", "labs.prefork", str(theirs.fileno())], env=env,
                              stdin=subprocess.PIPE, stdout=log, stderr=log, pass_fds=[theirs.fileno()],
                              start_new_session=True)
    theirs.close()
    mine.settimeout(START_TIMEOUT_S)
    try:
        ready = mine.recv(64)
    except OSError:
        ready = b""
    except BaseException:
        server.kill()
        raise
    if ready != READY:
        server.kill()
        server.wait()
        log.seek(0)
        raise RuntimeError(f"labs.prefork: the warm server failed to start:\n{log.read().decode(errors='replace')}")
    mine.settimeout(None)
    _servers[key] = (server, mine)
    return mine


# ------------------------------------------------------------------------------------------------ the server
def serve(control: socket.socket):
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)      # only to wake the loop: children are reaped below
    control.send(READY)
    status = {}                                         # launcher pid -> write end of its status pipe
    while True:
        ready = select.select([sys.stdin.fileno(), control, wake_read], [], [])[0]
        if wake_read in ready:
            os.read(wake_read, 4096)
            _reap(status)
        if control in ready:
            message, fds, _, _ = control.recvmsg(1 << 20, socket.CMSG_SPACE(2 * array.array("i").itemsize))
            if not message:
                break
            out_write, status_write = _fds(fds)
            pid = os.fork()
            if pid == 0:
                _launcher(json.loads(message), out_write)
            os.close(out_write)
            os.write(status_write, f"pid {pid}\n".encode())
            status[pid] = status_write
        if sys.stdin.fileno() in ready and not os.read(sys.stdin.fileno(), 4096):
            break           # the labs process that started this server is gone; our launchers follow (parent death)


def _fds(ancillary) -> tuple[int, int]:
    fds = array.array("i")
    for _, _, data in ancillary:
        fds.frombytes(data[:len(data) - len(data) % fds.itemsize])
    return fds[0], fds[1]


def _reap(status: dict):
    while True:
        try:
            pid, code = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        if pid in status:
            fd = status.pop(pid)
            os.write(fd, f"exit {os.waitstatus_to_exitcode(code)}\n".encode())
            os.close(fd)


def _launcher(request: dict, out_write: int):
    """The forked child: become the run's launcher (as labs.supervisor's exec would), then run labs.fork_launcher."""
    code = 1
    try:
        os.setsid()
        server = os.getppid()
        supervisor.die_with_parent(signal.SIGTERM)
        if os.getppid() != server:
            os._exit(1)
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        sys.stdout.flush()
        sys.stderr.flush()
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(out_write, 1)
        os.dup2(out_write, 2)
        os.closerange(3, os.sysconf("SC_OPEN_MAX"))
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        for name in [m for m in sys.modules if m == "labs" or m.startswith("labs.")]:
            del sys.modules[name]
        launcher = importlib.import_module("labs.fork_launcher")
        sys.argv = [launcher.__file__, *request["argv"]]        # as `python -m labs.fork_launcher` has it
        code = launcher.main(request["argv"])
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code or 0)


def preload():
    """The third-party modules a CPU launcher and its ranks import (labs.fork_launcher's list)."""
    import deepspeed.runtime.engine  # noqa: F401
    import deepspeed.runtime.zero.stage3  # noqa: F401
    import deepspeed.runtime.zero.stage_1_and_2  # noqa: F401
    import torch.distributed.run  # noqa: F401
    from transformers.models.qwen2 import modeling_qwen2  # noqa: F401


if __name__ == "__main__":
    import gc

    gc.disable()
    preload()
    gc.freeze()
    serve(socket.socket(fileno=int(sys.argv[1])))
