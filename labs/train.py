"""The rank side: one training loop, run by every process that `labs.launch` starts (`python -m labs.rank RUN_DIR`).

Every rank reads the run folder's inputs (run.json, ds_config.json), builds the model and its shard of the data,
wraps them in a DeepSpeed engine (or FSDP2, behind the same interface), and steps. Rank 0 shows progress and writes
metrics.jsonl and summary.json; nothing else is printed. Chapter instruments (labs.instruments) hook in from
outside through `Instrument`: the loop itself only steps and records.
"""
from __future__ import annotations

import gc
import json
import math
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from labs import (checkpoint, cpu_matmul, data, env, fsdp, metrics, models, offload_copy, peers, zenflow_columns,
                  zenflow_host, zenflow_layout, zenflow_moments)
from labs.card_cap import CardCap


class Instrument:
    """A measurement a chapter hooks into the loop. Each method is one moment of a run; an instrument overrides
    the moments it needs. `summary()` returns what this rank found: summary.json gets a list, one entry per rank.
    `run_dir` and `spec` (the run folder and its run.json) are set when the instrument is built for a run."""
    name = "instrument"
    run_dir = None
    spec = None

    def before_engine(self):                  # before any process group or engine exists
        pass

    def after_engine(self, engine):           # the engine is built, no step has run
        pass

    def step_begin(self):                     # an optimizer step is about to start
        pass

    def last_backward(self, engine):          # the run's last backward is done, its optimizer step is not:
        pass                                  # parameters, gradients and optimizer states all exist now

    def step_end(self, record: dict):         # add this rank's findings for the step to its metrics record
        pass

    def finished(self, engine):               # training is over, the engine still exists (checkpoints go here)
        pass

    def summary(self) -> dict:
        return {}


def main(run_dir: Path, instruments: list[Instrument] = ()):
    spec = json.loads((run_dir / "run.json").read_text())
    ds_config = json.loads((run_dir / "ds_config.json").read_text())
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device, cap = _device(int(os.environ["LOCAL_RANK"]), spec.get("gpu_memory_bytes"))
    for instrument in instruments:
        instrument.before_engine()
    # The imports' ~570,000 objects out of the collector's reach before DeepSpeed builds: ZeRO-3's engine calls
    # gc.collect() once on the way (runtime/zero/utils.py, defragment), a 0.40 s walk over them on the 2-core VM
    # (2026-12-07), every rank of every run; frozen first, it walks next to nothing.
    gc.freeze()
    engine = build_engine(spec, ds_config, device)
    settle_startup_objects()
    peer_watch = peers.watch(run_dir, rank)       # several nodes: stop when another node's run stops (see there)
    done = checkpoint.restore(engine, spec, run_dir)          # optimizer steps a resumed run has behind it (else 0)
    for instrument in instruments:
        instrument.after_engine(engine)
    # Model states (+ DeepSpeed's persistent buffers) before any activation exists: the static part of the peak.
    allocated_after_init = torch.cuda.memory_allocated() if device.type == "cuda" else None

    accumulation = ds_config["gradient_accumulation_steps"]
    rows = data.pack(data.corpus_tokens(spec["data"]), spec["seq_len"])
    batches = data.rank_batches(rows, ds_config["train_micro_batch_size_per_gpu"], rank, world_size, spec["seed"],
                                start=done * accumulation)
    meter = metrics.Meter(spec, ds_config, world_size, device)
    log = metrics.StepLog(run_dir / "metrics.jsonl", spec["steps"], spec.get("progress", "bar"), start=done) \
        if rank == 0 else None
    for step in range(done + 1, spec["steps"] + 1):
        for instrument in instruments:
            instrument.step_begin()
        if cap:
            cap.apply()                  # --gpu-memory: what the smaller card's context would take, as it grows
        _sync(device)
        start = time.perf_counter()
        lr = engine.get_lr()[0]          # the rate this step's update uses (the scheduler moves on after it)
        loss = torch.zeros((), device=device)
        for micro_step in range(accumulation):
            micro_loss = engine(next(batches).to(device))
            engine.backward(micro_loss)
            if step == spec["steps"] and micro_step == accumulation - 1:
                start += _timed(lambda: [i.last_backward(engine) for i in instruments])  # not training time
            engine.step()
            loss += micro_loss.detach().float() / accumulation
        _sync(device)
        seconds = time.perf_counter() - start
        mine = {}
        for instrument in instruments:
            instrument.step_end(mine)
        # One small all-gather per step: every rank's loss and peak memory reach rank 0.
        losses, peaks = _gather_floats([loss.item(), float(metrics.peak_memory_bytes()[0])], device, world_size)
        if log:
            log.write(meter.step_record(step, seconds, losses, peaks, lr, engine, mine))
        check_finite(step, losses)      # every rank holds every loss: all of them stop at the same step
        checkpoint.save_if_due(engine, step, spec, run_dir)
    peer_watch.finished()
    for instrument in instruments:
        instrument.finished(engine)
    per_rank = _gather_objects(dict(allocated_after_init=allocated_after_init,
                                    peak_reserved=torch.cuda.max_memory_reserved() if device.type == "cuda" else None,
                                    **{i.name: i.summary() for i in instruments}), world_size)
    if log:
        log.close()
        summary = meter.summary(log.records, per_rank, [i.name for i in instruments])
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    dist.barrier()
    dist.destroy_process_group()   # without it a rank can abort at exit ("terminate called ...")


