"""ZeRO-Offload seen from the host: which of a run's tensors an offloaded optimizer keeps in host memory (against
labs.memory), what a recorded GPU run's offloaded step cost, the offload scenarios, what each launcher sets
OMP_NUM_THREADS to, how fast DeepSpeed's CPU Adam steps with a given number of threads, and whether NVMe offload
can run here.

    offload.host_rows({"zero3_offload_optimizer": run, ...})   # host bytes measured (by name) and predicted
    offload.recorded_offload_step(row)                  # a labs.bench.results row read within itself
    offload.scenario_rows("qwen-7b", 4, "RTX3090")      # labs.memory per offload level, from the chapter's configs
    offload.recorded_thread_rows()                      # run r: CPU Adam's step at 16, 8 and 4 threads on an H200 host
    offload.launcher_threads()                          # {"torchrun, 2 processes": ["1"], ...}
    offload.cpu_adam_step_seconds(threads=1)            # one CPU Adam step over 20 M fp32 parameters
    offload.nvme_ready()                                # (False, "no GPU here ...")

    python -m labs.course.offload cpu-adam NUMEL STEPS  # the benchmark's child process (prints one JSON line)
"""
from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import time

from labs import CONFIGS, ROOT
from labs import config as config_lib
from labs import memory, supervisor
from labs.course import gpu_report
from labs.env import importable_path, repaired_environment


# The tensors DeepSpeed 0.19.8 allocates in host memory when the optimizer is offloaded to the CPU, as the
# state_bytes instrument names them (stage_1_and_2.py, stage3.py: every one is created on `self.device`, which is
# "cpu" under offload): CPU Adam's fp32 gradient partition, ZeRO-1/2's bf16 buffer for the updated weights and
# host staging buffer, ZeRO-3's bf16 gradient partition. Everything in the optimizer category (fp32 master, Adam's
# moments) is there too. On a GPU host the instrument also sees the device of each; on a CPU only the names tell.
HOST_SIDE = ("optimizer master[i].grad", "fp32_partitioned_groups_flat[i].grad",
             "param_buffer_of_bit16_for_cpu_offload_groups[i]", "temp_grad_buffer_for_cpu_offload",
             "grad_partitions_flat_buffer")


def host_side_bytes(state: dict, offload_param=False) -> int:
    """Bytes of one rank's tensors that an offloaded optimizer (and, with offload_param, the parameter partitions)
    keeps in host memory, from a state_bytes record: found by name, so also on a machine without a GPU."""
    named = sum(t["bytes"] for t in state["largest"] if re.sub(r"\[\d+\]", "[i]", t["what"]) in HOST_SIDE)
    return state["optimizer_bytes"] + named + (state["params_bytes"] if offload_param else 0)


def host_rows(runs: dict) -> list[dict]:
    """Per offloaded run: host bytes of the node measured (host_side_bytes, summed over the ranks) and predicted by
    labs.memory for the same run."""
    rows = []
    for name, run in runs.items():
        offloads = config_lib.offloads(run.ds_config)
        if not offloads["optimizer"]:
            continue
        measured = sum(host_side_bytes(s, bool(offloads["param"])) for s in run.summary["state_bytes"])
        predicted = memory.from_run(run).host_per_node_bytes
        rows.append(dict(run=name, ranks=len(run.summary["state_bytes"]), measured_bytes=measured,
                         predicted_bytes=predicted, ratio=measured / predicted,
                         per_param=measured / run.summary["params"]))
    return rows


def recorded_offload_step(row: dict) -> dict:
    """A recorded GPU case with optimizer offload (labs.bench.results row) read within itself, like for like: the
    GPU part of its step (forward + backward, DeepSpeed's timers), the CPU optimizer step, their ratio to the whole
    step; labs.memory's peak for the same run with the offload and without it, whether that one fits the GPU, and
    the GPU's usable GiB under labs.memory's reserve (1 GiB + 5% of the card, a heuristic)."""
    gpu_part = (row["fwd_ms"] + row["bwd_ms"]) / 1000
    kwargs = dict(gpus_per_node=row["gpus"], seq_len=row["seq_len"], loss=row["loss"], kernels=row["kernels"],
                  activation_checkpointing=row["checkpointing"], ds_config=row["ds_config"], engine=row["engine"],
                  micro_batch=row["micro_batch"], grad_accum=row["grad_accum"])
    without = memory.estimate(row["preset"], offload_optimizer="none", offload_param="none", **kwargs)
    card = memory.GPUS[row["gpu"].removeprefix("NVIDIA ")]
    return dict(gpu_part_s=gpu_part, optimizer_s=row["step_ms"] / 1000, step_s=row["step_s"],
                step_over_gpu_part=row["step_s"] / gpu_part,
                predicted_peak_gib=memory.estimate(row["preset"], **kwargs).total_per_gpu_bytes / 2**30,
                predicted_without_gib=without.total_per_gpu_bytes / 2**30, fits_without=without.fits(card),
                usable_gib=memory.usable_bytes(card) / 2**30)


