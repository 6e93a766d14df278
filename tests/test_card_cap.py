"""labs.card_cap: --gpu-memory as a real card would hold it (the CUDA calls faked: this machine has no GPU)."""
import pytest
import torch

from labs import card_cap
from labs.memory.units import GPUS, parse_bytes


def test_an_h100_cap_is_torchs_total_on_the_real_card_less_what_sits_outside_pytorch(monkeypatch):
    """On an H200 (torch total 139.80 GiB) a rank holding 1.5 GiB outside PyTorch and capped as an H100 may reserve
    the H100's torch total (79.18 GiB, measured) less those 1.5 GiB; nvidia-smi's 81,559 MiB would be 2 GiB more."""
    h200_total, outside, reserved = 150_110_011_392, int(1.5 * 2**30), 40 * 2**30
    free = h200_total - outside - reserved
    fractions = []
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda rank: (free, h200_total))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda rank: reserved)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, rank: fractions.append((f, rank)))
    limit = card_cap.CardCap(3, parse_bytes("H100")).apply()
    assert limit == 85_017_493_504 - outside and fractions == [(limit / h200_total, 3)]
    assert GPUS["H100"] - limit > 1.9 * 2**30                # what the plain cap allowed on top: about 2 GiB


def test_a_size_in_bytes_is_the_allocators_total_and_a_known_card_is_corrected():
    assert card_cap.card_total_for_torch(80 * 2**30) == 80 * 2**30
    assert set(card_cap.TORCH_TOTAL) <= set(GPUS.values())         # every measured card is one --gpu-memory names
    assert card_cap.card_total_for_torch(GPUS["H100"]) == pytest.approx(79.18 * 2**30, rel=1e-4)
    assert card_cap.allocator_limit_bytes(10 * 2**30, -5) == 10 * 2**30    # a negative reading counts as nothing
