"""Several nodes through existing launchers: the flags, the commands and files labs generates, bad input refused in
bounded time, and (end to end) two emulated nodes at 127.0.0.1 training like one node of the same world size."""
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from labs import models, multinode, network, rendezvous, resolve
from labs.course import network_view, stages
from labs.cli import main
from labs.errors import LabsError
from labs.instruments import comm
from labs.instruments.environment import launcher_environment

from conftest import ROOT, descendants, interruptible, labs_env, processes_naming, run_labs, still_running


# ---------------------------------------------------------------------------------------------- flags
def test_endpoint_parsing():
    assert multinode.parse_endpoint("node0:1234") == ("node0", 1234)
    assert multinode.parse_endpoint("10.0.0.1") == ("10.0.0.1", multinode.DEFAULT_PORT)
    assert multinode.parse_endpoint("[fe80::1]:29400") == ("fe80::1", 29400)
    for bad in ("", "a:b:c", "node0:70000", "node0:"):
        with pytest.raises(LabsError):
            multinode.parse_endpoint(bad)


@pytest.mark.parametrize("kwargs, message", [
    (dict(nnodes=2, node_rank=2, endpoint="h:1"), "--node-rank 2 is out of range for --nnodes 2: use 0..1"),
    (dict(nnodes=2, node_rank=-1, endpoint="h:1"), "--node-rank must be a whole number of at least 0"),
    (dict(nnodes=2, node_rank=None, endpoint="h:1"), "give this node's rank too"),
    (dict(nnodes=2, node_rank=0, endpoint=None), "give --rdzv-endpoint HOST:PORT"),
])
def test_torchrun_flags_refused(kwargs, message):
    with pytest.raises(LabsError, match=message.replace("(", r"\(").replace(")", r"\)")):
        multinode.torchrun_nodes(**kwargs)


def test_torchrun_command_uses_the_static_rendezvous(tmp_path):
    nodes = multinode.torchrun_nodes(4, 3, "node0:29555", rdzv_timeout=30)
    command = multinode.torchrun_command(nodes, 8, tmp_path)
    assert command[1:3] == ["-m", "torch.distributed.run"]
    for arg in ("--nnodes=4", "--node-rank=3", "--nproc-per-node=8", "--rdzv-backend=static",
                "--rdzv-endpoint=node0:29555", "--rdzv-conf=timeout=30", "--max-restarts=0"):
        assert arg in command
    assert command[-3:] == ["-m", "labs.rank", str(tmp_path)] and "--standalone" not in command
    assert f"--log-dir={tmp_path / multinode.TORCHRUN_LOGS}" in command     # not a /tmp/torchelastic_* left behind
    assert nodes.world_size(8) == 32 and multinode.global_rank(3, 7, 8) == 31


def test_flags_of_one_launcher_only():
    assert multinode.from_flags() is None
    with pytest.raises(LabsError, match="--include belongs to DeepSpeed's launcher"):
        multinode.from_flags(nnodes=2, node_rank=0, rdzv_endpoint="h:1", include="a")
    with pytest.raises(LabsError, match="need --nnodes"):
        multinode.from_flags(node_rank=1)


# ---------------------------------------------------------------------------------------------- DeepSpeed
def _hostfile(tmp_path, text):
    path = tmp_path / "hostfile"
    path.write_text(text)
    return path


def test_hostfile_include_exclude_and_command(tmp_path):
    path = _hostfile(tmp_path, "# two hosts\nworker-0 slots=4\nworker-1 slots=4\n")
    nodes = multinode.deepspeed_nodes(path, exclude="worker-0:3@worker-1:3", master_addr="10.0.0.1")
    assert nodes.hosts == {"worker-0": [0, 1, 2], "worker-1": [0, 1, 2]} and nodes.nnodes == 2
    command = multinode.deepspeed_command(nodes, tmp_path / "run")
    assert command[1:3] == ["-m", "deepspeed.launcher.runner"]
    assert f"--hostfile={path.resolve()}" in command and "--exclude=worker-0:3@worker-1:3" in command
    assert "--master_addr=10.0.0.1" in command and "--no_ssh" not in command
    assert command[-4:] == ["--no_local_rank", "--module", "labs.rank", str(tmp_path / "run")]
    one = multinode.deepspeed_nodes(path, include="worker-1", master_addr="10.0.0.1", node_rank=0)
    assert one.hosts == {"worker-1": [0, 1, 2, 3]}
    assert "--no_ssh" in multinode.deepspeed_command(one, tmp_path) and "--node_rank=0" in \
        multinode.deepspeed_command(one, tmp_path)


