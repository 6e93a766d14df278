"""What a run measures: step timing, throughput, FLOPs and MFU, per-rank memory, and the JSONL log."""
from __future__ import annotations

import json
import resource
import statistics
from pathlib import Path

import torch

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


class JsonlWriter:
    """Append one JSON object per line, flushed at once so a crash leaves every finished step on disk."""

    def __init__(self, path: Path):
        self.file = open(path, "w")

    def write(self, record: dict):
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def close(self):
        self.file.close()


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
