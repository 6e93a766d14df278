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
"""
from __future__ import annotations

import sys

import torch

_PATCHED = "_labs_zenflow_host"
GiB = 2 ** 30


def handed_over(zf_optimizer) -> list[torch.Tensor]:
    """The tensors start_optimizer_process shares with the optimizer process, found as it finds them: per flat fp32
    partition (ZeRO-3: each sub-group; ZeRO-1/2: each param group's one) its data and both gradient buffers. The stale
    copy DeepSpeed creates there is fresh pageable memory, so it has nothing to give back."""
    if zf_optimizer.zf_stage3:
        params = list(zf_optimizer.fp32_partitioned_groups_flat)
    else:
        params = [group["params"][0] for group in zf_optimizer.optimizer.param_groups]
    return [t for p in params for t in (p.data, p.overlap_grad[0].data, p.overlap_grad[1].data)]


def share_and_pin(tensors, register, empty_pinned_cache) -> dict:
    """Move each tensor's storage to shared memory (in place: every view follows), return the pinned-memory cache the
    moves emptied, then page-lock each shared storage with `register(address, bytes)`. Returns the bytes involved."""
    storages = {t.untyped_storage().data_ptr(): t for t in tensors}.values()     # one entry per storage
    shared = [t for t in storages if not t.is_shared()]
    was_pinned = sum(t.untyped_storage().nbytes() for t in shared if t.is_pinned())
    for tensor in shared:
        tensor.share_memory_()
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
    """Wrap start_optimizer_process where ZeRO-1/2 and ZeRO-3's ZenFlow call it (CUDA only: on a CPU nothing is
    pinned). Idempotent."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.zenflow import engine_stage3, zenflow_stage_1_and_2

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
