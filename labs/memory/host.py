"""What an offloaded optimizer holds on the host (and on NVMe), as DeepSpeed 0.19.8 allocates it: plain offload
(offloaded_optimizer, which labs.memory.peak calls), ZenFlow's overlapped step, and ZeRO-1/2 offload's per-parameter
buffers under gradient accumulation.

ZenFlow's overlapped step (ZeRO-1/2 with the optimizer offloaded to the CPU and `zenflow.overlap_step: true`, with
labs.zenflow_host installed, as labs train installs it for every ZenFlow run). Per rank, on its host:

- shared by the training process and ZenFlow's optimizer process, four fp32 copies of the rank's slice: the master
  weights, two gradient buffers (one filled while the other is read) and the stale copy the optimizer process
  writes its result to. labs.zenflow_host page-locks them where they lie (cudaHostRegister), so they take their own
  size, with no power-of-two rounding: 16 bytes per parameter of the slice.
- private to the optimizer process: Adam's two moments in fp32, 8 bytes per parameter, in two sets under DeepSpeed
  alone (each fed every other update; labs.zenflow_moments keeps one): 16 bytes per parameter. The training process
  keeps no Adam state of its own.
- pinned by the training process as plain offload pins them (labs.memory.peak): the d-byte slice DeepSpeed keeps for
  the updated weights, and the staging buffer of the largest parameter, each rounded up to a power of two under
  PyTorch's pinned allocator.
- the per-parameter gradient buffers of gradient accumulation (below): ZenFlow makes DeepSpeed's accumulation
  boundary its update boundary (`is_zenflow_update_boundary`), so between two full updates every gradient is
  accumulated on the host as under gradient accumulation, whatever `gradient_accumulation_steps` says. This holds
  with or without the overlap, whenever `update_interval` is not 1.

Checked against both recorded runs (results/gpu/zenflow_1xh200/zf_overlap20 and zf_fast20, the 3B on one H200): the
training rank's shared memory is what the four shared buffers, the pinned slice, the staging buffer and the
accumulation buffers add up to (63.39 GiB held in both, 63.37 predicted; round 14's ft_zf the same); the processes'
own memory comes on top.

ZeRO-1/2 offload with gradient accumulation (stage_1_and_2.py `async_accumulate_grad_in_cpu_via_gpu`, used while
`data_types.grad_accum_dtype` is the model's dtype, DeepSpeed's default): between micro-batches each gradient waits on
the host, in a buffer of its own per parameter in the rank's partition, whole (even where the parameter straddles
two ranks' slices), in the model's dtype, page-locked with `pin_memory: true`, so rounded up one by one. Checked on
one H200 (results/gpu/pinned_host_1xh200/acc4x2: the 3B at 4 x 2 held 8.4 GiB of shared memory more than at 8 x 1,
as predicted).
"""
from __future__ import annotations

from labs.memory.layout import zero3_gpu_sub_groups, zero12_params_per_rank
from labs.memory.units import torch_pinned_bytes


def overlaps_its_step(zenflow: dict | None) -> bool:
    """Whether a `zero_optimization.zenflow` block (None: no ZenFlow) runs its CPU step in a second process."""
    return bool((zenflow or {}).get("overlap_step"))


def zenflow_accumulates(zenflow: dict | None) -> bool:
    """Whether a `zero_optimization.zenflow` block keeps gradients on the host between updates: every
    `update_interval` but 1 ("auto" included, which starts above 1)."""
    return bool(zenflow) and zenflow.get("update_interval", "auto") != 1


def zenflow_per_rank_bytes(partition: int, d: int, staging: int, pinned_rounding: bool, moment_sets: int = 1) -> int:
    """Bytes one rank's ZenFlow overlap holds on the host: `partition` elements in the rank's slice, `d` bytes per
    weight, `staging` bytes in the largest parameter's staging buffer; `pinned_rounding` as labs.memory.estimate's
    host_pinning "torch"; `moment_sets` 1 with labs.zenflow_moments, 2 under DeepSpeed alone."""
    pinned = torch_pinned_bytes if pinned_rounding else int
    shared_fp32, moments = 4 * 4 * partition, moment_sets * 2 * 4 * partition
    return shared_fp32 + moments + pinned(d * partition) + pinned(staging)


def accumulation_per_rank_bytes(layout, world: int, d: int, pinned_rounding: bool) -> float:
    """ZeRO-1/2 offload's host buffers for gradient accumulation, per rank on average over the ranks (so that times
    the ranks of a node it is the node's), each parameter of a rank's partition whole at `d` bytes per element."""
    pinned = torch_pinned_bytes if pinned_rounding else int
    per_rank = [sum(pinned(d * n) for n in numels) for numels in zero12_params_per_rank(layout, world)]
    return sum(per_rank) / world


