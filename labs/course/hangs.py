"""Chapter 6's hang lessons, on two real gloo ranks of this machine (no DeepSpeed, a second each):

    found = hangs.stuck(timeout_s=8)    # rank 1 skips an all_reduce: py-spy dumps both ranks while rank 0 waits,
                                        # then rank 0's collective timeout fires
    hangs.probe("mismatch", debug="DETAIL")   # rank 1 calls broadcast instead: TORCH_DISTRIBUTED_DEBUG says so

Each probe is `python -m torch.distributed.run --standalone --nproc-per-node 2 -m labs.course.hangs MODE T DIR`;
each rank writes its pid, then what happened to it, into DIR.
"""
from __future__ import annotations

import datetime
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from labs import supervisor
from labs.env import importable_path

ANSI = re.compile(r"\x1b\[[0-9;]*m")
# The settings worth knowing when ranks span nodes. (name, what it does, an example)
SETTINGS = (
    ("NCCL_DEBUG", "NCCL's log: WARN (default off), INFO prints rings/trees, transports, interfaces chosen", "INFO"),
    ("NCCL_DEBUG_SUBSYS", "which parts log at INFO", "INIT,NET"),
    ("NCCL_SOCKET_IFNAME", "network interfaces for NCCL's bootstrap and socket transport (^ excludes)", "^lo,docker"),
    ("NCCL_IB_HCA", "which InfiniBand/RoCE adapters (and ports) NCCL uses", "mlx5_0,mlx5_1"),
    ("NCCL_IB_DISABLE", "1: no InfiniBand, fall back to sockets (slow; a misconfigured IB often shows as this)", "1"),
    ("NCCL_IB_GID_INDEX", "RoCE: which GID (address) to use; 3 is RoCE v2 on many clusters", "3"),
    ("NCCL_NET_GDR_LEVEL", "when the NIC reads GPU memory directly (GPUDirect RDMA)", "PHB"),
    ("NCCL_NVLS_ENABLE", "NVLink SHARP (multicast) on NVSwitch systems; 0 turns it off", "0"),
    ("NCCL_P2P_DISABLE", "1: no direct GPU-to-GPU copies (NVLink/PCIe) within a node", "1"),
    ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "what PyTorch's watchdog does when a collective times out (1: tear down)",
     "1"),
    ("TORCH_NCCL_DUMP_ON_TIMEOUT", "write the flight recorder (last collectives of every rank) on a timeout", "1"),
    ("TORCH_NCCL_TRACE_BUFFER_SIZE", "how many collectives the flight recorder keeps (0: off)", "2000"),
    ("TORCH_DISTRIBUTED_DEBUG", "DETAIL: check that every rank calls the same collective with the same shapes",
     "DETAIL"),
    ("TORCH_CPP_LOG_LEVEL", "c10d's own log (rendezvous, store, process groups)", "INFO"),
    ("DEEPSPEED_TIMEOUT", "DeepSpeed's collective timeout, in minutes (deepspeed.constants.default_pg_timeout)",
     "10"),
)


# ---------------------------------------------------------------------------------------------- host side
def nccl_default_timeout() -> datetime.timedelta:
    """PyTorch's default collective timeout for NCCL process groups: torch.distributed.constants'
    default_pg_nccl_timeout, which a torch built with NCCL takes from the C++ constant kProcessGroupNCCLDefaultTimeout.
    A CPU build leaves it None; the constant is still in the ProcessGroupNCCL.hpp header every torch wheel ships."""
    import torch.distributed.constants as constants

    if constants.default_pg_nccl_timeout is not None:
        return constants.default_pg_nccl_timeout
    header = Path(constants.__file__).parents[1] / "include/torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp"
    found = re.search(r"kProcessGroupNCCLDefaultTimeout\s*=\s*std::chrono::milliseconds\(([\d\s*]+)\)",
                      header.read_text())
    return datetime.timedelta(milliseconds=math.prod(int(factor) for factor in found[1].split("*")))


def probe(mode: str, timeout_s: float = 3.0, debug: str | None = None) -> list[dict]:
    """Run the 2-rank probe and return each rank's report (sorted by rank)."""
    with tempfile.TemporaryDirectory() as folder:
        supervisor.run_captured(_command(mode, timeout_s, folder), _env(debug), timeout=120)
        return _reports(folder)