# The chapter's config file for each offload level (labs.resolve.OFFLOAD_LEVELS' names): the scenarios are computed
# from these, so that pin_memory (true in both offload files) and with it PyTorch's pinning count on the host.
SCENARIO_CONFIGS = {"none": "zero3.json", "optimizer": "zero3_offload_optimizer.json",
                    "optimizer+params": "zero3_offload_all.json"}


def scenario_rows(preset: str, gpus: int, gpu: str, **options) -> list[dict]:
    """labs.memory's verdict for each offload level, ZeRO-3 from the chapter's config files (SCENARIO_CONFIGS), on a
    GPU host (PyTorch's pinning): peak bytes per GPU, fits or not, host bytes per node."""
    rows = []
    for label, name in SCENARIO_CONFIGS.items():
        estimate = memory.estimate(preset, gpus_per_node=gpus, ds_config=config_lib.load(CONFIGS / name), **options)
        rows.append(dict(setup=f"{preset}, {gpus} x {gpu}, ZeRO-3", offload=label, config=name,
                         gpu_bytes=estimate.total_per_gpu_bytes, fits=estimate.fits(memory.GPUS[gpu]),
                         host_bytes=estimate.host_per_node_bytes))
    return rows


def recorded_thread_rows() -> list[dict]:
    """Run r (chapter 9): the same ZeRO-2 offload case on one H200 host, run once each with CPU Adam on 16, 8 and 4
    OpenMP threads (three invocations one after another): DeepSpeed's `step` timer (the CPU optimizer step), the
    whole step, tokens/s, and the host the result file records."""
    rows = []
    for threads, suffix in gpu_report.THREADS.items():
        result = gpu_report.result_file(suffix)
        assert result["environment"]["OMP_NUM_THREADS"] == str(threads), suffix
        for row in gpu_report.offload_rows(suffix):
            rows.append(dict(row, threads=threads, run=suffix, date=result["date"][:10], preset=result["preset"],
                             gpu=result["host"]["gpus"][0], cpu_cores=result["host"]["cpu_cores"],
                             host_memory_gib=result["host"]["host_memory_gib"]))
    return rows


def cpu_adam_step_seconds(threads: int, numel: int = 20_000_000, steps: int = 5) -> float:
    """Median seconds of one DeepSpeedCPUAdam step over `numel` fp32 parameters, in a fresh process whose
    OMP_NUM_THREADS is `threads` (the variable a launcher sets, read once when OpenMP starts)."""
    env = dict(repaired_environment(1, cpu_offload=True)[0], OMP_NUM_THREADS=str(threads), PYTHONWARNINGS="ignore")
    result = subprocess.run([sys.executable, "-m", "labs.course.offload", "cpu-adam", str(numel), str(steps)], env=env,
                            capture_output=True, text=True, timeout=900)
    if result.returncode != 0:
        raise RuntimeError(f"the CPU Adam benchmark failed:\n{result.stderr[-3000:]}")
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["threads"] == threads, f"the child ran {report['threads']} threads, not {threads}"
    return report["median_s"]


def _cpu_adam_benchmark(numel: int, steps: int) -> dict:
    import torch
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    param = torch.nn.Parameter(torch.zeros(numel))
    param.grad = torch.full((numel,), 1e-3)
    optimizer = DeepSpeedCPUAdam([param], lr=1e-3)
    optimizer.step()                        # first step: state allocation and first touch of its pages
    seconds = []
    for _ in range(steps):
        start = time.perf_counter()
        optimizer.step()
        seconds.append(time.perf_counter() - start)
    return dict(median_s=statistics.median(seconds), threads=torch.get_num_threads(), numel=numel)


