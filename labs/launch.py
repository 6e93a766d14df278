"""The host side of a run: check every input, write the run folder's inputs, start the ranks, stream their output,
and publish the run folder only when every rank finished.

    from labs import launch
    run = launch.run(preset="tiny", config="zero3.json", steps=30, out="runs/demo")   # a labs.runfolder.Run
    run.summary["final_loss"], run.metrics[-1]

Without a GPU it starts 2 CPU ranks (gloo, DS_ACCELERATOR=cpu); with GPUs, one rank per GPU (NCCL).
`prepare` does every check that needs no rank; bad input raises LabsError before anything is written.
Several nodes: `nodes=` a labs.multinode.Nodes (torchrun's rendezvous or DeepSpeed's hostfile); see that module for
which folder each node writes.
"""
from __future__ import annotations

import json
import shlex
import shutil
import sys
import time
from pathlib import Path

import torch

from labs import config as config_lib
from labs import (data, model_folder, models, multinode, offload_copy, peers, preflight, prefork, remote_env,
                  rendezvous, resolve, runcache, runfolder, supervisor)
from labs import env as env_lib
from labs import resume as resume_lib
from labs.errors import LabsError, RankFailed, RunStopped, check_choice
from labs.memory.units import flag_bytes
from labs.runfolder import Run

ENGINES = resolve.ENGINES
# What the rank loop can measure besides training (labs.instruments): the engine's tensors after the last backward,
# the bytes every collective moves, ZeRO's working buffers, a checkpoint's format, the ready engine's logits, the
# environment each rank got, the GPU blocks alive at the peak. Named here so bad names fail before any rank starts.
INSTRUMENTS = ("state_bytes", "comm", "zero_buffers", "state_dict", "probe_logits", "rank_env", "peak_allocations")
GPU_ONLY = {"loss": "liger", "kernels": "liger"}       # Liger's Triton kernels
DEVICES = (None, "cpu", "cuda")                         # None: the GPUs where there are any, else the CPU


def prepare(resume=None, **options):
    """Check every input before anything is written; return (spec, resolved DeepSpeed config). `options` are
    `inputs`' keyword arguments. With `resume` (a run folder, or one of its checkpoints) the run continues that
    run from its newest complete checkpoint: what `options` leaves out comes from the run (labs.resume), and
    another --nproc or ZeRO stage loads it through DeepSpeed's universal checkpoint."""
    if resume is None:
        return inputs(**options)
    spec, resolved = inputs(**resume_lib.options(resume, options))
    spec["resume"] = resume_lib.plan(resume, spec, resolved)
    if spec["resume"]["universal"]:
        resolved["checkpoint"] = {**resolved.get("checkpoint", {}), "load_universal": True}
    return spec, resolved