def settle_startup_objects():
    """Put every object start-up made (the modules of torch, DeepSpeed and transformers, the model, the engine) out of
    the garbage collector's reach, then let it collect. labs.rank turns the collector off before its first import:
    start-up makes ~700,000 objects and almost no garbage, so each pass over them is wasted work, and without the
    freeze every later full collection (steps make Python objects too) would walk them all again. A 1-rank, 8-step
    tiny run used 9.1-9.2 s of CPU with the collector on throughout, 5.2-6.4 s this way (2-core VM, 2026-12-05).
    Harmless where the collector was never off (a test calling main in-process)."""
    gc.freeze()
    gc.enable()


class NonFiniteLoss(RuntimeError):
    """A step's loss is NaN or infinite: the weights are broken, and no later step (or timing) means anything."""


def check_finite(step: int, losses: list[float]):
    bad = [(rank, loss) for rank, loss in enumerate(losses) if not math.isfinite(loss)]
    if bad:
        rank, loss = bad[0]
        raise NonFiniteLoss(f"step {step}: the loss is {loss} on rank {rank}: training diverged, the run is invalid")


def build_engine(spec: dict, ds_config: dict, device: torch.device):
    """A DeepSpeed engine, or FSDP2 behind the same interface (engine(ids) -> loss, .backward, .step)."""
    cpu_matmul.enter_if_needed(device)      # bf16 products at fp32 speed on a CPU without bf16 arithmetic (see there)
    env.serve_cpu_info_from_cache()          # DeepSpeed's CPU Adam asks py-cpuinfo three times, ~1 s each (see there)
    models.use_kernels(spec["kernels"])
    models.use_attention(spec.get("sdpa", "default"))
    if spec["engine"] == "fsdp2":
        return fsdp.initialize(spec, ds_config, device)
    import deepspeed

    # DeepSpeed's schedulers warn once at start-up that no step has run yet: true, and only noise here.
    deepspeed.utils.logger.addFilter(lambda record: "before it has started" not in record.getMessage())
    env.skip_shm_comm_op()    # a compile that training never uses (see there)
    env.skip_muon_import(ds_config)    # torch.compile set-up for an optimizer this run does not use (see there)
    if ds_config.get("zero_optimization", {}).get("zenflow"):
        zenflow_layout.install()     # DeepSpeed 0.19.8 scrambles ZenFlow's weights without it (see there)
        zenflow_host.install()       # strands pinned host memory, and copies its update back slowly (see there)
        zenflow_columns.install()    # updates its GPU columns in bf16, where a fine-tuning step rounds away (see there)
        zenflow_moments.install()    # feeds its CPU Adam's two sets of moments every other update (see there)
    if offload_copy.applies(ds_config, spec["stock"]):
        offload_copy.install()       # updated weights cast on the GPU from page-locked masters (see there)
    deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo")
    zero3 = ds_config.get("zero_optimization", {}).get("stage", 0) == 3
    hf_model = models.build(spec["preset"], dtype=models.DTYPES[spec["precision"]], device=device, seed=spec["seed"],
                            model_path=spec["model_path"], zero3_config=ds_config if zero3 else None)
    if spec["stock"]:
        # The stock reference: HF's own gradient checkpointing and loss, exactly as a user would write it.
        if spec["activation_checkpointing"] != "none":
            models.hf_checkpointing(hf_model)
    else:
        models.checkpoint_layers(hf_model, spec["activation_checkpointing"])
    if spec.get("compile"):
        models.compile_layers(hf_model)
    module = models.CausalLM(hf_model, loss=spec["loss"])
    engine, *_ = deepspeed.initialize(model=module, model_parameters=list(module.parameters()), config=ds_config)
    return engine


def _device(local_rank: int, memory_cap_bytes: int | None = None) -> tuple[torch.device, CardCap | None]:
    """This rank's device, and with --gpu-memory the cap that makes it behave like a smaller card (labs.card_cap)."""
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        cap = CardCap(local_rank, memory_cap_bytes) if memory_cap_bytes else None
        if cap:
            cap.apply()
        return torch.device("cuda", local_rank), cap
    return torch.device("cpu"), None


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _gather_floats(values: list[float], device, world_size) -> list[list[float]]:
    """Each value from every rank: [[value 0 of rank 0, rank 1, ...], [value 1 of ...], ...]."""
    mine = torch.tensor(values, device=device, dtype=torch.float64)
    everyone = [torch.zeros_like(mine) for _ in range(world_size)]
    dist.all_gather(everyone, mine)
    return [[float(t[i]) for t in everyone] for i in range(len(values))]


def _gather_objects(obj, world_size):
    gathered = [None] * world_size
    dist.all_gather_object(gathered, obj)
    return gathered


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()