LAUNCHERS = {
    "torchrun, 2 processes": ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                              "-m", "labs.course.omp_probe"],
    "torchrun, 1 process": ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
                            "-m", "labs.course.omp_probe"],
    "deepspeed, 2 processes": ["-m", "deepspeed.launcher.runner", "--num_gpus=2", "--module", "labs.course.omp_probe"],
    "accelerate launch, 1 process": ["-m", "accelerate.commands.launch", "--num_processes=1", "--num_machines=1",
                                     "--mixed_precision=no", "--dynamo_backend=no", "-m", "labs.course.omp_probe"],
    # with DeepSpeed, accelerate hands over to torchrun (one host) without setting OMP_NUM_THREADS itself
    "accelerate + DeepSpeed, 2 processes": ["-m", "accelerate.commands.launch", "--use_deepspeed", "--zero_stage=3",
                                            "--num_processes=2", "--num_machines=1", "--mixed_precision=no",
                                            "--dynamo_backend=no", "-m", "labs.course.omp_probe"],
    "accelerate + DeepSpeed, 1 process": ["-m", "accelerate.commands.launch", "--use_deepspeed", "--zero_stage=3",
                                          "--num_processes=1", "--num_machines=1", "--mixed_precision=no",
                                          "--dynamo_backend=no", "-m", "labs.course.omp_probe"],
}


def launcher_threads(names=tuple(LAUNCHERS)) -> dict:
    """{launcher: sorted set of OMP_NUM_THREADS its processes found}, each launcher started for real on a tiny
    probe, from an environment without OMP_NUM_THREADS (None: the launcher left it unset)."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env.update(DS_ACCELERATOR="cpu" if not _has_gpu() else env.get("DS_ACCELERATOR", "cuda"), PYTHONWARNINGS="ignore")
    env["PYTHONPATH"] = importable_path(env)
    found = {}
    for name in names:
        result = supervisor.run_captured([sys.executable, *LAUNCHERS[name]], env, timeout=300, cwd=ROOT)
        lines = [json.loads(m) for m in re.findall(r"omp-probe (\{[^}]*\})", result.stdout + result.stderr)]
        if result.returncode != 0 or not lines:
            raise RuntimeError(f"{name} failed (exit {result.returncode}):\n{(result.stdout + result.stderr)[-2000:]}")
        found[name] = sorted({line["OMP_NUM_THREADS"] for line in lines}, key=str)
    return found


def recorded_nvme() -> dict:
    """Run q (chapter 9): ZeRO-3 with the optimizer offloaded (parameters on the GPU), the 3B shape on one H200 host,
    the optimizer state in host memory against the same on the host's disk (NVMe offload), one invocation: each
    case's offload_rows row, the host, the disk's direct-I/O bandwidth (dd, GB/s) and the swap folder's size after
    the run (GiB)."""
    suffix = gpu_report.RUNS["nvme"]
    result = gpu_report.result_file(suffix)
    cases = {("nvme" if "nvme" in r["case"] else "cpu"): r for r in gpu_report.offload_rows(suffix)}
    return dict(cases, run=suffix, date=result["date"][:10], gpu=result["host"]["gpus"][0],
                cpu_cores=result["host"]["cpu_cores"], host_memory_gib=result["host"]["host_memory_gib"],
                disk=gpu_report.disk_bandwidth(), swap_gib=gpu_report.nvme_swap_gib())


def nvme_ready() -> tuple[bool, str]:
    """Can ZeRO-Infinity's NVMe offload run here? It needs a GPU and DeepSpeed's async I/O op (libaio)."""
    if not _has_gpu():
        return False, "no GPU here: labs runs NVMe offload on a GPU host with DeepSpeed's async I/O op (libaio)"
    os.environ.setdefault("DS_ACCELERATOR", "cuda")
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("AsyncIOBuilder")
    if builder is None or not builder.is_compatible(verbose=False):
        return False, "DeepSpeed's async I/O op cannot be built here: install libaio (apt install libaio-dev)"
    return True, "GPU and async I/O op available"


def _has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] != "cpu-adam":
        sys.exit("usage: python -m labs.course.offload cpu-adam NUMEL STEPS")
    print(json.dumps(_cpu_adam_benchmark(int(sys.argv[2]), int(sys.argv[3]))))
