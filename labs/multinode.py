"""Several hosts, through the launchers people already have; labs adds no launcher of its own.

    nodes = multinode.torchrun_nodes(nnodes=2, node_rank=1, endpoint="node0:29500")
    multinode.torchrun_command(nodes, nproc=8, run_dir=work)   # torchrun's static rendezvous, one per node
    nodes = multinode.deepspeed_nodes("hostfile", include="n0@n1", master_addr="10.0.0.1")
    multinode.deepspeed_command(nodes, run_dir=work)           # DeepSpeed's runner: pdsh from the head node
    multinode.slurm_script(nnodes=4, gpus_per_node=8, train_args=[...])   # one task per node, each `labs train`

- torchrun: every node runs `labs train --nnodes N --node-rank K --rdzv-endpoint HOST:PORT`. labs starts torchrun
  with the *static* rendezvous: node K's ranks are global ranks K*nproc .. K*nproc+nproc-1, so global rank 0 (the
  one that writes metrics) is on node 0, and node 0's torchrun holds the rendezvous store on HOST:PORT.
- DeepSpeed: `labs train --hostfile FILE` on the head node; DeepSpeed's runner reaches the other hosts by pdsh
  (passwordless ssh, the same paths everywhere). With `--node-rank K` every node runs labs itself instead
  (DeepSpeed's `--no_ssh` mode).
- Slurm: a batch script with one task per node; each task runs `labs train` with its node rank from Slurm, meeting
  on the first node of the allocation. `srun --kill-on-bad-exit=1` ends every node's task when one fails.

The run folder (see `node_out`): node 0 writes `--out`; node K > 0 writes `--out` + `.nodeK` (its launch log, inputs,
and its ranks' errors). Each node holds its own lock and publishes its own folder, so on a shared file system the
nodes never wait for or replace each other's folder, and on separate disks each node keeps what its ranks did.

Bad input is a LabsError before anything starts; labs.rendezvous checks the meeting point, within `rdzv_timeout`.
"""
from __future__ import annotations

import collections
import re
import shlex
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from labs import env
from labs.errors import LabsError

DEFAULT_PORT = 29500
DEFAULT_RDZV_TIMEOUT_S = 60     # how long a node waits for the others (torchrun's own default is 600 s)


@dataclass(frozen=True)
class Nodes:
    """Where a run's ranks are: how many nodes, which one this is, where they meet, and by which launcher.
    `node_rank` None: DeepSpeed's runner starts every node from here (pdsh)."""
    launcher: str                       # "torchrun" | "deepspeed"
    nnodes: int
    node_rank: int | None
    host: str
    port: int
    rdzv_timeout: int = DEFAULT_RDZV_TIMEOUT_S
    hostfile: str | None = None
    include: str = ""
    exclude: str = ""
    hosts: dict = field(default_factory=dict)     # DeepSpeed: host -> slots used, in hostfile order

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    def world_size(self, nproc: int) -> int:
        return self.nnodes * nproc

    def record(self) -> dict:
        """What run.json keeps about the nodes."""
        return {k: v for k, v in asdict(self).items() if v not in ("", None, {})}


def global_rank(node_rank: int, local_rank: int, nproc_per_node: int) -> int:
    """RANK of a process under torchrun's static rendezvous and DeepSpeed's launcher: nodes in order, then local."""
    return node_rank * nproc_per_node + local_rank


# ---------------------------------------------------------------------------------------------- the flags
def parse_endpoint(text: str, flag: str = "--rdzv-endpoint") -> tuple[str, int]:
    """HOST[:PORT] (IPv6 in brackets) -> (host, port); the port defaults to 29500."""
    match = re.fullmatch(r"\[([0-9a-fA-F:.]+)\](?::(\d+))?|([^:\s\[\]]+)(?::(\d+))?", text or "")
    if not match:
        raise LabsError(f"{flag} '{text}' is not HOST or HOST:PORT (e.g. node0:29500)")
    host = match.group(1) or match.group(3)
    port = int(match.group(2) or match.group(4) or DEFAULT_PORT)
    if not 1 <= port <= 65535:
        raise LabsError(f"{flag} '{text}': port {port} is not in 1..65535")
    return host, port


