"""Chapter 6's experiments: several "nodes" on one machine, each one a `labs train` process as a user would type it on
its own host, meeting at 127.0.0.1; and what to read off them.

    nodes = multinode.emulate(RUNS / "06_multi_node" / "two_nodes", nnodes=2, nproc_per_node=1, steps=6)
    nodes.run                  # node 0's run folder (metrics, summary): a labs.runfolder.Run
    nodes.commands[1]          # what node 1 typed
    multinode.env_rows(nodes.run)   # what torchrun told each rank

Every launch is real: `python -m labs train --nnodes N --node-rank K --rdzv-endpoint 127.0.0.1:PORT ...`, the
processes started together, each under its own supervisor, exactly as on N hosts (one machine's cores shared).
The emulated nodes always run on the CPU (gloo), GPUs hidden: on one host every node's LOCAL_RANK 0 would take
cuda:0 and NCCL refuses two ranks on one GPU; on the CPU the runs are also the same on every machine.
"""
from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from labs import CONFIGS, ROOT, RUNS, launch, multinode, supervisor
from labs import config as config_lib
from labs.env import CPU_ONLY, importable_path
from labs.errors import LabsError
from labs.rendezvous import free_port     # chapter 6 and the tests ask this module for one
from labs.runfolder import Run


@dataclass
class Emulated:
    """N node processes of one run: node 0's folder, each node's command, exit code and output."""
    run: Run
    commands: list
    codes: list
    outputs: list
    seconds: float
    port: int

    def typed(self, node: int) -> str:
        """What node `node` typed (the emulation's free port shown as PORT: it changes every run)."""
        return shown(self.commands[node]).replace(f":{self.port}", ":PORT")

    @property
    def folders(self) -> list[Path]:
        return [multinode.node_out(self.run.path, k) for k in range(len(self.commands))]


def train_command(out, node_rank: int, nnodes: int, port: int, nproc_per_node: int, steps: int, config="zero3.json",
                  instruments=("state_bytes",), rdzv_timeout: int = 60, extra=(), hostfile=None) -> list[str]:
    """`labs train` for one emulated node, as typed on that node: torchrun's flags, or with a hostfile DeepSpeed's
    launcher without ssh (each node starts its own)."""
    if hostfile:
        where = ["--hostfile", str(hostfile), "--master-addr", "127.0.0.1", "--master-port", str(port)]
    else:
        where = ["--nproc", str(nproc_per_node), "--nnodes", str(nnodes), "--rdzv-endpoint", f"127.0.0.1:{port}"]
    return [sys.executable, "-m", "labs", "train", "--preset", "tiny", "--config", str(config), "--steps", str(steps),
            "--out", str(out), *where, "--node-rank", str(node_rank), "--rdzv-timeout", str(rdzv_timeout),
            "--instruments", ",".join(instruments), "--quiet", *map(str, extra)]


