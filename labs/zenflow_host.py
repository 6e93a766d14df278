"""A fix for DeepSpeed 0.19.8's ZenFlow with `overlap_step: true`: host memory it strands before its optimizer
process starts.

The overlapped step runs CPU Adam in a second process (runtime/zenflow/zenflow_utils.py: `start_optimizer_process`).
To hand it the fp32 master partition, its two gradient buffers and a stale copy, DeepSpeed calls `share_memory_()` on
each. For a tensor that is already page-locked (ZeRO offload with `pin_memory: true` pins the master and the first
gradient buffer) that copies the bytes into a new shared-memory block and points the storage at it. The pinned block
goes back to PyTorch's pinned-memory cache, which keeps it, rounded up to a power of two, for the rest of the run, and
the shared copy is no longer page-locked, so the gradients' copies from the GPU stop being asynchronous. Only then does
the optimizer process allocate its own Adam state (16 bytes per parameter: two sets of moments). On Qwen2.5-3B on a
126 GiB host the kernel's OOM killer ended the run there (results/gpu/zenflow_1xh200/zf_mem).

The fix moves the same tensors to shared memory first, gives the pinned cache back to the system, and page-locks the
shared blocks in place (cudaHostRegister, DeepSpeed's `register_host_memory`); DeepSpeed's own `share_memory_()`
calls are then no-ops. The values, the views into them and what the optimizer process receives are unchanged.
With it the same run finished on the same kind of host, 5.1 GiB of host memory left at its tightest second
(results/gpu/zenflow_1xh200/zf_overlap20, round 10).

A second fix, for the step that waits: every `update_interval` steps the training process copies the fp32 partition
the optimizer process updated (its "stale" copy) into the GPU's bf16 parameters with `bf16.copy_(fp32)`, a blocking
copy. Across devices and dtypes a blocking copy casts on the CPU first (PyTorch's copy_kernel_cuda: to spare the GPU a
temporary), into a new pageable block that then crosses PCIe: 1.7-2.1 s per update on the 3B shape
(`optimizer_transmit_time` in round 10's log), while the wait for CPU Adam, the work the overlap hides, took 0.05 ms.
(DeepSpeed's plain offload path avoids this: it casts into a pinned bf16 buffer and copies that asynchronously.)
labs creates the stale copy itself, shared and page-locked with the rest, and replaces that one copy with
`copy_in_chunks`: fp32 chunks go by DMA from page-locked memory into a GPU staging block and the GPU casts them,
without a full-size fp32 temporary on the GPU. Same values (the cast rounds the same way on either side).

The same method waits for the wrong update. After warm-up rounds (`full_warm_up_rounds`, whose updates are waited
for at once) DeepSpeed skips the first wait, since nothing is in flight then. With no warm-up rounds (labs' config,
and DeepSpeed's default of 0) the optimizer process starts at the first update and that wait returns early, so the
skip lands on the second round, when update 1 is in flight: update 1's completion is never awaited there, and every
later wait consumes the completion of the update before the last one (the completions are counted by a semaphore).
A copy then brings whatever the process has finished, with nothing to stop it reading the partition while the last
update is still writing it, or the GPU refilling a gradient buffer the process still reads, whenever the CPU step
takes longer than a round. labs skips only after a wait has happened, so each round waits for the update submitted
the round before: the first update lands at step 8 at interval 4, not at step 12 with the second.

A third, for the step that chooses the GPU's top-k columns again (`select_strategy` "step"): DeepSpeed first refreshes
the fp32 master partition from the GPU's bf16 weights with `fp32.copy_(bf16.to(fp32, cpu))`, whose `.to` builds a whole
new fp32 partition in pageable host memory while the optimizer process holds its moments: the training rank grew by
4.0 bytes per parameter at each choice, 11.5 GiB on the 3B shape, and the host ran out, so the kernel ended the
optimizer process (round 17's control; round 16's failures, results/gpu/zenflow_finetune_1xh200). labs replaces that
copy with `copy_to_host_in_chunks`: the GPU casts each chunk into a staging block, which crosses PCIe into the
page-locked partition. Same values: a bf16 value is exact in fp32, wherever it is cast.
"""
from __future__ import annotations

import sys

import torch

from labs.offload_copy import copy_in_chunks, copy_to_host_in_chunks, source_sha256

_PATCHED = "_labs_zenflow_host"
_WAITS = "_labs_zenflow_waits"       # how many updates wait_last_update_and_copy has waited for
GiB = 2 ** 30