def inputs(preset=None, config=resolve.DEFAULT_CONFIG, steps=30, out="runs/demo", nproc=None, model_path=None,
           seed=0, micro_batch=None, grad_accum=None, seq_len=None, lr=None, data_path=None, loss="hf",
           activation_checkpointing="none", warmup_steps=2, engine=None, stock=False, kernels="stock",
           precision=None, instruments=("state_bytes",), gpu_memory=None, memory_check=True, compile=False,
           sdpa="default", fp8=False, save_every=None, nodes=None, device=None):
    """The checks and the spec of a new run. `instruments` names what the rank loop measures besides training
    (INSTRUMENTS); `gpu_memory` caps each rank's GPU memory (e.g. "80GiB" or "H100": an H200 then behaves as an
    80 GB card); `engine` None: FSDP2 when the config has an "fsdp" block, else DeepSpeed (labs.resolve.engine);
    `save_every` writes a checkpoint every that many steps and at the last (labs.checkpoint). `nodes`: a
    labs.multinode.Nodes, or None for this host alone. `device` "cpu": CPU ranks (gloo) even on a GPU host (the
    ranks see no GPU); "cuda": GPU ranks or an error; None: one rank per GPU where there is one, else CPU ranks.
    `preset` None: "tiny", or with `model_path` the preset of the folder's shape (labs.model_folder.preset_of)."""
    if preset is not None:
        models.check_preset(preset)
    check_choice("loss", loss, models.LOSSES)
    check_choice("kernels", kernels, models.KERNELS)
    check_choice("attention backend", sdpa, models.ATTENTION)
    for name in instruments:
        check_choice("instrument", name, INSTRUMENTS)
    preflight.check_positive("--steps", steps)
    for flag, value in (("--nproc", nproc), ("--micro-batch", micro_batch), ("--grad-accum", grad_accum),
                        ("--seq-len", seq_len)):
        if value is not None:
            preflight.check_positive(flag, value)
    if lr is not None:
        preflight.check_positive("--lr", lr, kind=float)
    if save_every is not None:
        preflight.check_positive("--save-every", save_every)
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise LabsError(f"--seed must be a non-negative integer, not {seed!r}")
    if not isinstance(warmup_steps, int) or warmup_steps < 0:
        raise LabsError(f"warmup_steps must be a non-negative integer, not {warmup_steps!r}")
    check_choice("device", device, DEVICES)
    offload_copy.chosen()                  # LABS_OFFLOAD_COPY, checked before any rank reads it
    if device == "cpu" and nodes is not None:
        raise LabsError("device 'cpu' runs on this host alone; drop it or the nodes")
    if device == "cuda" and not torch.cuda.is_available():
        raise LabsError("device 'cuda': this machine has no GPU that torch can use; drop it to run on the CPU")
    on_gpu = torch.cuda.is_available() and device != "cpu"
    for option, value in (("loss", loss), ("kernels", kernels)):
        if value == GPU_ONLY[option] and not on_gpu:
            raise LabsError(f"--{option} {value}: Liger's Triton kernels need an NVIDIA GPU; on a CPU use "
                            f"--{option} {'chunked' if option == 'loss' else 'stock'}")
    preflight.check_liger(loss, kernels)
    if nodes is not None and nodes.launcher == "deepspeed":     # the hostfile's slots are the ranks per node
        if nproc is not None and nproc != multinode.slots_per_host(nodes):
            raise LabsError(f"--nproc {nproc} but the hostfile gives {multinode.slots_per_host(nodes)} slots per host")
        nproc = multinode.slots_per_host(nodes)
    out = multinode.node_out(out, nodes.node_rank if nodes else None)
    runfolder.check_out(Path(out))
    raw = config_lib.load(config)
    preflight.check_top_level_keys(raw, config_lib.find(config))
    engine = resolve.engine(raw, engine)
    if save_every is not None and engine != "deepspeed":
        raise LabsError("--save-every: labs checkpoints DeepSpeed runs; drop it or use a DeepSpeed config")
    if fp8 and (engine != "fsdp2" or not on_gpu):
        raise LabsError("fp8 (torchao float8 training) runs with --engine fsdp2 on a GPU with fp8 tensor cores")
    dims = None
    if model_path is not None:
        model_path = str(models.check_model_path(model_path).resolve())
        dims = model_folder.check(Path(model_path))
        preset = preset or model_folder.preset_of(Path(model_path), dims)
    preset = preset or "tiny"
    dims = dims or models.shape(preset)
    models.checkpointed_layers(activation_checkpointing, dims["num_hidden_layers"])
    nproc = nproc or (torch.cuda.device_count() if on_gpu else 2)
    world_size = nodes.world_size(nproc) if nodes else nproc
    resolved = resolve.ds_config(raw, world_size=world_size, dims=dims, steps=steps, on_gpu=on_gpu, preset=preset,
                                 micro_batch=micro_batch, grad_accum=grad_accum, lr=lr, precision=precision,
                                 engine=engine)
    preflight.check_ds_config(resolved, config_lib.find(config))
    if on_gpu:
        config_lib.check_nvme_paths(resolved)
    seq_len = seq_len or resolve.run_defaults(preset)["seq_len"]
    gpu_memory_bytes = flag_bytes("--gpu-memory", gpu_memory)
    if memory_check:
        preflight.check_hardware(nproc, on_gpu, seq_len, dims, dict(
            dims=dims, gpus_per_node=nproc, nodes=nodes.nnodes if nodes else 1, seq_len=seq_len, loss=loss,
            kernels=kernels, engine=engine, activation_checkpointing=activation_checkpointing, ds_config=resolved),
            gpu_memory_bytes)
    if data_path is not None:
        data_path = str(Path(data_path).resolve())
    data.check_enough_tokens(data_path, world_size * resolved["train_micro_batch_size_per_gpu"], seq_len)
    spec = dict(preset=preset, config=str(config_lib.find(config)), steps=steps, seed=seed, nproc=nproc,
                model_path=model_path, seq_len=seq_len, data=data_path, loss=loss, dims=dims,
                activation_checkpointing=str(activation_checkpointing), warmup_steps=warmup_steps, engine=engine,
                stock=stock, kernels=kernels, instruments=list(instruments), gpu_memory_bytes=gpu_memory_bytes,
                compile=bool(compile), sdpa=sdpa, fp8=bool(fp8),
                precision=config_lib.precision(resolved), out=str(Path(out)), save_every=save_every,
                device="cuda" if on_gpu else "cpu")
    if nodes is not None:
        spec["nodes"] = nodes.record()
        rendezvous.check_endpoint(nodes)     # last: a node > 0 may wait here (bounded) for node 0
    return spec, resolved


