"""The rank side: one training loop, run by every process that `labs.launch` starts.

    python -m labs.train RUN_DIR      (RUN_DIR holds run.json and ds_config.json, written by labs.launch)

Every rank builds the model and its shard of the data, wraps them in a DeepSpeed engine (or FSDP2), and
steps. Rank 0 shows a progress bar and writes metrics.jsonl and summary.json; nothing else is printed.
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from labs import buffers, comm, data, metrics, models, probe


def main(run_dir: Path):
    spec = json.loads((run_dir / "run.json").read_text())
    ds_config = json.loads((run_dir / "ds_config.json").read_text())
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    on_gpu = torch.cuda.is_available()
    if on_gpu:
        torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank) if on_gpu else torch.device("cpu")

    models.use_kernels(spec["kernels"])
    # Chapter instruments, off by default because they cost time in the hot path (the buffer watch walks every
    # parameter after each ZeRO-3 fetch): a counter of the bytes every collective moves (installed before the
    # engine, which keeps references to the collectives) and a watch on ZeRO's working buffers.
    counter = comm.CollectiveCounter().install() if spec["instrument"] else None
    if spec["engine"] == "fsdp2":
        from labs import fsdp

        engine = fsdp.initialize(spec, ds_config, device)
    else:
        engine = _deepspeed_engine(spec, ds_config, device, on_gpu)
    watch = buffers.BufferWatch(engine) if spec["instrument"] and spec["engine"] == "deepspeed" else None

    # Model states (+ DeepSpeed's persistent buffers) before any activation exists: what labs.memory predicts
    # as the static part of the peak.
    allocated_after_init = torch.cuda.memory_allocated() if on_gpu else None
    micro_batch = ds_config["train_micro_batch_size_per_gpu"]
    accumulation = ds_config["gradient_accumulation_steps"]
    rows = data.pack(data.corpus_tokens(spec["data"]), spec["seq_len"])
    batches = data.rank_batches(rows, micro_batch, rank, world_size, spec["seed"])
    dims = spec["dims"]
    tokens_per_step = micro_batch * accumulation * world_size * spec["seq_len"]
    flops_per_step = models.flops_per_token(dims, spec["seq_len"]) * tokens_per_step
    peak = metrics.peak_flops(metrics.device_name(), spec["precision"]) if on_gpu else None

    writer = metrics.JsonlWriter(run_dir / "metrics.jsonl") if rank == 0 else None
    progress = Progress(spec["steps"], rank, spec.get("progress", "bar"))
    step_times, losses = [], []
    if counter:
        counter.drop()   # set-up traffic (initial weights broadcast or partitioned) is not part of a step
    for step in range(1, spec["steps"] + 1):
        _sync(on_gpu)
        start = time.perf_counter()
        loss_sum = torch.zeros((), device=device)
        for micro_step in range(accumulation):
            loss = engine(next(batches).to(device))
            engine.backward(loss)
            if step == spec["steps"] and micro_step == accumulation - 1:
                probe_start = time.perf_counter()   # gradients and optimizer states both live now
                state_bytes = probe.engine_state_bytes(engine)
                start += time.perf_counter() - probe_start   # the probe's own time is not training time
            engine.step()
            loss_sum += loss.detach().float()
        _sync(on_gpu)
        seconds = time.perf_counter() - start
        step_comm = counter.take() if counter else None
        peak_bytes, memory_kind = metrics.peak_memory_bytes()
        # One small all-gather per step: every rank's loss and peak memory reach rank 0.
        mine = torch.tensor([loss_sum.item() / accumulation, float(peak_bytes)], device=device, dtype=torch.float64)
        everyone = [torch.zeros_like(mine) for _ in range(world_size)]
        dist.all_gather(everyone, mine)
        if counter:
            counter.drop()   # that gather is labs' bookkeeping, not training
        if rank == 0:
            record = _step_record(step, seconds, everyone, engine, tokens_per_step, flops_per_step, world_size, peak)
            record["memory_kind"] = memory_kind
            if counter:
                record["comm"] = step_comm
            writer.write(record)
            step_times.append(seconds)
            losses.append(record["loss"])
            progress.update(record)
    progress.close()
    comm_totals = _gather_objects(counter.totals, world_size) if counter else None
    zero_buffers = _gather_objects(watch.report() if watch else None, world_size) if counter else None

    per_rank = _gather_objects(dict(state_bytes=state_bytes, allocated_after_init=allocated_after_init,
                                    peak_reserved=torch.cuda.max_memory_reserved() if on_gpu else None), world_size)
    if rank == 0:
        writer.close()
        summary = _summary(spec, ds_config, step_times, losses, run_dir, tokens_per_step, flops_per_step,
                           world_size, peak, per_rank, dims)
        summary["comm_totals"] = comm_totals   # per rank: {collective: {"calls", "bytes"}} over all steps
        summary["zero_buffers"] = zero_buffers  # per rank: labs.buffers.BufferWatch.report()
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    dist.barrier()
    dist.destroy_process_group()   # without it a rank can abort at exit ("terminate called ...")


def _deepspeed_engine(spec, ds_config, device, on_gpu):
    import deepspeed

    # DeepSpeed's schedulers warn once at start-up that no step has run yet: true, and only noise here.
    deepspeed.utils.logger.addFilter(lambda record: "before it has started" not in record.getMessage())
    deepspeed.init_distributed(dist_backend="nccl" if on_gpu else "gloo")
    hf_model = models.build(spec["preset"], ds_config, device, spec["model_path"], spec["seed"])
    if spec["stock"]:
        # The stock reference: HF's own gradient checkpointing and loss, exactly as a user would write it.
        if spec["activation_checkpointing"] != "none":
            hf_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        models.checkpoint_layers(hf_model, spec["activation_checkpointing"])
    module = models.CausalLM(hf_model, loss=spec["loss"])
    engine, *_ = deepspeed.initialize(model=module, model_parameters=list(module.parameters()), config=ds_config)
    return engine


def _step_record(step, seconds, everyone, engine, tokens_per_step, flops_per_step, world_size, peak):
    losses = [float(t[0]) for t in everyone]
    grad_norm = engine.get_global_grad_norm()
    tflops_per_gpu = flops_per_step / seconds / world_size / 1e12
    record = dict(step=step, loss=sum(losses) / len(losses), lr=engine.get_lr()[0],
                  grad_norm=None if grad_norm is None else float(grad_norm), step_time_s=seconds,
                  tokens_per_s=tokens_per_step / seconds, tokens_per_s_per_gpu=tokens_per_step / seconds / world_size,
                  tflops_per_gpu=tflops_per_gpu, mfu=tflops_per_gpu * 1e12 / peak if peak else None,
                  peak_memory_bytes=[int(t[1]) for t in everyone])
    timers = getattr(engine, "get_wall_clock_timers", lambda: {})() or {}
    if timers:
        record["timers_ms"] = {k: float(v) for k, v in timers.items() if not k.endswith("microstep")}
    return record


def _gather_objects(obj, world_size):
    gathered = [None] * world_size
    dist.all_gather_object(gathered, obj)
    return gathered


def _summary(spec, ds_config, step_times, losses, run_dir, tokens_per_step, flops_per_step, world_size, peak,
             per_rank, dims):
    records = metrics.read_jsonl(run_dir / "metrics.jsonl")
    warmup = spec["warmup_steps"]
    seconds = metrics.median_after_warmup(step_times, warmup)
    tflops = flops_per_step / seconds / world_size / 1e12
    return dict(
        preset=spec["preset"], model_path=spec["model_path"], params=models.param_counts(dims)["total"],
        engine=spec["engine"], zero_stage=ds_config.get("zero_optimization", {}).get("stage", 0),
        precision=spec["precision"], world_size=world_size, device=metrics.device_name(), steps=len(losses),
        micro_batch=ds_config["train_micro_batch_size_per_gpu"],
        gradient_accumulation=ds_config["gradient_accumulation_steps"], seq_len=spec["seq_len"],
        tokens_per_step=tokens_per_step, loss=spec["loss"], kernels=spec["kernels"], activation_checkpointing=spec["activation_checkpointing"],
        first_loss=losses[0], final_loss=sum(losses[-5:]) / len(losses[-5:]),
        median_step_time_s=seconds, tokens_per_s=tokens_per_step / seconds,
        tokens_per_s_per_gpu=tokens_per_step / seconds / world_size, tflops_per_gpu=tflops,
        mfu=tflops * 1e12 / peak if peak else None, peak_flops=peak,
        flops_per_token=flops_per_step / tokens_per_step, timing=f"median of steps {warmup + 1}-{len(losses)}",
        peak_memory_bytes=[max(r["peak_memory_bytes"][i] for r in records) for i in range(world_size)],
        memory_kind=records[-1]["memory_kind"], state_bytes=[r["state_bytes"] for r in per_rank],
        allocated_after_init_bytes=[r["allocated_after_init"] for r in per_rank],
        peak_reserved_bytes=[r["peak_reserved"] for r in per_rank],
        versions=_versions(),
    )


def _versions() -> dict:
    import importlib.metadata as md

    found = {"python": sys.version.split()[0], "torch": torch.__version__}
    for name in ("deepspeed", "transformers", "liger-kernel", "triton"):
        try:
            found[name] = md.version(name)
        except md.PackageNotFoundError:
            pass
    if torch.cuda.is_available():
        found["cuda"] = torch.version.cuda
    return found


class Progress:
    """Rank 0's progress: a tqdm bar for a terminal, or a line every tenth of the run where carriage
    returns do not render (notebooks, logs)."""

    def __init__(self, steps, rank, mode):
        from tqdm import tqdm

        self.steps, self.lines = steps, mode == "lines"
        self.bar = tqdm(total=steps, desc="train", unit="step", disable=rank != 0 or self.lines, file=sys.stderr,
                        mininterval=1, ncols=100)

    def update(self, record):
        if self.lines:
            step = record["step"]
            if step == 1 or step == self.steps or step % max(1, self.steps // 10) == 0:
                print(f"step {step:>4}/{self.steps}  loss {record['loss']:.3f}  "
                      f"{record['tokens_per_s']:,.0f} tokens/s  {record['step_time_s']:.2f} s/step", flush=True)
            return
        self.bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s']:,.0f}")
        self.bar.update()

    def close(self):
        self.bar.close()


def _sync(on_gpu):
    if on_gpu:
        torch.cuda.synchronize()


if __name__ == "__main__":
    run_dir = Path(sys.argv[1])
    try:
        main(run_dir)
    except BaseException:
        # The launcher shows the first rank that failed with its own traceback (others fail in its wake).
        (run_dir / f"rank{os.environ.get('RANK', '0')}.err").write_text(traceback.format_exc())
        raise
    # Every file is written and the process group is gone: leave without the interpreter's shutdown, where a C++
    # thread left joinable by a CPU backend (gloo, DeepSpeed's shm comm op) now and then aborts the process
    # ("terminate called without an active exception", exit -6) after all the work is done.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