def stuck(timeout_s: float = 8.0, spy_after_s: float = 2.0) -> dict:
    """Rank 1 skips an all_reduce that rank 0 enters. While rank 0 waits, py-spy dumps both ranks' Python stacks
    (if py-spy is installed); then rank 0's collective timeout fires. Returns {"dumps": {rank: text} or
    {"skipped": why}, "reports": [each rank's report]}."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    with tempfile.TemporaryDirectory() as folder, supervisor.own_tmpdir(_env(None)) as env:
        process = subprocess.Popen(supervisor.launcher(_command("timeout", timeout_s, folder)), env=env,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            pids = {}
            deadline = time.monotonic() + 120
            while len(pids) < 2 and time.monotonic() < deadline and process.poll() is None:
                pids = {int(f.stem[4:]): int(f.read_text()) for f in Path(folder).glob("rank*.pid") if f.read_text()}
                time.sleep(0.2)
            time.sleep(spy_after_s)                      # both are now inside their waits
            dumps = _spy(spy, pids)
            process.wait(120)
        finally:
            if process.poll() is None:
                supervisor.stop(process)
        return dict(dumps=dumps, reports=_reports(folder))


def _spy(spy: str, pids: dict) -> dict:
    """{rank: the stack py-spy read}, each frame a line; or {"skipped": why} in one line. py-spy reads another
    process's memory: it needs ptrace (a container without SYS_PTRACE, or kernel.yama.ptrace_scope above 0 for a
    process that is not its child, refuses)."""
    if not Path(spy).exists():
        return {"skipped": "py-spy is not installed here (pip install py-spy)"}
    dumps = {}
    for rank, pid in sorted(pids.items()):
        done = subprocess.run([spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=60)
        if done.returncode != 0 or not done.stdout.strip():
            reason = (ANSI.sub("", done.stderr).strip().splitlines() or ["no output"])[-1]
            return {"skipped": f"py-spy could not read rank {rank} ({reason}): it needs ptrace rights, e.g. run as "
                               "root, add SYS_PTRACE to the container, or set kernel.yama.ptrace_scope=0"}
        dumps[rank] = _frames(ANSI.sub("", done.stdout))     # py-spy colours even into a pipe
    return dumps


def _frames(dump: str) -> str:
    """The thread and its frames; the process line (pid, interpreter path) and Python's version left out, as they
    differ on every machine."""
    kept = [line for line in dump.splitlines() if line.strip() and not line.startswith(("Process ", "Python v"))]
    return "\n".join(re.sub(r"^Thread \d+", "Thread", line) for line in kept)


def _reports(folder) -> list[dict]:
    return [json.loads(f.read_text()) for f in sorted(Path(folder).glob("rank*.json"))]


def _command(mode, timeout_s, folder):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
            "labs.course.hangs", mode, str(timeout_s), str(folder)]


def _env(debug):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = importable_path(env)
    if debug:
        env["TORCH_DISTRIBUTED_DEBUG"] = debug
    return env


# ---------------------------------------------------------------------------------------------- rank side
def _skips_the_collective(seconds):
    time.sleep(seconds)                 # the rank that went elsewhere (a data loader stuck, a branch not taken)


def _rank_main(mode: str, timeout_s: float, folder: Path):
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    rank = dist.get_rank()
    report = dict(rank=rank, pid=os.getpid(), mode=mode, timeout_s=timeout_s)
    x = torch.ones(4)
    (folder / f"rank{rank}.pid").write_text(str(os.getpid()))     # the host may now look at this process
    start = time.perf_counter()
    try:
        if rank == 1 and mode == "timeout":
            _skips_the_collective(timeout_s + 3)
            report.update(outcome="never called all_reduce")
            raise SystemExit
        elif rank == 1 and mode == "mismatch":
            dist.broadcast(x, src=1)
        else:
            dist.all_reduce(x)
        report.update(outcome="returned")
    except SystemExit:
        pass
    except Exception as exc:    # noqa: BLE001 (the lesson is the exception)
        report.update(outcome=type(exc).__name__, error=str(exc).strip().splitlines()[0][:300])
    report["seconds"] = round(time.perf_counter() - start, 1)
    (folder / f"rank{rank}.json").write_text(json.dumps(report))
    os._exit(0)             # the group is broken by design: leave without its teardown


if __name__ == "__main__":
    _rank_main(sys.argv[1], float(sys.argv[2]), Path(sys.argv[3]))