@pytest.mark.parametrize("text, kwargs, message", [
    ("worker-0\nworker-1 slots=4\n", {}, "line 1 'worker-0' names no slots: write 'worker-0 slots=N'"),
    ("worker-0 slots=0\n", {}, "slots must be at least 1"),
    ("worker-0 slots=4\nworker-0 slots=4\n", {}, "multiple entries for worker-0"),
    ("worker-0 slots=4\nworker-1 slots=2\n", dict(master_addr="a"), "different numbers of slots"),
    ("worker-0 slots=4\n", dict(include="worker-9"), "--include 'worker-9'"),
    ("worker-0 slots=4\nworker-1 slots=4\n", dict(master_addr="a", node_rank=2), "--node-rank 2 is out of range"),
    ("worker-0 slots=4\nworker-1 slots=4\n", {}, "give --master-addr"),
])
def test_bad_hostfiles_are_named(tmp_path, text, kwargs, message):
    with pytest.raises(LabsError, match=message.replace("(", r"\(")):
        multinode.deepspeed_nodes(_hostfile(tmp_path, text), **kwargs)


# ---------------------------------------------------------------------------------------------- run folders
def test_only_node_zero_writes_out():
    assert multinode.node_out(Path("runs/x"), None) == Path("runs/x")
    assert multinode.node_out(Path("runs/x"), 0) == Path("runs/x")
    assert multinode.node_out(Path("runs/x"), 3) == Path("runs/x.node3")


# ---------------------------------------------------------------------------------------------- Slurm
def test_slurm_script_runs_labs_once_per_node(tmp_path):
    """The script as sbatch would run it, with stand-ins for scontrol and srun: each 'node' gets its rank and the
    first host as rendezvous."""
    assert main(["train", "--slurm", str(tmp_path / "job.sbatch"), "--nnodes", "3", "--nproc", "8", "--preset",
                 "qwen2.5-7b", "--out", "runs/big", "--steps", "20"]) == 0
    script = (tmp_path / "job.sbatch").read_text()
    for line in ("#SBATCH --nodes=3", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=8",
                 'srun --kill-on-bad-exit=1 --ntasks-per-node=1 --cpus-per-task="$SLURM_CPUS_ON_NODE"'):
        assert line in script
    chosen = multinode.slurm_script(2, 8, ["--preset", "tiny"], cpus_per_task=32)
    assert "#SBATCH --cpus-per-task=32" in chosen and '--cpus-per-task="$SLURM_CPUS_PER_TASK"' in chosen
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/sh\nprintf 'gpu-a\\ngpu-b\\ngpu-c\\n'\n")
    # srun: run the task once per node, as Slurm would, with that node's SLURM_NODEID; `exec` is replaced by echo.
    (bin_dir / "srun").write_text('#!/bin/bash\nshift 3; for id in 0 1 2; do SLURM_NODEID=$id '
                                  'bash -c "${3/exec /echo }"; done\n')
    for tool in ("scontrol", "srun"):
        (bin_dir / tool).chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_NODELIST="gpu-[a-c]",
               SLURM_JOB_NUM_NODES="3", SLURM_CPUS_ON_NODE="96")
    result = subprocess.run(["bash", str(tmp_path / "job.sbatch")], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stdout.splitlines() if " -m labs train " in line]
    assert len(lines) == 3
    for node, line in enumerate(lines):
        assert line.endswith(f"--nnodes 3 --node-rank {node} --rdzv-endpoint gpu-a:29500")
        assert "--preset qwen2.5-7b --out runs/big --steps 20 --nproc 8" in line and "--slurm" not in line


