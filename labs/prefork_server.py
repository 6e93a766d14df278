"""The warm server of labs.prefork: `python -m labs.prefork_server FD NAME`, started by labs.prefork.Server.

It imports what a CPU launcher and its ranks import, then serves requests on the Unix SEQPACKET socket FD (from the
labs process that started it) and on connections to the abstract Unix socket NAME (from that process's children: a
test's `labs train`, a notebook's emulated node; labs.prefork says when they may use it). Each request is one
message, the JSON request (argv, env, cwd) and two file descriptors (the write ends of the run's output pipe and of
its status pipe). It forks the launcher, writes "pid N" to the status pipe, and "exit CODE" (CODE negative for a
signal, as Popen's returncode) when it reaps it, or "error ..." if it could not fork. When a labs process exits
before its launchers do, they get SIGTERM from here, as if it had been their parent. When its stdin or FD closes
(the labs process that started it is gone, or retired it), the server takes no more requests, and exits once the
launchers it forked for other labs processes have ended. The forked launcher sets itself up as labs.prefork's
docstring lists, then runs labs.fork_launcher.
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


PEERCRED = "iII"        # struct ucred: pid, uid, gid


class _Client:
    """A labs process that asks for launchers: its socket, its uid, a pidfd that turns readable when it exits (for
    any but the one that started this server, whose exit closes this server's stdin), and the launchers it asked for
    that still run."""

    def __init__(self, sock: socket.socket, watch=True):
        self.sock, self.gone, self.launchers = sock, False, set()
        self.pid, self.uid, _ = peer(sock)
        self.exited = os.pidfd_open(self.pid) if watch else None


def peer(sock: socket.socket) -> tuple[int, int, int]:
    return struct.unpack(PEERCRED, sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize(PEERCRED)))


def _listen(name: str) -> socket.socket | None:
    """The socket the children of labs' process reach this server on; None where the kernel cannot watch a process
    (pidfd, Linux >= 5.3): nobody would stop their launchers, so they start servers of their own."""
    try:
        os.close(os.pidfd_open(os.getpid()))
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        listener.bind("\0" + name)
        listener.listen(64)
        return listener
    except (AttributeError, OSError):
        return None


def serve(control: socket.socket, name: str):
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)      # only to wake the loop: children are reaped below
    listener = _listen(name)
    control.send(READY)
    status_fds = {}                                     # launcher pid -> (write end of its status pipe, client)
    poller = select.poll()
    for fd in (sys.stdin.fileno(), wake_read, *([listener.fileno()] if listener else [])):
        poller.register(fd, select.POLLIN)
    creator = _Client(control, watch=False)
    clients, exits = {control.fileno(): creator}, {}    # socket fd -> client; pidfd -> client
    poller.register(control.fileno(), select.POLLIN)
    closing = False
    while not (closing and not status_fds):
        ready = {fd for fd, _ in poller.poll()}
        if wake_read in ready:
            os.read(wake_read, 4096)
            _reap(status_fds)
        if listener and listener.fileno() in ready:
            _accept(listener, clients, exits, poller)
        for fd in ready & set(clients):
            client = clients[fd]
            message, ancillary, _, _ = client.sock.recvmsg(1 << 20, socket.CMSG_SPACE(2 * array.array("i").itemsize))
            fds = _fds(ancillary)
            if not message:                             # it closed its connection; its launchers run on
                poller.unregister(fd)
                client.sock.close()
                del clients[fd]
                closing = closing or client is creator  # labs retired this server, or it is gone
            elif len(fds) == 2 and not closing and not client.gone:
                with contextlib.suppress(ValueError):   # not JSON: the status pipe closes unanswered
                    _fork_launcher(json.loads(message), fds, status_fds, client)
                    continue
            for passed in fds:                          # a request labs.prefork does not send: fail it
                with contextlib.suppress(OSError):
                    os.close(passed)
        for fd in ready & set(exits):
            _stop_launchers(exits.pop(fd))              # it exited: its launchers stop, as at their parent's death
            poller.unregister(fd)
            os.close(fd)
        if sys.stdin.fileno() in ready and not os.read(sys.stdin.fileno(), 4096):
            poller.unregister(sys.stdin.fileno())       # the labs process that started this server is gone
            _stop_launchers(creator)
            closing = True
        if closing and listener:
            poller.unregister(listener.fileno())
            listener.close()
            listener = None


def _accept(listener: socket.socket, clients: dict, exits: dict, poller):
    sock = listener.accept()[0]
    try:
        client = _Client(sock)
    except OSError:                                     # it is gone already (or in another pid namespace)
        sock.close()
        return
    if client.uid != os.geteuid():                      # another user's process may not start ours
        sock.close()
        os.close(client.exited)
        return
    clients[sock.fileno()], exits[client.exited] = client, client
    poller.register(sock.fileno(), select.POLLIN)
    poller.register(client.exited, select.POLLIN)


def _stop_launchers(client: _Client):
    client.gone = True                                  # a request it left queued is not served
    for pid in client.launchers:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)


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
    """The third-party modules a CPU launcher and its ranks import, and DeepSpeed's probe of its ops, which they
    would each run (labs.fork_launcher imports them through here)."""
    import deepspeed.runtime.engine  # noqa: F401  (what deepspeed.initialize imports: not its Muon modules, labs.env)
    import deepspeed.runtime.zero.stage3  # noqa: F401
    import deepspeed.runtime.zero.stage_1_and_2  # noqa: F401
    import torch.distributed.run  # noqa: F401
    from transformers.models.qwen2 import modeling_qwen2  # noqa: F401  (labs.models builds it in every rank)
    import deepspeed.ops

    # Which of DeepSpeed's ops can build here, probed once (a C compile against libaio, `file`, `uname`: 0.09 s on
    # the 2-core VM) instead of in every rank on its first look (labs.env.skip_shm_comm_op, DeepSpeed's comm layer)
    deepspeed.ops.__compatible_ops__  # noqa: B018


if __name__ == "__main__":
    import gc

    gc.disable()        # as labs.rank does: the imports make ~570,000 objects and next to no garbage
    preload()
    gc.freeze()
    serve(socket.socket(fileno=int(sys.argv[1])), sys.argv[2])
