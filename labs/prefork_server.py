"""The warm server of labs.prefork: `python -m labs.prefork_server FD`, started by labs.prefork.Server.

It imports what a CPU launcher and its ranks import, then serves requests on the Unix SEQPACKET socket FD: each is
one message, the JSON request (argv, env, cwd) and two file descriptors (the write ends of the run's output pipe and
of its status pipe). It forks the launcher, writes "pid N" to the status pipe, and "exit CODE" (CODE negative for a
signal, as Popen's returncode) when it reaps it, or "error ..." if it could not fork. It exits when its stdin or the
socket closes. The forked launcher sets itself up as labs.prefork's docstring lists, then runs labs.fork_launcher.
"""
import array
import atexit
import contextlib
import importlib
import json
import os
import select
import signal
import socket
import sys
import traceback

from labs import supervisor

READY = b"ready"      # the server has done its imports


def serve(control: socket.socket):
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)      # only to wake the loop: children are reaped below
    control.send(READY)
    status_fds = {}                                     # launcher pid -> write end of its status pipe
    poller = select.poll()
    for fd in (sys.stdin.fileno(), control.fileno(), wake_read):
        poller.register(fd, select.POLLIN)
    while True:
        ready = {fd for fd, _ in poller.poll()}
        if wake_read in ready:
            os.read(wake_read, 4096)
            _reap(status_fds)
        if control.fileno() in ready:
            message, ancillary, _, _ = control.recvmsg(1 << 20, socket.CMSG_SPACE(2 * array.array("i").itemsize))
            if not message:
                return      # labs closed the socket: it retired this server, or it is gone
            fds = _fds(ancillary)
            if len(fds) == 2:
                _fork_launcher(json.loads(message), fds, status_fds)
            else:               # not a request labs.prefork sends (it sends two): fail it, keep serving
                for fd in fds:
                    os.close(fd)
        if sys.stdin.fileno() in ready and not os.read(sys.stdin.fileno(), 4096):
            return          # the labs process that started this server is gone; our launchers follow (parent death)


def _fork_launcher(request: dict, fds: list[int], status_fds: dict):
    """Fork the launcher of one request; an error here fails that run (its status pipe says why), not the server."""
    out_write, status_write = fds
    pid = None
    try:
        server = os.getpid()
        pid = os.fork()
        if pid == 0:
            _launcher(request, out_write, server)
        os.write(status_write, f"pid {pid}\n".encode())
        status_fds[pid] = status_write
    except OSError as error:
        if pid:                 # forked, but labs can no longer hear of it (it closed its end): nobody would stop it
            os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            os.write(status_write, f"error {error}\n".encode())
        os.close(status_write)
    finally:
        os.close(out_write)


def _fds(ancillary) -> list[int]:
    fds = array.array("i")
    for _, _, data in ancillary:
        fds.frombytes(data[:len(data) - len(data) % fds.itemsize])
    return list(fds)


def _reap(status_fds: dict):
    while True:
        try:
            pid, code = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        if pid in status_fds:
            fd = status_fds.pop(pid)
            with contextlib.suppress(OSError):      # labs may be gone
                os.write(fd, f"exit {os.waitstatus_to_exitcode(code)}\n".encode())
            os.close(fd)


def _launcher(request: dict, out_write: int, server: int):
    """The forked child: become the run's launcher (as labs.supervisor's exec would), then run labs.fork_launcher."""
    code = 1
    try:
        os.setsid()
        supervisor.die_with_parent(signal.SIGTERM)
        if os.getppid() != server:      # the server died before the line above: nobody would stop us
            os._exit(1)
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
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
    except SystemExit as stop:          # as the interpreter treats it
        if isinstance(stop.code, int) or stop.code is None:
            code = stop.code
        else:
            print(stop.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        with contextlib.suppress(BaseException):
            atexit._run_exitfuncs()     # what the interpreter runs at exit (multiprocessing's, logging's, ...)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code or 0)


def preload():
    """The third-party modules a CPU launcher and its ranks import (labs.fork_launcher imports them through here)."""
    import deepspeed.runtime.engine  # noqa: F401  (what deepspeed.initialize imports: not its Muon modules, labs.env)
    import deepspeed.runtime.zero.stage3  # noqa: F401
    import deepspeed.runtime.zero.stage_1_and_2  # noqa: F401
    import torch.distributed.run  # noqa: F401
    from transformers.models.qwen2 import modeling_qwen2  # noqa: F401  (labs.models builds it in every rank)


if __name__ == "__main__":
    import gc

    gc.disable()        # as labs.rank does: the imports make ~570,000 objects and next to no garbage
    preload()
    gc.freeze()
    serve(socket.socket(fileno=int(sys.argv[1])))