def handed_over(zf_optimizer) -> list[torch.Tensor]:
    """The tensors start_optimizer_process shares with the optimizer process, found as it finds them: per flat fp32
    partition (ZeRO-3: each sub-group; ZeRO-1/2: each param group's one) its data, both gradient buffers and the stale
    copy the optimizer process writes its result to. DeepSpeed creates that one there, pageable, unless it exists:
    it is created here as DeepSpeed would, so that it is page-locked too and can cross to the GPU asynchronously."""
    if zf_optimizer.zf_stage3:
        params = list(zf_optimizer.fp32_partitioned_groups_flat)
    else:
        params = [group["params"][0] for group in zf_optimizer.optimizer.param_groups]
    for p in params:
        if not hasattr(p, "stale_param"):
            p.stale_param = torch.zeros_like(p.data, dtype=p.dtype, device=p.device)
    return [t for p in params for t in (p.data, p.overlap_grad[0].data, p.overlap_grad[1].data, p.stale_param.data)]


# DeepSpeed 0.19.8's ZenFlowZeroOptimizer.sync_fp32_param_from_gpu (same file, Apache-2.0) hashes to this.
SYNC_RESTATED_SHA256 = "f92b8907be6474b9"


def sync_fp32_param_from_gpu(self):
    """ZeRO-1/2 ZenFlow's refresh of the fp32 master partition from the GPU's bf16 weights, at a step that chooses the
    top-k columns again, as DeepSpeed 0.19.8 writes it except the line marked."""
    from deepspeed import comm as dist

    if self.micro_step == 0:
        return
    for i in range(len(self.bit16_groups)):
        partition_id = dist.get_rank(group=self.real_dp_process_group[i])
        with torch.no_grad():
            copy_to_host_in_chunks(self.single_partition_of_fp32_groups[i],            # the change
                                   self.parallel_partitioned_bit16_groups[i][partition_id])


# DeepSpeed 0.19.8's ZenFlowZeroOptimizerParallel.wait_last_update_and_copy (runtime/zenflow/zenflow_stage_1_and_2.py,
# Apache-2.0), whose source hashes to this: wait_last_update_and_copy below restates it with two changes.
RESTATED_SHA256 = "b3e57727b3da6173"


def wait_last_update_and_copy(self):
    """ZeRO-1/2 ZenFlow's end of an update round, as DeepSpeed 0.19.8 writes it (without its see_memory_usage calls,
    which print nothing unless forced), except the two lines marked: wait for the optimizer process, bring its updated
    fp32 partition into the GPU's bf16 parameters, all-gather them across ranks, point the model at them."""
    from deepspeed import comm as dist
    from deepspeed.runtime.zenflow import zenflow_stage_1_and_2 as ds

    if not getattr(self, "process_optimizer_established", False):
        return
    if self.micro_step + 1 > self.full_warm_up_rounds and self.first_update_round_after_warmup:
        self.first_update_round_after_warmup = False
        if getattr(self, _WAITS, 0):          # the change: skip only where a warm-up update was waited for
            return
    self.timers(ds.OPTIMIZER_RECV_PARAMS_TIMER).start()
    self._wait_for_optimizer_process()
    setattr(self, _WAITS, getattr(self, _WAITS, 0) + 1)
    self.timers(ds.OPTIMIZER_RECV_PARAMS_TIMER).stop()
    for i in range(len(self.bit16_groups)):
        partition_id = dist.get_rank(group=self.real_dp_process_group[i])
        fp32_partition = self.optimizer.param_groups[i]["params"][0].stale_param.data
        self.timers(ds.OPTIMIZER_TRANSMIT_TIMER).start()
        copy_in_chunks(self.parallel_partitioned_bit16_groups[i][partition_id].data, fp32_partition)   # the change
        self.timers(ds.OPTIMIZER_TRANSMIT_TIMER).stop()
    if self.cpu_offload:
        self.reset_cpu_buffers()
    self.timers(ds.OPTIMIZER_ALLGATHER_TIMER).start()
    ds.all_gather_dp_groups(groups_flat=self.bit16_groups_flat,
                            partitioned_param_groups=self.parallel_partitioned_bit16_groups,
                            dp_process_group=self.real_dp_process_group,
                            start_alignment_factor=self.nccl_start_alignment_factor,
                            allgather_bucket_size=self.allgather_bucket_size)
    self.timers(ds.OPTIMIZER_ALLGATHER_TIMER).stop()
    self.timers(ds.OPTIMIZER_UPDATE_MODEL_TIMER).start()
    for i in range(len(self.bit16_groups)):
        self._update_model_bit16_weights(i)
    self.timers(ds.OPTIMIZER_UPDATE_MODEL_TIMER).stop()
    self.timers.log(ds.OPTIMIZER_TIMERS)


