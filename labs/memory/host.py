"""Host memory that labs.memory.peak's offload accounting leaves out, as DeepSpeed 0.19.8 allocates it: ZenFlow's
overlapped step, and ZeRO-1/2 offload's per-parameter buffers under gradient accumulation.

ZenFlow's overlapped step (ZeRO-1/2 with the optimizer offloaded to the CPU and `zenflow.overlap_step: true`, with
labs.zenflow_host installed, as labs train installs it for every ZenFlow run). Per rank, on its host:

- shared by the training process and ZenFlow's optimizer process, four fp32 copies of the rank's slice: the master
  weights, two gradient buffers (one filled while the other is read) and the stale copy the optimizer process
  writes its result to. labs.zenflow_host page-locks them where they lie (cudaHostRegister), so they take their own
  size, with no power-of-two rounding: 16 bytes per parameter of the slice.
- private to the optimizer process: Adam's two moments in fp32, in two sets (one updated while the other is read):
  16 bytes per parameter. The training process keeps no Adam state of its own.
- pinned by the training process as plain offload pins them (labs.memory.peak): the d-byte slice DeepSpeed keeps for
  the updated weights, and the staging buffer of the largest parameter, each rounded up to a power of two under
  PyTorch's pinned allocator.

Checked against both recorded runs (results/gpu/zenflow_1xh200/zf_overlap20 and zf_fast20, the 3B on one H200): the
model is below what the processes held, by the training rank's shared memory that nothing above accounts for
(8.4 GiB in both) and the processes' own memory.

ZeRO-1/2 offload with gradient accumulation (stage_1_and_2.py `async_accumulate_grad_in_cpu_via_gpu`, used while
`data_types.grad_accum_dtype` is the model's dtype, DeepSpeed's default): between micro-batches each gradient waits on
the host, in a buffer of its own per parameter in the rank's partition, whole (even where the parameter straddles
two ranks' slices), in the model's dtype, page-locked with `pin_memory: true`, so rounded up one by one. Checked on
one H200 (results/gpu/pinned_host_1xh200/acc4x2: the 3B at 4 x 2 held 8.4 GiB of shared memory more than at 8 x 1,
as predicted).
"""
from __future__ import annotations

from labs.memory.layout import zero12_params_per_rank
from labs.memory.units import torch_pinned_bytes


def overlaps_its_step(zero: dict) -> bool:
    """Whether a zero_optimization block runs ZenFlow with its CPU step in a second process."""
    return bool((zero.get("zenflow") or {}).get("overlap_step"))


def zenflow_per_rank_bytes(partition: int, d: int, staging: int, pinned_rounding: bool) -> int:
    """Bytes one rank's ZenFlow overlap holds on the host: `partition` elements in the rank's slice, `d` bytes per
    weight, `staging` bytes in the largest parameter's staging buffer; `pinned_rounding` as labs.memory.estimate's
    host_pinning "torch"."""
    pinned = torch_pinned_bytes if pinned_rounding else int
    shared_fp32, moments = 4 * 4 * partition, 2 * 2 * 4 * partition
    return shared_fp32 + moments + pinned(d * partition) + pinned(staging)


def accumulation_per_rank_bytes(layout, world: int, d: int, pinned_rounding: bool) -> float:
    """ZeRO-1/2 offload's host buffers for gradient accumulation, per rank on average over the ranks (so that times
    the ranks of a node it is the node's), each parameter of a rank's partition whole at `d` bytes per element."""
    pinned = torch_pinned_bytes if pinned_rounding else int
    per_rank = [sum(pinned(d * n) for n in numels) for numels in zero12_params_per_rank(layout, world)]
    return sum(per_rank) / world