def run(stream=True, **kwargs) -> Run:
    """Launch a training run (all keyword arguments of `prepare`) and wait for it. Raises LabsError for bad
    input (nothing written), RankFailed naming the rank that failed first, KeyboardInterrupt or RunStopped when
    interrupted (every process of the run stopped). A failed run keeps nothing, unless it saved a complete
    checkpoint: then it is published marked interrupted, and the error says how to resume it."""
    spec, resolved = prepare(**kwargs)
    spec["progress"] = "bar" if sys.stdout.isatty() else "lines"
    out = Path(spec["out"])              # this node's folder (multinode.node_out)
    nodes = kwargs.get("nodes")
    cpu_offload = config_lib.offloads(resolved)["optimizer"] == "cpu"
    with runfolder.claim(out) as work:
        env, repairs = rank_environment(spec["nproc"], cpu_offload, cpu_only=spec.get("device") == "cpu")
        reuse = runcache.key(spec, resolved, env)          # only under `make test` (LABS_RUN_CACHE)
        started = time.perf_counter()
        with runcache.held(reuse):                         # until stored: the same run launched meanwhile waits
            reused = runcache.restore(reuse, work, spec)
            if not reused:
                _train(spec, resolved, env, repairs, work, out, stream, nodes, cpu_offload)
            elif stream:                                   # the earlier run's output, as if it ran now
                print((work / "launch.log").read_text(errors="replace"), end="", flush=True)
            runfolder.publish(work, out)
            runcache.store(reuse, out)                     # nothing to do for a reused run: its key is stored
        runcache.note(reuse, spec, reused, time.perf_counter() - started)
    return Run(out)