def test_chapter_6_shows_the_script_the_cli_writes(tmp_path):
    from labs.course import multinode as emulation

    shown = emulation.slurm_written(["--nnodes", "4", "--nproc", "8", "--preset", "qwen2.5-7b", "--out", "runs/x"],
                                    tmp_path)
    assert main(["train", "--slurm", str(tmp_path / "cli.sbatch"), "--nnodes", "4", "--nproc", "8", "--preset",
                 "qwen2.5-7b", "--out", "runs/x"]) == 0
    written = (tmp_path / "cli.sbatch").read_text()
    assert shown == written.replace(f"--chdir={Path.cwd()}\n", "--chdir=WORKDIR\n").replace(sys.executable, "PYTHON")
    assert "--cpus-per-task=" not in shown.split("srun")[0] and "'exec PYTHON -m labs train --preset" in shown


def test_nccl_default_timeout_read_from_torch():
    import datetime

    import torch.distributed.constants

    from labs.course import hangs

    expected = torch.distributed.constants.default_pg_nccl_timeout or datetime.timedelta(minutes=10)
    assert hangs.nccl_default_timeout() == expected


# ---------------------------------------------------------------------------------------------- rendezvous
def test_wait_for_endpoint_answers_or_times_out():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        assert rendezvous.wait_for_endpoint("127.0.0.1", port, 5) < 5
    start = time.monotonic()
    with pytest.raises(LabsError, match=f"127.0.0.1:{port} did not answer within 1 s"):
        rendezvous.wait_for_endpoint("127.0.0.1", port, 1)
    assert time.monotonic() - start < 5


def test_node_zero_must_hold_the_endpoint_with_a_free_port():
    with pytest.raises(LabsError, match="192.0.2.1 .192.0.2.1. is not this host"):
        rendezvous.check_endpoint(multinode.torchrun_nodes(2, 0, "192.0.2.1:29500"))    # TEST-NET: nobody's
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(LabsError, match=f"port {port} is in use on this host"):
            rendezvous.check_endpoint(multinode.torchrun_nodes(2, 0, f"127.0.0.1:{port}"))
    rendezvous.check_endpoint(multinode.torchrun_nodes(2, 0, f"127.0.0.1:{rendezvous.free_port()}"))    # passes


def test_deepspeed_hostfile_mode_checks_pdsh_and_the_first_hosts_address(tmp_path, monkeypatch):
    """`labs train --hostfile` (no --node-rank) starts the hosts through DeepSpeed's runner: pdsh for several hosts (one
    host is a local launch), rank 0 on the first host in use, which need not be this one. Without pdsh, or with a
    --master-addr other than the first host's, it failed in DeepSpeed's runner with a 126-line traceback. Refused
    before any rank starts, naming the flag typed (--master-addr/--master-port, not torchrun's)."""
    two = _hostfile(tmp_path, "127.0.0.1 slots=2\n192.0.2.7 slots=2\n")
    monkeypatch.setattr(rendezvous.shutil, "which", lambda name: None)
    with pytest.raises(LabsError, match="starts the 2 hosts' ranks with pdsh, which is not installed here"):
        rendezvous.check_endpoint(multinode.deepspeed_nodes(two, master_addr="127.0.0.1"))
    one = tmp_path / "one"
    one.write_text("localhost slots=2\n")
    rendezvous.check_endpoint(multinode.deepspeed_nodes(one, master_port=rendezvous.free_port()))   # local: no pdsh
    refused = r"^--hostfile names one host in use, .* --master-addr 192.0.2.1 \(192.0.2.1\) is not this host"
    with pytest.raises(LabsError, match=refused):                                                # no --node-rank
        rendezvous.check_endpoint(multinode.deepspeed_nodes(one, master_addr="192.0.2.1"))
    elsewhere_one = tmp_path / "elsewhere_one"          # the runner launches one host here, whatever it is called
    elsewhere_one.write_text("192.0.2.7 slots=2\n")
    with pytest.raises(LabsError, match=refused):
        rendezvous.check_endpoint(multinode.deepspeed_nodes(elsewhere_one, master_addr="192.0.2.1"))
    rendezvous.check_endpoint(multinode.deepspeed_nodes(elsewhere_one, master_port=rendezvous.free_port()))
    rendezvous.check_endpoint(multinode.deepspeed_nodes(two, master_addr="127.0.0.1", node_rank=0,
                                                        master_port=rendezvous.free_port()))   # --no_ssh: no pdsh
    monkeypatch.setattr(rendezvous.shutil, "which", lambda name: f"/usr/bin/{name}")
    with pytest.raises(LabsError, match=r"--master-addr 192.0.2.1 \(192.0.2.1\) is not the hostfile's first host in "
                                        r"use, 127.0.0.1 \(127.0.0.1\), where rank 0 runs"):
        rendezvous.check_endpoint(multinode.deepspeed_nodes(two, master_addr="192.0.2.1"))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_text("192.0.2.7 slots=2\n192.0.2.8 slots=2\n")
    rendezvous.check_endpoint(multinode.deepspeed_nodes(elsewhere, master_addr="192.0.2.7"))   # a head node outside
    refused = r"--node-rank 0 is where rank 0 runs, but --master-addr 192.0.2.1 .* as --master-addr$"
    with pytest.raises(LabsError, match=refused):
        rendezvous.check_endpoint(multinode.deepspeed_nodes(two, master_addr="192.0.2.1", node_rank=0))
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(LabsError, match=f"--master-port {port}: port {port} is in use on this host"):
            rendezvous.check_endpoint(multinode.deepspeed_nodes(two, master_addr="127.0.0.1", master_port=port))
    rendezvous.check_endpoint(multinode.deepspeed_nodes(two, master_addr="127.0.0.1",
                                                        master_port=rendezvous.free_port()))      # passes