def torchrun_nodes(nnodes: int, node_rank: int | None, endpoint: str | None,
                   rdzv_timeout: int = DEFAULT_RDZV_TIMEOUT_S) -> Nodes:
    """Check torchrun's multi-node flags: N nodes, this node's rank in [0, N), node 0's HOST:PORT."""
    _check_whole("--nnodes", nnodes, 1)
    _check_whole("--rdzv-timeout", rdzv_timeout, 1)
    if node_rank is None:
        raise LabsError(f"--nnodes {nnodes}: give this node's rank too, --node-rank 0..{nnodes - 1} "
                        "(0 on the node named by --rdzv-endpoint)")
    _check_whole("--node-rank", node_rank, 0)
    if node_rank >= nnodes:
        raise LabsError(f"--node-rank {node_rank} is out of range for --nnodes {nnodes}: use 0..{nnodes - 1}")
    if not endpoint:
        raise LabsError(f"--nnodes {nnodes}: give --rdzv-endpoint HOST:PORT, node 0's address and a free port "
                        "that every node can reach")
    host, port = parse_endpoint(endpoint)
    return Nodes("torchrun", nnodes, node_rank, host, port, rdzv_timeout)


def deepspeed_nodes(hostfile, include: str = "", exclude: str = "", master_addr: str | None = None,
                    master_port: int = DEFAULT_PORT, node_rank: int | None = None,
                    rdzv_timeout: int = DEFAULT_RDZV_TIMEOUT_S) -> Nodes:
    """Check a DeepSpeed hostfile (`host slots=N` per line) and --include/--exclude as DeepSpeed's runner reads
    them (its own parser), plus what labs needs on top: the same number of slots on every host used."""
    path = Path(hostfile)
    if not path.is_file():
        raise LabsError(f"--hostfile '{hostfile}' is not a file (one line per host: 'HOST slots=N')")
    hosts = hosts_in_use(path.read_text(), include, exclude, str(hostfile))
    slots = {len(s) for s in hosts.values()}
    if len(slots) > 1:
        raise LabsError(f"hosts use different numbers of slots ({', '.join(f'{h}: {len(s)}' for h, s in hosts.items())}"
                        "); labs needs the same number on every host")
    _check_whole("--rdzv-timeout", rdzv_timeout, 1)
    if node_rank is not None:
        _check_whole("--node-rank", node_rank, 0)
        if node_rank >= len(hosts):
            raise LabsError(f"--node-rank {node_rank} is out of range: the hostfile's hosts in use are "
                            f"{', '.join(hosts)} (node ranks 0..{len(hosts) - 1})")
    first = next(iter(hosts))
    if not master_addr and (node_rank is not None or len(hosts) > 1):
        raise LabsError(f"give --master-addr, the address of {first} (the first host, where rank 0 runs) that "
                        "every host can reach")
    _check_whole("--master-port", master_port, 1)
    return Nodes("deepspeed", len(hosts), node_rank, master_addr or "127.0.0.1", master_port, rdzv_timeout,
                 str(path.resolve()), include, exclude, {h: list(s) for h, s in hosts.items()})


def hosts_in_use(text: str, include: str = "", exclude: str = "", name: str = "hostfile") -> dict:
    """{host: [slot, ...]} that DeepSpeed's runner would use for this hostfile text and --include/--exclude."""
    pool = parse_hostfile(text, name)
    if include and exclude:
        raise LabsError("--include and --exclude exclude each other (DeepSpeed's rule): give one")
    from deepspeed.launcher.runner import parse_inclusion_exclusion

    try:
        hosts = parse_inclusion_exclusion(pool, include, exclude)
    except (ValueError, KeyError) as exc:
        flag = "--include" if include else "--exclude"
        raise LabsError(f"{flag} '{include or exclude}': {exc} (hosts in {name}: {', '.join(pool)})") from None
    if not hosts:
        raise LabsError(f"--exclude '{exclude}' leaves no host of {name}")
    return {host: list(slots) for host, slots in hosts.items()}


def parse_hostfile(text: str, name: str = "hostfile") -> dict:
    """{host: slots} from DeepSpeed's hostfile format, each bad line named; then DeepSpeed's own parser."""
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        words = line.split()
        if not re.fullmatch(r"\S+\s+slots=\d+.*", line):
            raise LabsError(f"{name} line {number} '{line}' names no slots: write '{words[0]} slots=N' "
                            "(N: GPUs on that host)")
        if int(words[1].split("=")[1]) < 1:
            raise LabsError(f"{name} line {number} '{line}': slots must be at least 1")
    env.name_deepspeed_accelerator()     # before DeepSpeed's first import, or it warns that it guessed the CPU
    from deepspeed.launcher.runner import _parse_hostfile

    try:
        return dict(_parse_hostfile(text.splitlines()))
    except ValueError as exc:
        raise LabsError(f"{name}: {exc}") from None