def share_and_pin(tensors, register, empty_pinned_cache) -> dict:
    """Move each tensor's storage to shared memory (in place: every view follows), giving the pinned-memory cache back
    after each page-locked one, then page-lock each shared storage with `register(address, bytes)`. Returns the bytes
    involved. One at a time, because a moved block waits in the cache until it is emptied: emptied once at the end,
    as labs first did, the host held every pinned original beside its shared copy (round 19 on the 3B: 95.4 GiB of
    the training rank's shared memory at start-up, 32 GiB above training, the host's tightest second of the run)."""
    storages = {t.untyped_storage().data_ptr(): t for t in tensors}.values()     # one entry per storage
    shared = sorted((t for t in storages if not t.is_shared()), key=lambda t: not t.is_pinned())   # pinned first
    was_pinned = sum(t.untyped_storage().nbytes() for t in shared if t.is_pinned())
    for tensor in shared:
        pinned = tensor.is_pinned()
        tensor.share_memory_()
        if pinned:
            empty_pinned_cache()
    for tensor in shared:
        storage = tensor.untyped_storage()
        register(storage.data_ptr(), storage.nbytes())
    return dict(shared_bytes=sum(t.untyped_storage().nbytes() for t in shared), was_pinned_bytes=was_pinned)


def _empty_pinned_cache():
    for name in ("empty_host_cache",):       # torch >= 2.12
        if hasattr(torch.accelerator, name):
            return getattr(torch.accelerator, name)()
    for name in ("_host_emptyCache", "_accelerator_emptyHostCache"):
        if hasattr(torch._C, name):
            return getattr(torch._C, name)()
    raise RuntimeError("labs.zenflow_host: this torch has no way to empty its pinned-memory cache")


def install() -> None:
    """Give ZeRO-1/2's ZenFlow labs' wait_last_update_and_copy and sync_fp32_param_from_gpu (on any device: on a
    CPU their copies are plain chunked copies, which the CPU tests run), and on CUDA wrap start_optimizer_process where
    ZeRO-1/2 and ZeRO-3's ZenFlow call it (on a CPU nothing is pinned). Idempotent."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.zenflow import engine_stage3, zenflow_stage_1_and_2

    for cls, name, ours, sha, what in (
            (zenflow_stage_1_and_2.ZenFlowZeroOptimizerParallel, "wait_last_update_and_copy",
             wait_last_update_and_copy, RESTATED_SHA256, "copy-back"),
            (zenflow_stage_1_and_2.ZenFlowZeroOptimizer, "sync_fp32_param_from_gpu",
             sync_fp32_param_from_gpu, SYNC_RESTATED_SHA256, "refresh of the master weights")):
        if getattr(cls, name) is ours:
            continue
        if source_sha256(getattr(cls, name)) == sha:
            setattr(cls, name, ours)
        else:       # another DeepSpeed: its own method stays
            print(f"labs: this DeepSpeed's ZenFlow {what} is not the one labs.zenflow_host restates (0.19.8's): "
                  "left as it is", file=sys.stderr, flush=True)

    original = zenflow_stage_1_and_2.start_optimizer_process
    if getattr(original, _PATCHED, False) or get_accelerator().device_name() != "cuda":
        return

    def start_optimizer_process(zf_optimizer):
        moved = share_and_pin(handed_over(zf_optimizer), get_accelerator().register_host_memory, _empty_pinned_cache)
        print(f"labs: ZenFlow's optimizer process: {moved['shared_bytes'] / GiB:.1f} GiB moved to shared memory and "
              f"page-locked in place; the pinned-memory cache they left ({moved['was_pinned_bytes'] / GiB:.1f} GiB "
              "before rounding) given back (labs.zenflow_host)", file=sys.stderr, flush=True)
        return original(zf_optimizer)

    setattr(start_optimizer_process, _PATCHED, True)
    zenflow_stage_1_and_2.start_optimizer_process = start_optimizer_process
    engine_stage3.start_optimizer_process = start_optimizer_process