def _train(spec, resolved, env, repairs, work: Path, out: Path, stream: bool, nodes, cpu_offload: bool):
    """Write the run's records into the working folder, launch its ranks and wait; a failure raises (see run)."""
    command = launcher_command(spec["nproc"], work, nodes, cpu=spec.get("device") == "cpu")
    if nodes is not None and nodes.launcher == "deepspeed" and nodes.node_rank is None:     # ranks started over ssh
        path, dropped = remote_env.write(env, work)
        env["DS_ENV_FILE"] = str(path)
        if dropped:
            print(f"labs: not passed to the other hosts (a quote, $ or newline in the value): {', '.join(dropped)}",
                  flush=True)
    (work / "run.json").write_text(json.dumps(spec, indent=1) + "\n")
    (work / "ds_config.json").write_text(json.dumps(resolved, indent=1) + "\n")
    (work / "command.txt").write_text(shlex.join(command) + "\n")
    (work / "environment.json").write_text(json.dumps(
        {"repairs": repairs, "torch": torch.__version__, "cuda": torch.version.cuda, "host_python": sys.version,
         "DS_ACCELERATOR": env.get("DS_ACCELERATOR"), "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS"),
         "TORCH_CUDA_ARCH_LIST": env.get("TORCH_CUDA_ARCH_LIST"), "NCCL_NVLS_ENABLE": env.get("NCCL_NVLS_ENABLE"),
         "DS_PIN_MEMORY_BACKEND": env.get("DS_PIN_MEMORY_BACKEND"),       # labs.memory.from_run reads it
         "LABS_OFFLOAD_COPY": env.get("LABS_OFFLOAD_COPY"),
         "PYTORCH_CUDA_ALLOC_CONF": env.get("PYTORCH_CUDA_ALLOC_CONF"),    # e.g. expandable segments: fits more
         # the copy of updated weights chosen for a ZeRO-3 offload run (labs.offload_copy; a DeepSpeed other
         # than 0.19.8 keeps its own, and the ranks say so), None where the run makes no such copy
         "offload_copy": offload_copy.chosen(env) if offload_copy.applies(resolved, spec["stock"]) else None,
         "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}, indent=1) + "\n")
    for repair in repairs:
        print(f"labs: repaired {repair}", flush=True)
    optimizer = resolved.get("optimizer") or {}
    building = env_lib.ops_to_build(spec.get("device") == "cuda", cpu_offload,
                                    fused_adam=spec["engine"] == "deepspeed" and bool(optimizer) and
                                    not (optimizer.get("params") or {}).get("torch_adam"))
    if building:
        print(f"labs: this is the first run here that needs DeepSpeed's {', '.join(building)} op: it compiles "
              f"now (about a minute each, once; cached in {env_lib.extensions_dir()})", flush=True)
    if spec.get("resume"):
        resume_lib.prepare_work(spec, work)
    oom_before = supervisor.oom_kills()
    try:
        code = _run_launcher(command, env, work, stream, nodes)
    except (KeyboardInterrupt, RunStopped) as stop:
        if nodes:       # the other nodes' ranks may be waiting on this node's in a collective (labs.peers)
            peers.announce(nodes.host, nodes.port, f"node {nodes.node_rank}: interrupted")
        stop.kept = resume_lib.keep_interrupted(work, out, str(stop) or "interrupted (Ctrl-C)")
        raise
    if code != 0:
        if nodes:
            peers.announce(nodes.host, nodes.port, f"node {nodes.node_rank}: its launcher exited with code {code}")
            unmet = rendezvous.rendezvous_failure((work / "launch.log").read_text(errors="replace"))
            if unmet and not list(work.glob("rank*.err")):
                raise LabsError(f"{unmet}; launcher exit code {code}, nothing kept")
        first, _, trace = supervisor.failure_message(work, code, oom_before).partition("\n")
        if nodes:       # before "; its output ended:", which the log's tail follows on the next lines
            head, ended, tail = first.partition("; its output ended:")
            note = " (several nodes: a rank elsewhere may have failed first; see each node's output)"
            first = f"{head}{note}{ended}{tail}"
        kept = resume_lib.keep_interrupted(work, out, first)
        raise RankFailed(f"{first}; {kept}\n{trace}".rstrip() if kept else f"{first}\n{trace}".rstrip())
    resume_lib.finish(work)


def _run_launcher(command: list[str], env: dict, work: Path, stream: bool, nodes) -> int:
    """The launcher under labs' supervisor, which stops every process of the run however it ends; then torchrun's
    log tree in the working folder is removed (labs.multinode.TORCHRUN_LOGS: the ranks' rank*.err hold any error),
    and the environment file for other hosts (labs.remote_env)."""
    try:
        with peers.heartbeat(nodes):    # several nodes: the others' ranks stop if this node goes silent
            return supervisor.run(command, env, work / "launch.log", echo=stream,
                                  start=prefork.start if command[1:3] == prefork.LAUNCHER else None)
    finally:
        shutil.rmtree(work / multinode.TORCHRUN_LOGS, ignore_errors=True)
        (work / remote_env.FILE).unlink(missing_ok=True)           # it may hold the user's .deepspeed_env lines


def rank_environment(nproc: int, cpu_offload: bool, cpu_only: bool) -> tuple[dict, list[str]]:
    """The environment of a run's launcher and ranks (labs.env's repairs), and the repairs made."""
    env, repairs = env_lib.repaired_environment(nproc, cpu_offload)
    env["PYTHONPATH"] = env_lib.importable_path(env)
    if cpu_only:                        # CPU ranks on a GPU host: they must not see the GPUs
        env.update(env_lib.CPU_ONLY)
    return env, repairs


def warm_for_children():
    """On a host without a GPU, start this process's warm server (labs.prefork) now, for the CPU runs of the labs
    processes it starts (a test's `labs train`): they fork their launchers from it instead of importing afresh."""
    if not torch.cuda.is_available():
        prefork.warm(rank_environment(2, False, cpu_only=True)[0])


def launcher_command(nproc: int, run_dir: Path, nodes=None, cpu: bool = False) -> list[str]:
    """One host: torchrun --standalone (its own rendezvous on a port it holds open, so concurrent launches never
    collide). Several nodes: torchrun's static rendezvous, or DeepSpeed's runner with the hostfile (multinode).
    CPU ranks under torchrun are forked from a launcher that imported what they import (labs.fork_launcher)."""
    torchrun = "labs.fork_launcher" if cpu else "torch.distributed.run"
    if nodes is not None:
        if nodes.launcher == "deepspeed":
            return multinode.deepspeed_command(nodes, run_dir)
        return multinode.torchrun_command(nodes, nproc, run_dir, torchrun)
    return [sys.executable, "-m", torchrun, "--standalone", f"--nproc_per_node={nproc}",
            f"--log-dir={run_dir / multinode.TORCHRUN_LOGS}", "-m", "labs.rank", str(run_dir)]
