"""`--gpu-memory`: a larger GPU behaving like a smaller card (an H200 like an 80 GB H100), for the caching allocator.

`torch.cuda.set_per_process_memory_fraction` limits what PyTorch's caching allocator may reserve. It does not see
the rest of the process's GPU memory: the CUDA context, cuBLAS and NCCL's own buffers, the kernels loaded. On a real
card those come out of the same total; on a larger card capped to the smaller one's size they sit outside the cap,
so a plain cap at the card's size is generous by exactly them. And the card's size as nvidia-smi reports it is not
what PyTorch can have: the driver keeps a share, and torch's `total_memory` is less.

Measured on a real H100 80GB HBM3 (round 21, results/gpu/2026-12-05_y3_sweep_3b_1xh100.json): nvidia-smi 81,559 MiB,
torch 79.18 GiB, and a stock ZeRO-2 rank held 1.67 GiB outside PyTorch when it ran out of memory. The same case had fit
under a plain 81,559 MiB cap on an H200 (run y2, 79.61 GiB reserved), so a cap is faithful only if it counts both.

    cap = CardCap(local_rank, card_bytes)     # card_bytes: labs.memory.parse_bytes("H100"), or any size
    cap.apply()                               # before the engine is built, then before every optimizer step
"""
from __future__ import annotations

import torch

# Per card measured: its total as nvidia-smi reports it (labs.memory.units.GPUS, which `--gpu-memory H100` gives) ->
# torch.cuda.get_device_properties(0).total_memory on the real card. (labs.train sits below labs.memory, so the
# sizes are written here; tests/test_card_cap.py checks them against GPUS.)
TORCH_TOTAL = {81_559 * 2**20: 85_017_493_504}          # H100 80GB HBM3, round 21


def card_total_for_torch(card_bytes: int) -> int:
    """What PyTorch would see as the total of a card given by its nvidia-smi size, where measured; any other size is
    taken as PyTorch's total."""
    return TORCH_TOTAL.get(card_bytes, card_bytes)


def allocator_limit_bytes(card_bytes: int, outside_pytorch_bytes: int) -> int:
    """What PyTorch's caching allocator could reserve on the card: its total as torch sees it, less what the process
    holds outside PyTorch (which the real card would hold too)."""
    return card_total_for_torch(card_bytes) - max(0, outside_pytorch_bytes)


class CardCap:
    """The cap of one rank on its GPU, kept as the memory outside PyTorch grows (the context is created lazily, cuBLAS
    on the first matmul, NCCL's buffers on the first collective). It reads that memory as the GPU's used memory less
    PyTorch's reserved: one rank per GPU, as labs launches them."""

    def __init__(self, local_rank: int, card_bytes: int):
        self.rank, self.card_bytes = local_rank, int(card_bytes)

    def apply(self) -> int:
        free, total = torch.cuda.mem_get_info(self.rank)
        outside = total - free - torch.cuda.memory_reserved(self.rank)
        limit = allocator_limit_bytes(self.card_bytes, outside)
        torch.cuda.set_per_process_memory_fraction(max(0.0, min(1.0, limit / total)), self.rank)
        return limit
