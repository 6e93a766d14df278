"""The host side: check the inputs, write the run folder's inputs, start the ranks, stream their output,
and publish the run folder only when every rank finished.

    from labs import launch
    run = launch.run(preset="tiny", config="zero3.json", steps=30, out="runs/demo")   # a labs.runfolder.Run
    run.summary["final_loss"], run.metrics[-1]

Without a GPU it starts 2 CPU ranks (gloo, DS_ACCELERATOR=cpu); with GPUs, one rank per GPU (NCCL).
"""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import torch

from labs import config as config_lib
from labs import data, models, resolve, runfolder
from labs.env import repaired_environment
from labs.errors import LabsError, RankFailed, check_choice
from labs.runfolder import Run

ENGINES = resolve.ENGINES
# What the rank loop can measure besides training (labs.instruments): the engine's tensors after the last backward,
# the bytes every collective moves, ZeRO's working buffers, a checkpoint's format. Named here so bad names fail
# before any rank starts.
INSTRUMENTS = ("state_bytes", "comm", "zero_buffers", "state_dict")


def prepare(preset="tiny", config=resolve.DEFAULT_CONFIG, steps=30, out="runs/demo", nproc=None, model_path=None,
            seed=0, micro_batch=None, grad_accum=None, seq_len=None, lr=None, data_path=None, loss="hf",
            activation_checkpointing="none", warmup_steps=2, engine=None, stock=False, kernels="stock",
            precision=None, instruments=("state_bytes",)):
    """Check every input before anything is written; return (spec, resolved DeepSpeed config).
    `instruments` names what the rank loop measures besides training (INSTRUMENTS). `engine` None: FSDP2 when the
    config has an "fsdp" block, else DeepSpeed (labs.resolve.engine)."""
    models.check_preset(preset)
    check_choice("loss", loss, models.LOSSES)
    check_choice("kernels", kernels, models.KERNELS)
    for name in instruments:
        check_choice("instrument", name, INSTRUMENTS)
    if not isinstance(steps, int) or steps < 1:
        raise LabsError(f"--steps must be a positive integer, not {steps!r}")
    raw = config_lib.load(config)
    engine = resolve.engine(raw, engine)
    dims = models.shape(preset)
    if model_path is not None:
        model_path = str(models.check_model_path(model_path).resolve())
        dims = models.shape(_hf_config(model_path))
    if data_path is not None:
        data_path = str(Path(data_path).resolve())
        data.check_path(data_path)
    models.checkpointed_layers(activation_checkpointing, dims["num_hidden_layers"])
    on_gpu = torch.cuda.is_available()
    nproc = nproc or (torch.cuda.device_count() if on_gpu else 2)
    resolved = resolve.ds_config(raw, world_size=nproc, dims=dims, steps=steps, on_gpu=on_gpu, preset=preset,
                                 micro_batch=micro_batch, grad_accum=grad_accum, lr=lr, precision=precision,
                                 engine=engine)
    if on_gpu:
        config_lib.check_nvme_paths(resolved)
    spec = dict(preset=preset, config=str(config_lib.find(config)), steps=steps, seed=seed, nproc=nproc,
                model_path=model_path, seq_len=seq_len or resolve.run_defaults(preset)["seq_len"], data=data_path,
                loss=loss, dims=dims, activation_checkpointing=str(activation_checkpointing),
                warmup_steps=warmup_steps, engine=engine, stock=stock, kernels=kernels, instruments=list(instruments),
                precision=config_lib.precision(resolved), out=str(Path(out)))
    return spec, resolved


def run(out="runs/demo", stream=True, **kwargs) -> Run:
    """Launch a training run (all keyword arguments of `prepare`) and wait for it. Raises LabsError for bad
    input (nothing written) and RankFailed with the failing rank's traceback if training crashes."""
    spec, resolved = prepare(out=out, **kwargs)
    spec["progress"] = "bar" if sys.stdout.isatty() else "lines"
    out = Path(out)
    work = runfolder.partial_folder(out)
    try:
        env, repairs = repaired_environment(spec["nproc"], config_lib.offloads(resolved)["optimizer"] == "cpu")
        env = _with_labs_importable(env)
        command = launcher_command(spec["nproc"], work)
        (work / "run.json").write_text(json.dumps(spec, indent=1) + "\n")
        (work / "ds_config.json").write_text(json.dumps(resolved, indent=1) + "\n")
        (work / "command.txt").write_text(shlex.join(command) + "\n")
        (work / "environment.json").write_text(json.dumps(
            {"repairs": repairs, "torch": torch.__version__, "cuda": torch.version.cuda, "host_python": sys.version,
             "DS_ACCELERATOR": env.get("DS_ACCELERATOR"), "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS"),
             "TORCH_CUDA_ARCH_LIST": env.get("TORCH_CUDA_ARCH_LIST"), "NCCL_NVLS_ENABLE": env.get("NCCL_NVLS_ENABLE"),
             "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}, indent=1) + "\n")
        for repair in repairs:
            print(f"labs: repaired {repair}", flush=True)
        code = _stream(command, env, work / "launch.log", echo=stream)
        if code != 0:
            raise RankFailed(_failure_message(work, code))
        runfolder.publish(work, out)
    except BaseException:
        runfolder.discard(work)
        raise
    return Run(out)


def launcher_command(nproc: int, run_dir: Path) -> list[str]:
    """torchrun, one host. (The `deepspeed` launcher would do the same here through an extra process;
    labs.multinode writes the multi-host commands.)"""
    # --standalone: torchrun's own rendezvous on a port it holds open, so concurrent launches never collide.
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            "-m", "labs.rank", str(run_dir)]


def _stream(command, env, log_path, echo) -> int:
    """Run the launcher, copying its output (rank 0's progress bar included) to our stdout and a log."""
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        while chunk := process.stdout.read1(4096):
            log.write(chunk)
            if echo:
                sys.stdout.write(chunk.decode("utf-8", "replace"))
                sys.stdout.flush()
        return process.wait()


def _failure_message(work: Path, code: int) -> str:
    errors = sorted(work.glob("rank*.err"), key=lambda p: p.stat().st_mtime)
    if errors:   # the earliest is the rank that failed first; the others usually died waiting for it
        return f"{errors[0].stem.replace('rank', 'rank ')} failed (launcher exit code {code}):\n" + \
            errors[0].read_text()
    tail = (work / "launch.log").read_bytes()[-4000:].decode("utf-8", "replace")
    return f"the launcher exited with code {code} before any rank reported an error; its output ended:\n{tail}"


def _hf_config(model_path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_path)


def _with_labs_importable(env: dict) -> dict:
    """Ranks import `labs` from the same place as this process does, whatever their working directory."""
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env