def test_hostfile_refusal_is_the_only_output(tmp_path):
    """The --node-rank refusal came after DeepSpeed's "Setting accelerator to CPU" warning (the hostfile's parser
    imported DeepSpeed before labs named the accelerator) and named torchrun's --rdzv-endpoint."""
    path = _hostfile(tmp_path, "node0 slots=1\nnode1 slots=1\n")
    result = run_labs("train", "--out", tmp_path / "run", "--hostfile", path, "--node-rank", 0, "--master-addr",
                      "192.0.2.1", "--steps", 2, timeout=120)
    assert result.returncode == 2 and result.stdout == "", result.stdout
    assert result.stderr.count("\n") == 1 and "as --master-addr" in result.stderr and "rdzv" not in result.stderr
    assert not (tmp_path / "run").exists()


def test_a_launcher_that_fails_before_any_rank_says_why_on_the_first_line(tmp_path):
    from labs import supervisor

    (tmp_path / "launch.log").write_text(
        "Traceback (most recent call last):\n  File \"runner.py\", line 491, in main\nRuntimeError: Using hostfile "
        "at h but host=node0 was not reachable via ssh. If you are running with a single node ...\n")
    first = supervisor.failure_message(tmp_path, 1, None).splitlines()[0]
    assert first.startswith("the launcher exited with code 1 before any rank reported an error: RuntimeError: Using "
                            "hostfile at h but host=node0 was not reachable via ssh") and "; its output ended:" in first
    (tmp_path / "launch.log").write_text("Traceback (most recent call last):\nsubprocess.CalledProcessError: Command "
                                         "'['ssh', 'node0', 'hostname', '-I']' returned non-zero exit status 255.\n")
    first = supervisor.failure_message(tmp_path, 1, None).splitlines()[0]
    assert "an error: subprocess.CalledProcessError: Command" in first


def test_a_missing_node_is_named_from_the_launcher_log():
    log = "torch.distributed.DistStoreError: Timed out after 6 seconds waiting for clients. 1/2 clients joined."
    assert rendezvous.rendezvous_failure(log).startswith("only 1 of 2 nodes came to the rendezvous")
    assert rendezvous.rendezvous_failure("RuntimeError: boom") is None


