"""Byte sizes as people write them (80GiB, 141GB, 24e9, 'H200') and the GPUs the course talks about."""
from __future__ import annotations

import math
import re

from labs.errors import LabsError

GiB, GB = 2 ** 30, 10 ** 9
# Memory as nvidia-smi reports it (MiB); the H200 figure was read on this project's machines.
GPUS = {"H200": 143771 * 2 ** 20, "H100": 81559 * 2 ** 20, "A100-80GB": 81920 * 2 ** 20,
        "A100-40GB": 40960 * 2 ** 20, "RTX4090": 24564 * 2 ** 20, "RTX3090": 24576 * 2 ** 20, "V100-32GB": 32768 * 2 ** 20}


_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2 ** 10, "mib": 2 ** 20,
          "gib": 2 ** 30, "tib": 2 ** 40}


def parse_bytes(value) -> int:
    """80GiB, 80 GB, 141e9, 'H200' (a GPU in GPUS) or a number of bytes."""
    if isinstance(value, (int, float)):
        return int(value)
    text = str(value).strip()
    if text in GPUS:
        return GPUS[text]
    match = re.fullmatch(r"((?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:e[0-9]+)?)\s*([a-zA-Z]*)", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise LabsError(f"memory size '{value}': write e.g. 80GiB, 141GB, 24e9 or a GPU name "
                        f"({', '.join(GPUS)})")
    nbytes = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    # '--gpu-memory 80' meant 80 GB, not 80 bytes (it read as a card with -1 GiB usable); no memory is below 1 MiB
    if nbytes < 2 ** 20:
        number = match.group(1)
        raise LabsError(f"memory size '{value}' is {nbytes} bytes, less than any memory: write e.g. {number}GiB or "
                        f"{number}GB, or a GPU name ({', '.join(GPUS)})")
    return nbytes


def flag_bytes(flag: str, value) -> int | None:
    """A memory-size flag's value (None stays None), parsed, the flag named where it is wrong."""
    if value is None:
        return None
    try:
        return parse_bytes(value)
    except LabsError as error:
        raise LabsError(f"{flag}: {error}") from None


def torch_pinned_bytes(nbytes) -> int:
    """What one buffer of `nbytes` takes when PyTorch page-locks it (`tensor.pin_memory()`, DeepSpeed's default way of
    pinning on a GPU): its pinned-memory allocator (CachingHostAllocator) rounds each request up to a power of two,
    and its cache keeps the block for the run. 11.5 GiB of fp32 master weights take 16 GiB."""
    nbytes = math.ceil(nbytes)
    return 0 if nbytes <= 0 else 1 << (nbytes - 1).bit_length()


def gpu_bytes(name: str) -> int:
    return parse_bytes(name)


def usable_bytes(gpu_memory_bytes, reserve_bytes=None) -> int:
    """What a card leaves training, less `reserve_bytes` (default 1 GiB + 5%: CUDA context, NCCL and cuBLAS
    workspaces, allocator fragmentation)."""
    gpu_memory_bytes = parse_bytes(gpu_memory_bytes)
    reserve = GiB + 0.05 * gpu_memory_bytes if reserve_bytes is None else parse_bytes(reserve_bytes)
    return int(gpu_memory_bytes - reserve)