def emulate(out, nnodes=2, nproc_per_node=1, steps=6, config="zero3.json", instruments=("state_bytes",),
            extra=(), timeout_s=600, launcher="torchrun") -> Emulated:
    """Start every node's `labs train` at once and wait for all of them. Each node's ranks get one thread each
    (the nodes share this machine's cores). launcher "deepspeed": a hostfile naming nodes node0.. (next to `out`)
    and DeepSpeed's launcher; not on a machine with a GPU (a LabsError says why). Raises RuntimeError with a
    node's output if any node failed."""
    if launcher == "deepspeed" and torch.cuda.is_available():
        # Its launcher sets CUDA_VISIBLE_DEVICES to each host's slots again, so every node's rank 0 would see GPU 0.
        raise LabsError("the DeepSpeed-launcher emulation runs on a machine without GPUs: DeepSpeed's launcher "
                        "would give each emulated node's ranks the same GPUs (use launcher='torchrun' here)")
    port = free_port()
    if launcher == "torchrun":
        launch.warm_for_children()      # each node's `labs train` forks its launcher from this process's warm server
    env = _node_env()
    _say_gpus_hidden()
    hostfile = None
    if launcher == "deepspeed":
        hostfile = Path(out).with_name(f"{Path(out).name}.hostfile")
        hostfile.parent.mkdir(parents=True, exist_ok=True)
        hostfile.write_text(multinode.hosts_text({f"node{k}": nproc_per_node for k in range(nnodes)}))
    commands = [train_command(out, k, nnodes, port, nproc_per_node, steps, config, instruments, extra=extra,
                              hostfile=hostfile) for k in range(nnodes)]
    print(f"{nnodes} nodes x {nproc_per_node} rank(s), {steps} steps of 'tiny' with {Path(str(config)).name}, "
          f"rendezvous 127.0.0.1:{port} ...", end=" ", flush=True)
    start = time.perf_counter()
    processes = [subprocess.Popen(c, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for c in commands]
    try:
        outputs = [p.communicate(timeout=timeout_s)[0] for p in processes]
    except BaseException:       # a timeout or an interrupt (a notebook's goes to its kernel alone): stop every node
        _stop_nodes(processes)
        raise
    seconds = time.perf_counter() - start
    codes = [p.returncode for p in processes]
    print(f"done in {seconds:.0f} s", flush=True)
    for k, (code, output) in enumerate(zip(codes, outputs)):
        if code != 0:
            raise RuntimeError(f"node {k} exited with code {code}:\n{output[-3000:]}")
    return Emulated(Run(out), commands, codes, outputs, seconds, port)


def _stop_nodes(processes):
    """SIGTERM to each node's `labs train`, which stops its ranks and says so (labs.supervisor); SIGKILL to one still
    running after twice the grace period (its launcher then takes SIGTERM: labs.supervisor's parent-death signal)."""
    for p in processes:
        if p.poll() is None:
            p.terminate()
    for p in processes:
        try:
            p.communicate(timeout=2 * supervisor.GRACE_S)
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()


def single_node(out, nproc=2, steps=6, config="zero3.json", instruments=("state_bytes",)) -> Run:
    """The same run on one host (torchrun --standalone), for the comparison."""
    command = [sys.executable, "-m", "labs", "train", "--preset", "tiny", "--config", str(config), "--steps",
               str(steps), "--nproc", str(nproc), "--out", str(out), "--instruments", ",".join(instruments), "--quiet"]
    _say_gpus_hidden()
    launch.warm_for_children()
    print(f"1 node x {nproc} ranks, {steps} steps ...", end=" ", flush=True)
    start = time.perf_counter()
    subprocess.run(command, env=_node_env(), check=True, capture_output=True, text=True)
    print(f"done in {time.perf_counter() - start:.0f} s", flush=True)
    return Run(out)


def _node_env() -> dict:
    """One thread per rank (the nodes share this machine's cores), and no GPU: CUDA_VISIBLE_DEVICES empty makes
    labs train on the CPU with gloo, with DeepSpeed's CPU accelerator (also where this process named cuda)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", **CPU_ONLY)
    env["PYTHONPATH"] = importable_path(env)
    return env


def _say_gpus_hidden():
    if torch.cuda.is_available():
        print(f"(this machine's {torch.cuda.device_count()} GPU(s) hidden: the emulated nodes would all put their "
              "rank 0 on cuda:0, so they run on the CPU with gloo)")


# ---------------------------------------------------------------------------------------------- what ranks saw
ENV_SHOWN = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
             "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE",
             "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_ERROR_FILE",
             "TORCH_NCCL_ASYNC_ERROR_HANDLING", "OMP_NUM_THREADS")
VARIES = {"MASTER_PORT": "PORT", "TORCHELASTIC_ERROR_FILE": "(a file per rank)"}


def env_rows(run: Run) -> list[dict]:
    """One row per variable, one column per rank, as the rank_env instrument found them on the ranks (values that
    change every run, the port and temporary paths, are named instead)."""
    envs = [entry["env"] for entry in run.summary["rank_env"]]
    return [{"variable": name, **{f"rank {r}": (VARIES.get(name, env[name]) if name in env else "-")
                                  for r, env in enumerate(envs)}} for name in ENV_SHOWN]


def elastic_variables(run: Run) -> list[str]:
    """Every TORCHELASTIC_* name rank 0 got."""
    return [k for k in run.summary["rank_env"][0]["env"] if k.startswith("TORCHELASTIC_")]


# ---------------------------------------------------------------------------------------------- shown, refused
def shown(command: list[str]) -> str:
    """A command as a user would type it: `python` for this interpreter, paths inside the course relative to it
    (both differ per machine)."""
    return shlex.join(["python" if part == sys.executable else _relative(part) for part in command])


def slurm_written(argv: list[str], folder) -> str:
    """The batch script `labs train --slurm FOLDER/job.sbatch ARGV` writes: that command, run here. Two parts differ
    per machine and are shown by name: PYTHON, the absolute path of the interpreter that ran the command, and
    WORKDIR, the folder it ran in."""
    path = Path(folder) / "job.sbatch"
    done = subprocess.run([sys.executable, "-m", "labs", "train", "--slurm", str(path), *argv], capture_output=True,
                          text=True, env=dict(os.environ, PYTHONPATH=importable_path(os.environ)), timeout=120)
    if done.returncode != 0:
        raise LabsError(f"labs train --slurm exited with code {done.returncode}: {done.stderr.strip()}")
    text = path.read_text().replace(f"--chdir={Path.cwd()}\n", "--chdir=WORKDIR\n")
    return text.replace(shlex.quote(sys.executable), "PYTHON").replace(sys.executable, "PYTHON")


def _relative(text: str) -> str:
    """Paths as the course shows them: runs/... for the chapters' runs (wherever LABS_RUNS put them), the rest
    relative to the course folder."""
    return text.replace(f"{RUNS}{os.sep}", f"runs{os.sep}").replace(f"{ROOT}{os.sep}", "")


def hpz_regather_config(folder) -> Path:
    """zero3_hpz.json with every module releasing its parameters after use (stage3_max_reuse_distance 0), as a large
    model does: backward then fetches again, from hpZ's secondary copy. (The tiny model is smaller than the default
    distance, so DeepSpeed would otherwise keep everything gathered for backward.) stage3_max_live_parameters 0 turns
    prefetching off: DeepSpeed does not release a parameter whose next use a prefetch already covers (chapter 2)."""
    changes = {"zero_optimization.stage3_max_reuse_distance": 0, "zero_optimization.stage3_max_live_parameters": 0}
    return config_lib.write(config_lib.variant(config_lib.load(CONFIGS / "zero3_hpz.json"), changes),
                            Path(folder) / "configs" / "zero3_hpz_regather.json")


def refusals(cases: dict, out) -> list[dict]:
    """{what: `labs train` flags as a dict} -> what each is told, from the same checks the CLI runs (it prints the
    message as `labs: error: ...` and exits with code 2), and how long the check took."""
    rows = []
    for what, flags in cases.items():
        start = time.perf_counter()
        try:
            nodes = multinode.from_flags(**flags)
            launch.prepare(out=out, steps=2, nproc=1, nodes=nodes)
            message = "accepted"
        except LabsError as error:
            message = _relative(f"labs: error: {error}")
        rows.append(dict(what=what, message=message, seconds=time.perf_counter() - start))
    return rows


# ---------------------------------------------------------------------------------------------- the seeds' claims
def deepspeed_resources(hostfile_text: str, num_gpus: int = -1, num_nodes: int = -1, include="", exclude="") -> dict:
    """{host: [slot, ...]} DeepSpeed's runner derives from a hostfile and its flags: its own functions, in its order."""
    from deepspeed.launcher.runner import _parse_hostfile, apply_num_nodes_and_gpus, parse_inclusion_exclusion

    pool = _parse_hostfile(hostfile_text.splitlines())
    return dict(apply_num_nodes_and_gpus(parse_inclusion_exclusion(pool, include, exclude), num_nodes, num_gpus))


def zeropp_knobs() -> list[dict]:
    """ZeRO++'s keys in DeepSpeed's own ZeRO config model: name, default and the docstring beneath it."""
    import ast
    import inspect

    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    body = ast.parse(inspect.getsource(DeepSpeedZeroConfig)).body[0].body
    rows = []
    for node, after in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and node.target.id.startswith("zero_"):
            doc = after.value.value if isinstance(after, ast.Expr) else ""
            rows.append(dict(key=node.target.id, default=DeepSpeedZeroConfig.model_fields[node.target.id].default,
                             meaning=" ".join(str(doc).split())))
    return rows