@pytest.mark.parametrize("args, message", [
    (["--nnodes", "2", "--node-rank", "5", "--rdzv-endpoint", "127.0.0.1:29500"], "--node-rank 5 is out of range"),
    (["--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "127.0.0.1:PORT", "--rdzv-timeout", "2"],
     "did not answer within 2 s"),
    (["--hostfile", "HOSTFILE"], "names no slots"),
])
def test_bad_launcher_input_is_one_line_and_exit_2(tmp_path, args, message):
    with socket.socket() as probe:           # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    _hostfile(tmp_path, "worker-0\n")
    args = [a.replace("PORT", str(port)).replace("HOSTFILE", str(tmp_path / "hostfile")) for a in args]
    result = run_labs("train", "--out", tmp_path / "run", *args, timeout=60)
    assert result.returncode == 2 and message in result.stderr
    assert result.stderr.count("\n") == 1 and not (tmp_path / "run").exists() and not (tmp_path / "run.node1").exists()


# ---------------------------------------------------------------------------------------------- the model
def test_reuse_model_for_the_network_models_regathered():
    qwen = network_view.qwen_regathered("qwen2.5-7b", gpus_per_node=8)
    counts = models.param_counts(models.shape("qwen2.5-7b"))
    # every parameter fetched again for backward but the output head and the persistent ones (chapter 2: 1.93 Psi)
    assert qwen["params"] == counts["total"] and round(qwen["gathered"] / qwen["params"], 2) == 1.93
    assert 0 < qwen["params"] - qwen["regathered"] - counts["lm_head"] < 1e6


def test_network_model_collectives():
    cluster = network.Cluster(gpus_per_node=8, nodes=4, intra_gbps=450, inter_gbps=400)
    zero3 = network.counted(network.collectives("ZeRO-3", 1000, cluster))
    assert zero3 == {"all_gather": {"bytes": 4000, "bytes_across_nodes": 4000},
                     "reduce_scatter": {"bytes": 2000, "bytes_across_nodes": 2000}}
    hpz = network.counted(network.collectives("ZeRO++ hpZ", 1000, cluster, regathered=3000))
    assert hpz["all_gather"] == {"bytes": 2000 + 6000, "bytes_across_nodes": 2000}
    # A ring over all 32 ranks sends 31/32 of its payload out of each node; the paper's 3M -> 0.75M per node.
    z3 = network.step_time("ZeRO-3", 1000, cluster, compute_s=1)
    zpp = network.step_time("ZeRO++ hpZ+qwZ+qgZ", 1000, cluster, compute_s=1)
    assert z3["node_out_bytes"] == pytest.approx(3 * 2000 * 31 / 32)
    assert zpp["node_out_bytes"] == pytest.approx(1000 * 31 / 32 + 500 * 3 / 4)
    hsdp = network.collectives("FSDP2 hybrid", 1000, cluster)[-1]
    assert (hsdp.kind, hsdp.group, hsdp.node_out_bytes) == ("all_reduce", 4, pytest.approx(8 * 2 * 500 * 3 / 4))
    # Reduced in bf16, FSDP2 hybrid sends half; in fp32 it sends less than ZeRO-3 on 2 nodes, more on 4.
    bf16 = network.collectives("FSDP2 hybrid", 1000, cluster, reduce_bytes=network.BF16)[-1]
    assert bf16.node_out_bytes == pytest.approx(hsdp.node_out_bytes / 2) and "bf16" in bf16.what

    def out(scheme, nodes):
        return network.step_time(scheme, 1000, network.Cluster(8, nodes, 450, 400), 1)["node_out_bytes"]
    assert out("FSDP2 hybrid", 2) < out("ZeRO-3", 2) and out("FSDP2 hybrid", 4) > out("ZeRO-3", 4)
    one_node = network.collectives("ZeRO-3", 1000, network.Cluster(8, 1, 450, 400))
    assert not any(c.across_nodes for c in one_node)
    assert z3["overlapped_s"] == max(z3["comm_s"], 1) and z3["serial_s"] == z3["comm_s"] + 1


def test_groups_spanning_nodes_and_the_launcher_environment():
    assert comm.spans_nodes([0, 1], 2) is False and comm.spans_nodes([1, 2], 2) is True
    env = launcher_environment({"RANK": "3", "TORCHELASTIC_RUN_ID": "x", "NCCL_DEBUG": "INFO", "HOME": "/root"})
    assert env == {"NCCL_DEBUG": "INFO", "RANK": "3", "TORCHELASTIC_RUN_ID": "x"}


# ---------------------------------------------------------------------------------------------- end to end
STEPS = 5           # chapter 6's two-node and one-node runs


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    """2 emulated nodes x 1 rank (ZeRO-3, tiny), and the same run on 1 node x 2 ranks: chapter 6's runs. 5 steps, so
    that two losses follow an update with a nonzero learning rate (labs' warm-up gives the first two steps 0)."""
    from labs.course import multinode as emulation

    folder = tmp_path_factory.mktemp("multinode")
    nodes = emulation.emulate(folder / "two", nnodes=2, nproc_per_node=1, steps=STEPS,
                              instruments=("state_bytes", "comm", "rank_env"))
    single = emulation.single_node(folder / "one", nproc=2, steps=STEPS)
    return nodes, single


def test_two_nodes_train_like_one(two_nodes):
    nodes, single = two_nodes
    assert nodes.run.losses == single.losses and len(single.losses) == STEPS
    assert stages.updated_steps(single) == [4, 5]          # two losses after a real update
    node1 = nodes.folders[1]
    assert node1.name == "two.node1" and (node1 / "launch.log").exists() and not (node1 / "summary.json").exists()
    assert "--node-rank=1" in (node1 / "command.txt").read_text()
    envs = [r["env"] for r in nodes.run.summary["rank_env"]]
    assert [(e["RANK"], e["GROUP_RANK"], e["LOCAL_RANK"], e["WORLD_SIZE"]) for e in envs] == \
        [("0", "0", "0", "2"), ("1", "1", "0", "2")]
    # torchrun's log tree (each rank's error file) was in the node's working folder, removed after its launcher exited
    for folder, env in zip(nodes.folders, envs):
        assert f"/.{folder.name}.partial-" in env["TORCHELASTIC_ERROR_FILE"]
        assert f"/{multinode.TORCHRUN_LOGS}/" in env["TORCHELASTIC_ERROR_FILE"]
        assert not (folder / multinode.TORCHRUN_LOGS).exists()
    assert "done: node 1's ranks finished" in nodes.outputs[1]


def test_counted_bytes_across_nodes_match_the_model(two_nodes):
    nodes, _ = two_nodes
    counted = comm.per_step(nodes.run.metrics)
    params = nodes.run.summary["params"]
    # Default reuse distance: the tiny model keeps its gathered parameters for backward (regathered 0).
    reuse = network_view.reuse_regathered(nodes.run.spec["dims"], resolve.zero_knobs(nodes.run.ds_config))
    assert reuse["regathered"] == 0 and reuse["gathered"] == params
    model = network.counted(network.collectives("ZeRO-3", params, network.Cluster(1, 2, 1, 1), regathered=0))
    for kind in ("all_gather", "reduce_scatter"):
        assert counted[kind]["bytes_across_nodes"] == counted[kind]["bytes"] == model[kind]["bytes_across_nodes"]


def test_deepspeeds_launcher_without_ssh_trains_the_same(two_nodes, tmp_path):
    import torch

    from labs.course import multinode as emulation

    if torch.cuda.is_available():
        with pytest.raises(LabsError, match="without GPUs"):
            emulation.emulate(tmp_path / "ds", launcher="deepspeed")
        pytest.skip("DeepSpeed's launcher gives emulated nodes the same GPUs: checked on CPU machines")

    _, single = two_nodes
    nodes = emulation.emulate(tmp_path / "ds", nnodes=2, nproc_per_node=1, steps=STEPS, launcher="deepspeed",
                              instruments=("state_bytes", "rank_env"))
    assert "--no_ssh" in (tmp_path / "ds" / "command.txt").read_text() and nodes.run.losses == single.losses
    assert [(e["env"]["RANK"], e["env"]["CROSS_RANK"], e["env"]["LOCAL_SIZE"]) for e in nodes.run.summary["rank_env"]] \
        == [("0", "0", "1"), ("1", "1", "1")]


def _two_nodes_training(tmp_path, server="parent's"):
    """Two emulated nodes (one CPU rank each) launched as a user would, once node 0 has logged a step; returns the
    rendezvous port, the two labs processes, their logs, and every process started for them. server "parent's": they
    fork their launchers from this test process's warm server (labs.prefork); "own": each starts its own, so each
    node's processes descend from its labs process."""
    from labs.course import multinode as emulation

    port = emulation.free_port()
    commands = [emulation.train_command(tmp_path / "run", k, 2, port, 1, steps=500) for k in (0, 1)]
    env = labs_env(server, OMP_NUM_THREADS="1")
    before = set(descendants(os.getpid()))
    logs = [tmp_path / f"node{k}.log" for k in (0, 1)]
    procs = [subprocess.Popen(interruptible([c for c in command if c != "--quiet"]), env=env, stdout=open(log, "w"),
                              stderr=subprocess.STDOUT) for command, log in zip(commands, logs)]
    deadline = time.monotonic() + 300
    while "step " not in logs[0].read_text() and time.monotonic() < deadline:
        assert all(p.poll() is None for p in procs), logs[0].read_text()[-2000:]
        time.sleep(0.5)
    started = [pid for pid in descendants(os.getpid()) if pid not in before]
    if server == "parent's":        # each node's launcher is the warm server's child, not its labs process's
        assert not descendants(procs[0].pid) and not descendants(procs[1].pid)
    assert sum(open(f"/proc/{pid}/comm").read().startswith("labs rank") for pid in still_running(started)) == 2
    return port, procs, logs, started


def _nothing_left(tmp_path, started):
    deadline = time.monotonic() + 15
    while still_running(started) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not still_running(started), [open(f"/proc/{pid}/comm").read() for pid in still_running(started)]
    assert not (tmp_path / "run").exists() and not (tmp_path / "run.node1").exists()


def test_a_stop_announced_in_the_rendezvous_store_stops_every_node(tmp_path):
    """What a node's launcher does when its run is interrupted or fails (labs.peers.announce), done here while both
    nodes still train: every rank must stop within seconds, even one that gloo would leave waiting on a peer."""
    from labs import peers

    port, procs, logs, started = _two_nodes_training(tmp_path)
    assert peers.announce("127.0.0.1", port, "announced by the test")
    codes = [p.wait(timeout=60) for p in procs]
    assert codes == [1, 1]
    for log in logs:
        assert "stops: another node's run stopped (announced by the test)" in log.read_text()
    _nothing_left(tmp_path, started)


@pytest.mark.parametrize("stopped", [1, 0])
def test_sigint_on_one_node_stops_every_process_of_both(tmp_path, stopped):
    """Ctrl-C on node 1, or on node 0, which holds the rendezvous store: the other node stops too."""
    other = 1 - stopped
    _, procs, logs, started = _two_nodes_training(tmp_path)
    procs[stopped].send_signal(signal.SIGINT)
    codes = [p.wait(timeout=60) for p in procs]
    assert codes[stopped] == 130 and codes[other] == 1
    assert "labs: interrupted" in logs[stopped].read_text()
    assert "several nodes: a rank elsewhere may have failed first" in logs[other].read_text()
    _nothing_left(tmp_path, started)


def test_a_silent_node_is_told_from_one_still_starting():
    """labs.peers.Heartbeats on readings alone: a counter at 0 (its launcher not beating yet) never alarms; one that
    moved and then stood still for longer than the timeout does, named with how long; moving again clears it."""
    from labs.peers import Heartbeats

    beats = Heartbeats(timeout_s=30)
    assert beats.silent({1: 0, 2: 0}, now=0) is None
    assert beats.silent({1: 0, 2: 0}, now=100) is None          # not started, however long
    assert beats.silent({1: 3, 2: 0}, now=101) is None          # node 1 moved: timed from here
    assert beats.silent({1: 3, 2: 1}, now=131) is None          # 30 s still: not longer than the timeout
    assert beats.silent({1: 3, 2: 1}, now=131.5) == (1, 30.5)
    assert beats.silent({1: 4, 2: 1}, now=140) is None          # moved again (a late reading, e.g. a starved thread)
    assert beats.silent({1: 9, 2: 1}, now=162) == (2, 31)       # node 2 stood still since its first count, at 131


@pytest.mark.parametrize("how", ["SIGKILL", "SIGSTOP"])
def test_a_node_killed_outright_stops_every_other_node(tmp_path, monkeypatch, how):
    """Node 1's launcher and ranks all die at once (SIGKILL: nobody announces a stop), or all freeze (SIGSTOP: a
    dead host across a network, whose connections stay open and silent, since no machine is left to close them).
    Node 1's heartbeat stands still (labs.peers), and node 0's rank stops within the heartbeat's timeout instead of
    waiting out gloo's 30 minutes."""
    from labs import peers

    timeout_s = 5
    monkeypatch.setenv(peers.TIMEOUT_ENV, str(timeout_s))
    _, procs, logs, started = _two_nodes_training(tmp_path, server="own")
    node1 = [procs[1].pid, *descendants(procs[1].pid)]
    assert len(node1) >= 4, node1                    # labs, its warm server, the launcher, the rank
    try:
        for pid in node1:
            os.kill(pid, getattr(signal, how))
        since = time.monotonic()
        code = procs[0].wait(timeout=timeout_s + 60)
        seconds = time.monotonic() - since
    finally:                                         # node 1 frozen, or a failed check: nothing may keep running
        for pid in still_running(started + node1):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert procs[1].wait() == -signal.SIGKILL and code == 1
    assert seconds < timeout_s + 10, seconds
    log = logs[0].read_text()
    silent = "stops: node 1's launcher stopped answering: its heartbeat has not moved for "
    if how == "SIGSTOP":
        assert silent in log, log[-3000:]
    else:       # on one machine the killed processes' connections close, and gloo may raise before the timeout
        assert silent in log or re.search(r"Connection (closed|reset) by peer", log), log[-3000:]
    _nothing_left(tmp_path, started)


def test_a_rank_whose_collective_broke_after_a_stop_was_announced_reports_the_stop(monkeypatch):
    """labs.rank calls peers.stop_if_announced where training raised: with STOP_KEY in the store the rank stops with
    that reason (the error came from the other node leaving), without it the error stands."""
    from labs import peers

    class Store:
        def __init__(self, keys):
            self.keys = keys

        def check(self, keys):
            return all(k in self.keys for k in keys)

        def get(self, key):
            return self.keys[key].encode()

    stopped = []
    watch = peers.Watch.__new__(peers.Watch)              # no thread: only what stop_if_announced reads
    monkeypatch.setattr(watch, "_stop", stopped.append, raising=False)
    monkeypatch.setattr(peers, "_WATCHING", [watch])
    watch.store = Store({})
    peers.stop_if_announced()
    assert stopped == []
    watch.store = Store({peers.STOP_KEY: "interrupted on node 1"})
    peers.stop_if_announced()
    assert stopped == ["another node's run stopped (interrupted on node 1)"]


def test_an_emulation_past_its_timeout_stops_every_node(tmp_path):
    """Chapter 6's emulated nodes are `labs train` processes this one waits for: past the timeout (or on a notebook's
    interrupt, which reaches the kernel alone) each gets SIGTERM, on which labs stops its ranks, before the error."""
    from labs.course import multinode as emulation

    out = tmp_path / "stopped"
    with pytest.raises(subprocess.TimeoutExpired):
        emulation.emulate(out, nnodes=2, nproc_per_node=1, steps=100_000, timeout_s=6)
    deadline = time.monotonic() + 15
    while (left := processes_naming(str(out))) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"processes of the emulation outlived it: {left}"


def test_slurm_script_into_a_missing_folder_is_refused_and_a_stream_gets_the_script_alone(tmp_path, capfd):
    """--slurm into a folder that does not exist: one line, exit code 2, nothing written. Into a stream (a pipe to
    sbatch, /dev/stdout) the script goes out as it is, and labs' note goes to stderr, not into the script."""
    args = ["--nnodes", "2", "--nproc", "8", "--preset", "tiny"]
    assert main(["train", "--slurm", str(tmp_path / "missing" / "job.sbatch"), *args]) == 2
    assert "does not exist" in capfd.readouterr().err and not (tmp_path / "missing").exists()
    assert main(["train", "--slurm", "/dev/stdout", *args]) == 0
    out, err = capfd.readouterr()
    assert out.startswith("#!/bin/bash") and "wrote" not in out and "wrote the script to /dev/stdout" in err
