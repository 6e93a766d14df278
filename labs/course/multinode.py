"""Chapter 6's experiments: several "nodes" on one machine, each one a `labs train` process as a user would type it on
its own host, meeting at 127.0.0.1; and what to read off them.

    nodes = multinode.emulate(RUNS / "06_multi_node" / "two_nodes", nnodes=2, nproc_per_node=1, steps=6)
    nodes.run                  # node 0's run folder (metrics, summary): a labs.runfolder.Run
    nodes.commands[1]          # what node 1 typed
    multinode.env_rows(nodes.run)   # what torchrun told each rank

Every launch is real: `python -m labs train --nnodes N --node-rank K --rdzv-endpoint 127.0.0.1:PORT ...`, the
processes started together, each under its own supervisor, exactly as on N hosts (one machine's cores shared).
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from labs import ROOT, multinode
from labs.runfolder import Run


@dataclass
class Emulated:
    """N node processes of one run: node 0's folder, each node's command, exit code and output."""
    run: Run
    commands: list
    codes: list
    outputs: list
    seconds: float

    @property
    def folders(self) -> list[Path]:
        return [multinode.node_out(self.run.path, k) for k in range(len(self.commands))]


def free_port() -> int:
    """A port nobody listens on now (the OS picks it), for one emulated rendezvous."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def train_command(out, node_rank: int, nnodes: int, port: int, nproc_per_node: int, steps: int, config="zero3.json",
                  instruments=("state_bytes",), rdzv_timeout: int = 60, extra=()) -> list[str]:
    """`labs train` for one emulated node, as typed on that node."""
    return [sys.executable, "-m", "labs", "train", "--preset", "tiny", "--config", str(config), "--steps", str(steps),
            "--nproc", str(nproc_per_node), "--out", str(out), "--nnodes", str(nnodes), "--node-rank", str(node_rank),
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-timeout", str(rdzv_timeout),
            "--instruments", ",".join(instruments), "--quiet", *map(str, extra)]


def emulate(out, nnodes=2, nproc_per_node=1, steps=6, config="zero3.json", instruments=("state_bytes",),
            extra=(), timeout_s=600) -> Emulated:
    """Start every node's `labs train` at once and wait for all of them. Each node's ranks get one thread each
    (the nodes share this machine's cores). Raises RuntimeError with a node's output if any node failed."""
    port = free_port()
    env = _node_env()
    commands = [train_command(out, k, nnodes, port, nproc_per_node, steps, config, instruments, extra=extra)
                for k in range(nnodes)]
    print(f"{nnodes} nodes x {nproc_per_node} rank(s), {steps} steps of 'tiny' with {Path(str(config)).name}, "
          f"rendezvous 127.0.0.1:{port} ...", end=" ", flush=True)
    start = time.perf_counter()
    processes = [subprocess.Popen(c, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for c in commands]
    outputs = [p.communicate(timeout=timeout_s)[0] for p in processes]
    seconds = time.perf_counter() - start
    codes = [p.returncode for p in processes]
    print(f"done in {seconds:.0f} s", flush=True)
    for k, (code, output) in enumerate(zip(codes, outputs)):
        if code != 0:
            raise RuntimeError(f"node {k} exited with code {code}:\n{output[-3000:]}")
    return Emulated(Run(out), commands, codes, outputs, seconds)


def single_node(out, nproc=2, steps=6, config="zero3.json", instruments=("state_bytes",)) -> Run:
    """The same run on one host (torchrun --standalone), for the comparison."""
    command = [sys.executable, "-m", "labs", "train", "--preset", "tiny", "--config", str(config), "--steps",
               str(steps), "--nproc", str(nproc), "--out", str(out), "--instruments", ",".join(instruments), "--quiet"]
    print(f"1 node x {nproc} ranks, {steps} steps ...", end=" ", flush=True)
    start = time.perf_counter()
    subprocess.run(command, env=_node_env(), check=True, capture_output=True, text=True)
    print(f"done in {time.perf_counter() - start:.0f} s", flush=True)
    return Run(out)


def _node_env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


# ---------------------------------------------------------------------------------------------- what ranks saw
ENV_COLUMNS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
               "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE",
               "TORCHELASTIC_MAX_RESTARTS", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "OMP_NUM_THREADS")


def env_rows(run: Run) -> list[dict]:
    """One row per rank: the launcher's variables as the rank_env instrument found them (MASTER_PORT shown as
    'P', the emulation's free port: it changes every run)."""
    rows = []
    for entry in run.summary["rank_env"]:
        env = dict(entry["env"])
        env["MASTER_PORT"] = "P" if env.get("MASTER_PORT") else None
        rows.append({k: env.get(k, "-") for k in ENV_COLUMNS})
    return rows


def elastic_variables(run: Run) -> list[str]:
    """Every TORCHELASTIC_* name rank 0 got."""
    return [k for k in run.summary["rank_env"][0]["env"] if k.startswith("TORCHELASTIC_")]
