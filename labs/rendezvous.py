"""The meeting point of a multi-node run, checked before any rank starts, and a failed meeting named after it.

    rendezvous.check_endpoint(nodes)     # node 0: the endpoint is this host and its port is free;
                                         # node K: wait (at most nodes.rdzv_timeout s) until node 0 answers;
                                         # DeepSpeed's hostfile runner: pdsh for several hosts, --master-addr
                                         # the first host's
    rendezvous.wait_for_endpoint("node0", 29500, timeout_s=5)
    rendezvous.free_port()               # a port for a launcher on this host (emulated nodes, chapter 8's routes)

An unreachable rendezvous is bad input: one LabsError line within the timeout, never a hang.
"""
from __future__ import annotations

import re
import shutil
import socket
import time

from labs.errors import LabsError
from labs.multinode import Nodes


def free_port() -> int:
    """A port nobody listens on now (the OS picks it), for one launcher's rendezvous on this host."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def check_endpoint(nodes: Nodes) -> None:
    """Bounded checks of the meeting point before any rank starts. Node 0 must be the endpoint's host, with the
    port free; every other node waits (at most rdzv_timeout seconds) for the port to answer. DeepSpeed's runner
    starting every host from here (a hostfile, no node rank): see _check_runner. No ssh connection is tried."""
    address_flag = flags(nodes)[0]
    try:
        addresses = _addresses(nodes.host, nodes.port)
    except socket.gaierror as exc:
        raise LabsError(f"{address_flag} host '{nodes.host}' does not resolve here ({exc.strerror}): give node 0's "
                        "name or IP address") from None
    if nodes.launcher == "deepspeed" and nodes.node_rank is None:
        _check_runner(nodes, addresses)
    elif nodes.node_rank == 0:
        _check_can_listen(nodes, addresses)
    elif nodes.node_rank:
        wait_for_endpoint(nodes.host, nodes.port, nodes.rdzv_timeout)


def _check_runner(nodes: Nodes, addresses: set) -> None:
    """DeepSpeed's runner (deepspeed/launcher/runner.py) starts the hosts in use through pdsh when there are several,
    and rank 0 runs on the first of them, which may or may not be this host: so pdsh must be installed, and
    --master-addr must be that first host's address (checked where both names resolve here); if it is this host, the
    port must be free. Its ssh check of the first host is the runner's own. One host in use is a local launch,
    whatever the host is called: rank 0 runs here, so --master-addr must be this host's."""
    first = next(iter(nodes.hosts))
    if len(nodes.hosts) == 1:
        _check_can_listen(nodes, addresses)
        return
    if shutil.which(REMOTE_LAUNCHER) is None:
        raise LabsError(f"--hostfile: DeepSpeed's launcher starts the {len(nodes.hosts)} hosts' ranks with "
                        f"{REMOTE_LAUNCHER}, which is not installed here: install it (e.g. `apt-get install "
                        f"{REMOTE_LAUNCHER}`) with passwordless ssh to every host, or run `labs train` on each host "
                        "with --node-rank K (no ssh)")
    try:
        first_addresses = _addresses(first, nodes.port)
    except socket.gaierror:
        return                          # a name only ssh knows (~/.ssh/config): nothing to compare here
    if not addresses & first_addresses:
        raise LabsError(f"--master-addr {nodes.host} ({', '.join(sorted(addresses))}) is not the hostfile's first host "
                        f"in use, {first} ({', '.join(sorted(first_addresses))}), where rank 0 runs: give that host's "
                        "address as --master-addr")
    if any(_bindable(address) for address in first_addresses):
        _check_can_listen(nodes, addresses)


def _addresses(host: str, port: int) -> set:
    return {info[4][0] for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)}


# DeepSpeed's runner reaches the other hosts with pdsh unless told otherwise (its --launcher; labs never tells it)
REMOTE_LAUNCHER = "pdsh"


def flags(nodes: Nodes) -> tuple[str, str]:
    """The flags the user typed for the meeting point's address and port: torchrun's or DeepSpeed's."""
    if nodes.launcher == "deepspeed":
        return "--master-addr", "--master-port"
    return "--rdzv-endpoint", "--rdzv-endpoint"


def _check_can_listen(nodes: Nodes, addresses: set) -> None:
    """One of the endpoint's addresses is this host's (a name may also resolve to addresses elsewhere, e.g. IPv6),
    and its port is free."""
    port_flag = flags(nodes)[1]
    if not any(_bindable(address) for address in addresses):
        where = f"{nodes.host} ({', '.join(sorted(addresses))})"
        if nodes.launcher == "deepspeed" and nodes.node_rank is None and len(nodes.hosts) == 1:
            raise LabsError(f"--hostfile names one host in use, which DeepSpeed's launcher starts on this machine "
                            f"(rank 0 here), but --master-addr {where} is not this host: give this host's address "
                            "as --master-addr, or leave it out")
        if nodes.launcher == "deepspeed":
            raise LabsError(f"--node-rank 0 is where rank 0 runs, but --master-addr {where} is not this host: run "
                            "node 0 there, or give this host's address as --master-addr")
        raise LabsError(f"--node-rank 0 runs where the rendezvous is, but {where} is not this host: run node 0 on it, "
                        "or name this host in --rdzv-endpoint")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind(("", nodes.port))
        except OSError:
            shown = nodes.port if nodes.launcher == "deepspeed" else nodes.endpoint
            raise LabsError(f"{port_flag} {shown}: port {nodes.port} is in use on this host; choose "
                            "another port (the same on every node)") from None


def _bindable(address: str) -> bool:
    with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((address, 0))
            return True
        except OSError:
            return False


def wait_for_endpoint(host: str, port: int, timeout_s: float, poll_s: float = 0.5) -> float:
    """Wait until HOST:PORT accepts a connection (node 0 may start a little later); returns the seconds waited.
    Nothing is sent: the connection opens and closes. A LabsError after `timeout_s`."""
    start = time.monotonic()
    while True:
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(2.0, timeout_s))):
                return time.monotonic() - start
        except OSError as exc:
            reason = exc.strerror or type(exc).__name__
        if time.monotonic() - start + poll_s > timeout_s:
            raise LabsError(f"the rendezvous {host}:{port} did not answer within {timeout_s:g} s ({reason}): start "
                            "node 0 first, check the address and that the port is open between the nodes, or raise "
                            "--rdzv-timeout")
        time.sleep(poll_s)


def rendezvous_failure(log: str) -> str | None:
    """One line when the launcher's log shows the nodes never met (the peers' side of a missing node)."""
    joined = re.search(r"(\d+)/(\d+) clients joined", log)
    if joined:
        return (f"only {joined[1]} of {joined[2]} nodes came to the rendezvous in time (start the others, check "
                "their --nnodes and --rdzv-endpoint, or raise --rdzv-timeout)")
    if re.search(r"(?i)rendezvous.*timed? ?out|RendezvousTimeoutError", log):
        return "the nodes did not all meet at the rendezvous in time (a node missing, or another --nnodes there)"
    return None