def _check_whole(flag, value, least):
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise LabsError(f"{flag} must be a whole number of at least {least}, not {value!r}")


# ---------------------------------------------------------------------------------------------- the commands
# torchrun's log tree (a folder per attempt and rank, for each rank's error file) goes into the run's working folder:
# left to itself, torchrun makes a /tmp/torchelastic_* tree at every launch and never removes it. labs.launch removes
# this one once the launcher has exited (the ranks write their own errors to rank*.err).
TORCHRUN_LOGS = "torchelastic"


def torchrun_command(nodes: Nodes, nproc: int, run_dir: Path, torchrun: str = "torch.distributed.run") -> list[str]:
    """torchrun on this node: the static rendezvous at node 0's HOST:PORT, fixed node rank, no restarts (`torchrun`:
    the module, labs.fork_launcher for CPU ranks)."""
    return [sys.executable, "-m", torchrun, f"--nnodes={nodes.nnodes}",
            f"--node-rank={nodes.node_rank}", f"--nproc-per-node={nproc}", "--rdzv-backend=static",
            f"--rdzv-endpoint={nodes.endpoint}", f"--rdzv-conf=timeout={nodes.rdzv_timeout}", "--max-restarts=0",
            f"--log-dir={run_dir / TORCHRUN_LOGS}", "-m", "labs.rank", str(run_dir)]


def deepspeed_command(nodes: Nodes, run_dir: Path) -> list[str]:
    """DeepSpeed's runner with the hostfile. Ranks get RANK, LOCAL_RANK and WORLD_SIZE in their environment
    (--no_local_rank: no --local_rank argument); with a node rank, this node only (--no_ssh)."""
    command = [sys.executable, "-m", "deepspeed.launcher.runner", f"--hostfile={nodes.hostfile}"]
    if nodes.include:
        command.append(f"--include={nodes.include}")
    if nodes.exclude:
        command.append(f"--exclude={nodes.exclude}")
    command += [f"--master_addr={nodes.host}", f"--master_port={nodes.port}"]
    if nodes.node_rank is not None:
        command += ["--no_ssh", f"--node_rank={nodes.node_rank}"]
    return command + ["--no_local_rank", "--module", "labs.rank", str(run_dir)]


def slots_per_host(nodes: Nodes) -> int:
    return len(next(iter(nodes.hosts.values())))


def node_out(out: Path, node_rank: int | None) -> Path:
    """The folder node `node_rank`'s labs process writes: `out` on node 0 (and on one host), `out.nodeK` on node K."""
    out = Path(out)
    return out.with_name(f"{out.name}.node{node_rank}") if node_rank else out