# DeepSpeed 0.19's default offload_optimizer.buffer_count: pinned swap buffers of one sub-group's fp32 tensors
NVME_OPTIMIZER_BUFFERS = 4


def offloaded_optimizer(layout, dims, stage, d, partition, optimizer_rank, offload_optimizer, z3, knobs, world,
                        gpu_share=0.0, pinned_rounding=False, accumulation=1, zenflow=None, zenflow_moment_sets=1):
    """Bytes per rank that an offloaded optimizer puts on the host and on NVMe, and the staging buffer it keeps on
    the GPU: (host, nvme, staging_gpu). From DeepSpeed 0.19.8's allocations:
    - CPU Adam steps the fp32 master partition and its states (optimizer_rank) with an fp32 gradient partition (4
      bytes per partitioned parameter), all pinned host memory.
    - A d-byte partition on the host too: ZeRO-1/2's `param_buffer_of_bit16_for_cpu_offload_groups` (the updated
      bf16 weights on their way back; stage_1_and_2.py), ZeRO-3's `grad_partitions_flat_buffer` (stage3.py).
    - ZeRO-1/2 stage each gradient through `temp_grad_buffer_for_cpu_offload` (host) and `..._for_gpu_offload`
      (GPU), each the size of the largest parameter (unknown, so 0, with only a parameter count).
    - NVMe at ZeRO-3 (ZeRO-Infinity) swaps the master, the states and the fp32 gradients to the drive; the host
      keeps the bf16 gradient partition, one sub-group's fp32 gradient buffer and the swap buffers (each one
      sub-group of fp32; with only a parameter count, a sub-group is sub_group_size elements).
    - ZeRO-3 partial offload: the `gpu_share` of the partition in the GPU's sub-groups keeps its master, states and fp32
      gradient on the GPU, not the host.
    - `pinned_rounding` (`pin_memory: true` on a GPU): what DeepSpeed page-locks takes a power of two per buffer.
      ZeRO-1/2: four buffers (fp32 master, fp32 gradient, d-byte partition, staging), the Adam states pageable
      (results/gpu/zenflow_1xh200/off20b: 41.0 GiB shared = 16 + 16 + 8 + 1 for the 3B on one GPU). ZeRO-3
      (stage3.py): the fp32 master and the states pageable; each host sub-group's fp32 gradient buffer pinned on its
      own, and the d-byte gradient partition (`grad_partitions_flat_buffer`) pinned whole. Checked on one H200
      (results/gpu/pinned_host_1xh200/z3_offload: the 3B's rank held 20.02 GiB of shared memory, 20.00 predicted).
    - ZeRO-1/2 with a `zenflow` block (the config's, or None) that overlaps its step: zenflow_per_rank_bytes
      instead (`zenflow_moment_sets` sets of moments); with `accumulation` > 1 or a ZenFlow block that accumulates:
      plus accumulation_per_rank_bytes (all above)."""
    if not offload_optimizer:
        return 0, 0, 0
    staging = d * max(n for _, n in layout) if dims and stage in (1, 2) else 0
    if offload_optimizer == "nvme" and stage == 3:
        sub_group = z3["largest_sub_group"] if dims else min(partition, knobs["sub_group_size"])
        host = d * partition + 4 * sub_group * (1 + NVME_OPTIMIZER_BUFFERS)
        return host, optimizer_rank + 4 * partition, 0
    if pinned_rounding and stage == 3 and offload_optimizer == "cpu":
        on_host = z3["sub_groups"][len(zero3_gpu_sub_groups(z3, knobs)):]
        pinned = sum(torch_pinned_bytes(4 * n) for n in on_host) + torch_pinned_bytes(d * partition)
        return (1 - gpu_share) * optimizer_rank + pinned, 0, 0
    accumulating = stage in (1, 2) and (accumulation > 1 or zenflow_accumulates(zenflow))
    held_between_steps = accumulation_per_rank_bytes(layout, world, d, pinned_rounding) if accumulating else 0
    if stage in (1, 2) and overlaps_its_step(zenflow):
        return (zenflow_per_rank_bytes(partition, d, staging, pinned_rounding, zenflow_moment_sets)
                + held_between_steps, 0, staging)
    if pinned_rounding and stage in (1, 2):
        states = optimizer_rank - 4 * partition
        pinned = (torch_pinned_bytes(4 * partition) * 2 + torch_pinned_bytes(d * partition)
                  + torch_pinned_bytes(staging))
        host = states + pinned
    else:
        host = (1 - gpu_share) * (optimizer_rank + 4 * partition) + d * partition + staging
    return host + held_between_steps, 0, staging
