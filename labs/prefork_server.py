"""The warm server of labs.prefork: `python -m labs.prefork_server FD NAME`, started by labs.prefork.Server.

It imports what a CPU launcher and its ranks import, then serves requests on the Unix SEQPACKET socket FD (from the
labs process that started it) and on connections to the abstract Unix socket NAME (from that process's children: a
test's `labs train`, a notebook's emulated node; labs.prefork says when they may use it). Each request is one
message, the JSON request (argv, env, cwd) and two file descriptors (the write ends of the run's output pipe and of
its status pipe). It forks the launcher, writes "pid N" to the status pipe, and "exit CODE" (CODE negative for a
signal, as Popen's returncode) when it reaps it, or "error ..." if it could not fork. A launcher whose labs process
exits before it gets SIGTERM from here, as if that process had been its parent. The server exits when its stdin or
FD closes. The forked launcher sets itself up as labs.prefork's docstring lists, then runs labs.fork_launcher.
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
import struct
import sys
import traceback

from labs import supervisor

READY = b"ready"      # the server has done its imports


class _Client:
    """A labs process that asks for launchers: its socket, a pidfd that turns readable when it exits (opened at once,
    so a reused pid cannot stand in for it), and the launchers it asked for that still run."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.pid, self.uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                                     struct.calcsize("3i")))
        self.exited = os.pidfd_open(self.pid)
        self.launchers = set()


def serve(control: socket.socket, name: str):
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)      # only to wake the loop: children are reaped below
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind("\0" + name)
    listener.listen(64)
    control.send(READY)
    status_fds = {}                                     # launcher pid -> (write end of its status pipe, client)
    poller = select.poll()
    for fd in (sys.stdin.fileno(), listener.fileno(), wake_read):
        poller.register(fd, select.POLLIN)
    clients, exits = {}, {}                             # socket fd -> client; pidfd -> client
    _add(_Client(control), clients, exits, poller)
    while True:
        ready = {fd for fd, _ in poller.poll()}
        if wake_read in ready:
            os.read(wake_read, 4096)
            _reap(status_fds)
        if listener.fileno() in ready:
            sock = listener.accept()[0]
            try:
                client = _Client(sock)
            except OSError:                             # it is gone already (or in another pid namespace)
                sock.close()
                continue
            if client.uid == os.getuid():               # another user's process may not start ours
                _add(client, clients, exits, poller)
            else:
                sock.close()
                os.close(client.exited)
        for fd in ready & set(clients):
            client = clients[fd]
            message, ancillary, _, _ = client.sock.recvmsg(1 << 20, socket.CMSG_SPACE(2 * array.array("i").itemsize))
            fds = _fds(ancillary)
            if not message:
                if client.sock is control:
                    return      # labs closed the socket: it retired this server, or it is gone
                poller.unregister(fd)                   # it closed its connection; its launchers run on
                client.sock.close()
                del clients[fd]
            elif len(fds) == 2:
                _fork_launcher(json.loads(message), fds, status_fds, client)
            else:               # not a request labs.prefork sends (it sends two): fail it, keep serving
                for passed in fds:
                    os.close(passed)
        for fd in ready & set(exits):
            client = exits.pop(fd)                      # it exited: its launchers stop, as at their parent's death
            for pid in client.launchers:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
            poller.unregister(fd)
            os.close(fd)
        if sys.stdin.fileno() in ready and not os.read(sys.stdin.fileno(), 4096):
            return          # the labs process that started this server is gone; our launchers follow (parent death)


def _add(client: _Client, clients: dict, exits: dict, poller):
    clients[client.sock.fileno()], exits[client.exited] = client, client
    poller.register(client.sock.fileno(), select.POLLIN)
    poller.register(client.exited, select.POLLIN)


def _fork_launcher(request: dict, fds: list[int], status_fds: dict, client: _Client):
    """Fork the launcher of one request; an error here fails that run (its status pipe says why), not the server."""
    out_write, status_write = fds
    pid = None
    try:
        server = os.getpid()
        pid = os.fork()
        if pid == 0:
            _launcher(request, out_write, server)
        os.write(status_write, f"pid {pid}\n".encode())
        status_fds[pid] = status_write, client
        client.launchers.add(pid)
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
            fd, client = status_fds.pop(pid)
            client.launchers.discard(pid)
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
    serve(socket.socket(fileno=int(sys.argv[1])), sys.argv[2])
