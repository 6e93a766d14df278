"""What a run measures: step timing, throughput, FLOPs and MFU, per-rank memory, and the files that keep them
(metrics.jsonl, one line per optimizer step; summary.json at the end)."""
from __future__ import annotations

import json
import resource
import statistics
import sys
from pathlib import Path

import torch

from labs import env, models

# Dense bf16/fp16 tensor-core peaks (FLOP/s) from the vendors' datasheets, by a substring of the device name.
# MFU is only reported where the peak is known; a CPU has none here.
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "H800": 989e12, "A100": 312e12, "A800": 312e12,
              "L40S": 362e12, "RTX 4090": 165e12, "RTX 3090": 71e12}


def peak_flops(device_name: str, precision: str) -> float | None:
    if precision == "fp32":
        return None   # the tables above are tensor-core bf16/fp16 rates; an fp32 run has another ceiling
    return next((flops for key, flops in PEAK_FLOPS.items() if key in device_name), None)


def device_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    import platform

    return f"CPU ({platform.processor() or platform.machine()})"


def peak_memory_bytes() -> tuple[int, str]:
    """This process's peak memory and what was measured: the CUDA caching allocator's high-water mark of
    allocated bytes on a GPU, the process's peak resident set size (RSS) on a CPU."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated(), "cuda_max_memory_allocated"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "host_peak_rss"


def median_after_warmup(values: list[float], warmup: int) -> float | None:
    """The median over the steps after warm-up (all steps if there are too few)."""
    kept = values[warmup:] if len(values) > warmup else values
    return statistics.median(kept) if kept else None


def timing(steps: int, warmup: int) -> str:
    """Which steps median_after_warmup took its median over, in words."""
    if steps > warmup:
        return f"median of steps {warmup + 1}-{steps}"
    return f"median of steps 1-{steps} (none after the {warmup} warm-up steps)"


class Meter:
    """Turns a step's seconds, losses and memory into the numbers people compare: tokens/s, TFLOP/s, MFU."""

    def __init__(self, spec: dict, ds_config: dict, world_size: int, device: torch.device):
        self.spec, self.ds_config, self.world_size = spec, ds_config, world_size
        self.tokens_per_step = (ds_config["train_micro_batch_size_per_gpu"] * ds_config["gradient_accumulation_steps"]
                                * world_size * spec["seq_len"])
        self.flops_per_step = models.flops_per_token(spec["dims"], spec["seq_len"]) * self.tokens_per_step
        self.causal_flops_per_step = models.flops_per_token(spec["dims"], spec["seq_len"], causal=True) * \
            self.tokens_per_step
        self.peak = peak_flops(device_name(), spec["precision"]) if device.type == "cuda" else None
        self.memory_kind = peak_memory_bytes()[1]

    def step_record(self, step, seconds, losses, peaks, lr, engine, mine: dict) -> dict:
        grad_norm = engine.get_global_grad_norm()
        tflops_per_gpu = self.flops_per_step / seconds / self.world_size / 1e12
        record = dict(step=step, loss=sum(losses) / len(losses), lr=lr,
                      grad_norm=None if grad_norm is None else float(grad_norm), step_time_s=seconds,
                      tokens_per_s=self.tokens_per_step / seconds,
                      tokens_per_s_per_gpu=self.tokens_per_step / seconds / self.world_size,
                      tflops_per_gpu=tflops_per_gpu, mfu=tflops_per_gpu * 1e12 / self.peak if self.peak else None,
                      peak_memory_bytes=[int(p) for p in peaks], memory_kind=self.memory_kind, **mine)
        timers = getattr(engine, "get_wall_clock_timers", lambda: {})() or {}
        if timers:
            record["timers_ms"] = {k: float(v) for k, v in timers.items() if not k.endswith("microstep")}
        return record

    def summary(self, records: list[dict], per_rank: list[dict], instruments: list[str]) -> dict:
        spec, ds_config = self.spec, self.ds_config
        warmup = spec["warmup_steps"]
        seconds = median_after_warmup([r["step_time_s"] for r in records], warmup)
        tflops = self.flops_per_step / seconds / self.world_size / 1e12
        losses = [r["loss"] for r in records]
        summary = dict(
            preset=spec["preset"], model_path=spec["model_path"], params=models.param_counts(spec["dims"])["total"],
            engine=spec["engine"], zero_stage=ds_config.get("zero_optimization", {}).get("stage", 0),
            precision=spec["precision"], world_size=self.world_size, device=device_name(), steps=len(records),
            micro_batch=ds_config["train_micro_batch_size_per_gpu"],
            gradient_accumulation=ds_config["gradient_accumulation_steps"], seq_len=spec["seq_len"],
            tokens_per_step=self.tokens_per_step, loss=spec["loss"], kernels=spec["kernels"],
            activation_checkpointing=spec["activation_checkpointing"],
            first_loss=losses[0], final_loss=sum(losses[-5:]) / len(losses[-5:]),
            median_step_time_s=seconds, tokens_per_s=self.tokens_per_step / seconds,
            tokens_per_s_per_gpu=self.tokens_per_step / seconds / self.world_size, tflops_per_gpu=tflops,
            mfu=tflops * 1e12 / self.peak if self.peak else None, peak_flops=self.peak,
            mfu_causal=self.causal_flops_per_step / seconds / self.world_size / self.peak if self.peak else None,
            flops_per_token=self.flops_per_step / self.tokens_per_step,
            flop_convention="mfu: attention over the full matrix (12 L H S per token); mfu_causal: its causal half",
            timing=timing(len(records), warmup),
            peak_memory_bytes=[max(r["peak_memory_bytes"][i] for r in records) for i in range(self.world_size)],
            memory_kind=self.memory_kind,
            allocated_after_init_bytes=[r["allocated_after_init"] for r in per_rank],
            peak_reserved_bytes=[r["peak_reserved"] for r in per_rank], versions=env.versions())
        for name in instruments:      # one entry per rank, as each instrument reported it
            summary[name] = [r[name] for r in per_rank]
        return summary


class StepLog:
    """Rank 0's record of the run: metrics.jsonl (flushed every step, so a crash keeps every finished step) and
    the progress people watch: a tqdm bar in a terminal, or a line every tenth of the run where carriage returns
    do not render (notebooks, logs)."""

    def __init__(self, path: Path, steps: int, mode: str, start: int = 0):
        """`start`: steps a resumed run has behind it; their records are already in `path` and are kept."""
        from tqdm import tqdm

        self.records = read_jsonl(path)[:start] if start else []
        self.file, self.steps, self.lines = open(path, "a" if start else "w"), steps, mode == "lines"
        self.bar = tqdm(total=steps, initial=start, desc="train", unit="step", disable=self.lines, file=sys.stderr,
                        mininterval=1, ncols=100)

    def write(self, record: dict):
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        self.records.append(record)
        step = record["step"]
        if not self.lines:
            self.bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s_gpu=f"{record['tokens_per_s_per_gpu']:,.0f}")
            self.bar.update()
        elif step == 1 or step == self.steps or step % max(1, self.steps // 10) == 0:
            print(f"step {step:>4}/{self.steps}  loss {record['loss']:.3f}  "
                  f"{record['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU  {record['step_time_s']:.2f} s/step", flush=True)

    def close(self):
        self.bar.close()
        self.file.close()


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