# ---------------------------------------------------------------------------------------------- Slurm
def slurm_script(nnodes: int, gpus_per_node: int, train_args: list[str], port: int = DEFAULT_PORT,
                 job_name: str = "labs-train", time_limit: str | None = None, partition: str | None = None,
                 workdir: str | None = None, python: str | None = None, cpus_per_task: int | None = None) -> str:
    """An sbatch script: one task per node, each running `labs train TRAIN_ARGS` with its node rank
    ($SLURM_NODEID) and the first node of the allocation as the rendezvous. srun forwards scancel's SIGTERM
    to every task (labs then stops its ranks) and, with --kill-on-bad-exit, ends all tasks when one fails.
    `cpus_per_task`: the CPUs the one task of a node (torchrun and its ranks) may use; None gives it every CPU
    of the (exclusive) node. srun is told again: since Slurm 22.05 it does not inherit sbatch's --cpus-per-task,
    and with core binding torchrun and all its ranks would share one core."""
    _check_whole("nodes", nnodes, 1)
    _check_whole("GPUs per node", gpus_per_node, 1)
    if cpus_per_task is not None:
        _check_whole("CPUs per task", cpus_per_task, 1)
    for flag in ("--nnodes", "--node-rank", "--rdzv-endpoint", "--hostfile", "--nproc"):
        if any(a == flag or a.startswith(flag + "=") for a in train_args):
            raise LabsError(f"the Slurm script sets {flag} itself; leave it out of the training arguments")
    lines = ["#!/bin/bash", f"#SBATCH --job-name={job_name}", f"#SBATCH --nodes={nnodes}",
             "#SBATCH --ntasks-per-node=1", f"#SBATCH --gpus-per-node={gpus_per_node}", "#SBATCH --exclusive"]
    lines += [f"#SBATCH --cpus-per-task={cpus_per_task}"] if cpus_per_task else []
    lines += [f"#SBATCH --time={time_limit}"] if time_limit else []
    lines += [f"#SBATCH --partition={partition}"] if partition else []
    lines += [f"#SBATCH --chdir={workdir}"] if workdir else []
    python = python or sys.executable
    train = shlex.join([python, "-m", "labs", "train", *map(str, train_args), "--nproc", str(gpus_per_node)])
    lines += [
        "# Written by labs (labs.multinode.slurm_script). One task per node runs `labs train`, which starts torchrun",
        "# and owns its ranks; node 0 (the first host of the allocation) holds the rendezvous. Slurm without",
        f"# select/cons_tres (no --gpus-per-node): ask for --gres=gpu:{gpus_per_node} instead.",
        "set -euo pipefail",
        'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        f'export LABS_RDZV_ENDPOINT="$head_node:{port}"',
        'echo "labs: $SLURM_JOB_NUM_NODES nodes, rendezvous at $LABS_RDZV_ENDPOINT"',
        # Single quotes: $SLURM_NODEID must expand in each task, not here.
        # srun does not inherit sbatch's --cpus-per-task (Slurm >= 22.05): the task gets it here.
        "srun --kill-on-bad-exit=1 --ntasks-per-node=1 --cpus-per-task="
        + ('"$SLURM_CPUS_PER_TASK"' if cpus_per_task else '"$SLURM_CPUS_ON_NODE"') + " bash -c \\",
        "  " + shlex.quote(f'exec {train} --nnodes "$SLURM_JOB_NUM_NODES" --node-rank "$SLURM_NODEID" '
                           '--rdzv-endpoint "$LABS_RDZV_ENDPOINT"'),
    ]
    return "\n".join(lines) + "\n"


def hosts_text(hosts: dict) -> str:
    """`host slots=N` lines for a hostfile."""
    return "".join(f"{host} slots={slots}\n" for host, slots in collections.OrderedDict(hosts).items())


# ---------------------------------------------------------------------------------------------- from `labs train`
FLAGS = ("nnodes", "node_rank", "rdzv_endpoint", "rdzv_timeout", "hostfile", "include", "exclude", "master_addr",
         "master_port")


def from_flags(nnodes=None, node_rank=None, rdzv_endpoint=None, rdzv_timeout=DEFAULT_RDZV_TIMEOUT_S, hostfile=None,
               include="", exclude="", master_addr=None, master_port=DEFAULT_PORT) -> Nodes | None:
    """`labs train`'s node flags -> Nodes, or None for one host. A hostfile selects DeepSpeed's runner, --nnodes
    torchrun; each launcher's flags only with it."""
    if hostfile:
        if nnodes is not None or rdzv_endpoint:
            raise LabsError("--hostfile runs DeepSpeed's launcher, whose nodes are the hostfile's hosts and whose "
                            "rendezvous is --master-addr/--master-port: drop --nnodes/--rdzv-endpoint")
        return deepspeed_nodes(hostfile, include or "", exclude or "", master_addr, master_port, node_rank,
                               rdzv_timeout)
    for flag, value in (("--include", include), ("--exclude", exclude), ("--master-addr", master_addr)):
        if value:
            raise LabsError(f"{flag} belongs to DeepSpeed's launcher: give --hostfile too (torchrun: --nnodes, "
                            "--node-rank, --rdzv-endpoint)")
    if nnodes is None:
        if node_rank is not None or rdzv_endpoint:
            raise LabsError("--node-rank/--rdzv-endpoint need --nnodes (how many nodes take part)")
        return None
    return torchrun_nodes(nnodes, node_rank, rdzv_endpoint, rdzv_timeout)


def slurm_train_args(argv: list[str]) -> list[str]:
    """`labs train`'s arguments as typed, less those the Slurm script sets per node (and --slurm itself)."""
    dropped = ("--slurm", "--nnodes", "--nproc", "--node-rank", "--rdzv-endpoint")
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in dropped:
            skip = True
        elif not arg.startswith(tuple(f"{flag}=" for flag in dropped)):
            kept.append(arg)
    return kept
