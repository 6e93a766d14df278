"""The offloaded optimizer's copies between host and GPU, cast on the GPU, and the ZeRO-3 step that uses them (labs'
default for ZeRO-3 with the optimizer offloaded; LABS_OFFLOAD_COPY=deepspeed keeps DeepSpeed's copy).

After CPU Adam has updated a sub-group's fp32 master weights in host memory, DeepSpeed 0.19.8's ZeRO-3
(`_reassign_or_swap_out_partitioned_parameters` in runtime/zero/stage3.py) writes them into the GPU's bf16 partition
with `bf16.copy_(fp32)`. Across devices and dtypes PyTorch casts on the CPU first (copy_kernel_cuda), then the bf16
block crosses PCIe. Timed alone on an H100 host over 10^9 parameters (results/gpu/one_card_7b_1xh100/round29 and
round31, tools/offload_step_parts.py), from page-locked fp32: 0.35-0.375 s, against 0.073 s for the same fp32 bytes
copied without the cast and 0.16-0.18 s for CPU Adam's own step.

But ZeRO-3 keeps those master weights in pageable memory (stage3.py `_create_fp32_partitions`: `pin_memory` pins the
gradient buffers only), and from pageable memory the fp32 bytes cross no faster than the cast ones (0.39 s per 10^9,
round 31). So labs page-locks each offloaded master in place at its first copy (cudaHostRegister: no new memory, 0.15
s per 10^9 parameters, once) and then copies it through `copy_in_chunks`: fp32 chunks by DMA into one GPU staging
block (256 MiB), cast by the GPU into the partition (0.072 s per 10^9). Same values: the cast rounds the same way on
either side. On the 7B row of chapter 10 (70% of the optimizer offloaded, one H100) DeepSpeed's optimizer step fell
from 3.2-3.4 s to 1.6-1.9 s and the run went from 4,800-4,931 tokens/s to 6,175-6,436 on two hosts (rounds 31 and 32).
Without the page-locking it gained nothing (round 30: 0.97x).

Nor does the step wait for each sub-group's copy any more (round 37): DeepSpeed updates the sub-groups one after
another, and a copy only reads a master that CPU Adam has finished with, so the copy of one sub-group runs on the GPU's
stream while CPU Adam updates the next, and the step waits once, after its last sub-group. On the one-card 7B at 62.2%
offloaded that ran 1.05x and 1.08x the same row waiting after each sub-group, on two hosts (rounds 37 and 38), with
the same losses. LABS_OFFLOAD_COPY=gpu-wait keeps the wait after every sub-group (rounds 31-36), to compare.

The two chunked copies also serve labs.zenflow_host, whose ZenFlow copy-back had the same blocking cast and whose
buffers labs page-locks itself.
"""
from __future__ import annotations

import hashlib
import inspect
import os
import sys

import torch

from labs.errors import check_choice

# DeepSpeed 0.19.8's DeepSpeedZeroOptimizer_Stage3._reassign_or_swap_out_partitioned_parameters, inside its nvtx
# wrapper, hashes to this.
RESTATED_SHA256 = "af7b449bee8786ec"
CHOICE = "LABS_OFFLOAD_COPY"        # which copy a ZeRO-3 offload run of labs makes
CHOICES = ("gpu", "gpu-wait", "deepspeed")   # labs' (the default), labs' waiting after each sub-group, DeepSpeed's
_REGISTERED: set[int] = set()       # addresses of the masters labs has page-locked in place (they live the whole run)
_UNREGISTRABLE: set[int] = set()    # addresses CUDA refused to page-lock: those keep DeepSpeed's copy_
_WAIT_EACH = False                  # install() sets it under LABS_OFFLOAD_COPY=gpu-wait


def chosen(environ=None) -> str:
    """The copy LABS_OFFLOAD_COPY names ("gpu" where unset); any other value is bad input (LabsError)."""
    return check_choice(CHOICE, (os.environ if environ is None else environ).get(CHOICE) or "gpu", CHOICES)


def applies(ds_config: dict, stock: bool) -> bool:
    """Whether a run makes this copy at all: labs' (not the stock reference) ZeRO-3 with the optimizer on the CPU."""
    zero = ds_config.get("zero_optimization") or {}
    return not stock and zero.get("stage") == 3 and (zero.get("offload_optimizer") or {}).get("device") == "cpu"


def source_sha256(function) -> str | None:
    """The first 16 hex digits of the SHA-256 of a function's source: what a restated method's hash is compared with
    (None where the source cannot be read, e.g. an install without .py files: then nothing is replaced)."""
    try:
        return hashlib.sha256(inspect.getsource(unwrapped(function)).encode()).hexdigest()[:16]
    except (OSError, TypeError):
        return None


def unwrapped(function):
    """The function inside DeepSpeed's `instrument_w_nvtx`, which wraps without functools.wraps: the wrapper's own
    source is the same for every method it wraps, so its hash would vouch for any of them."""
    code = getattr(function, "__code__", None)
    while code is not None and code.co_name == "wrapped_fn" and "func" in code.co_freevars and function.__closure__:
        function = function.__closure__[code.co_freevars.index("func")].cell_contents
        code = getattr(function, "__code__", None)
    return function


def copy_in_chunks(dst: torch.Tensor, src: torch.Tensor, chunk_elements: int = 64 * 2**20, wait: bool = True) -> None:
    """dst.copy_(src) for a page-locked fp32 host tensor into a bf16 GPU tensor, cast on the GPU: chunk by chunk the
    fp32 values cross PCIe asynchronously into one staging block (256 MiB at the default) and the GPU casts them into
    dst. Both run on the current stream, so a chunk lands only after the previous one's cast has read the block. Then
    it waits, so that the caller may write src again as soon as it returns; with wait=False it returns at once, and
    the caller must synchronize the stream before writing src (work queued on the stream after it sees dst written)."""
    assert src.device.type == "cpu" and src.is_contiguous() and dst.is_contiguous(), (src.device, dst.device)
    assert src.numel() == dst.numel(), f"{src.numel()} fp32 values for {dst.numel()} parameters"
    _through_staging(dst, src, gpu=dst.device, chunk_elements=chunk_elements, wait=wait)


def copy_to_host_in_chunks(dst: torch.Tensor, src: torch.Tensor, chunk_elements: int = 64 * 2**20) -> None:
    """dst.copy_(src) for a bf16 tensor on the GPU into an fp32 host tensor, with no full-size temporary anywhere: chunk
    by chunk the GPU casts into one staging block (256 MiB at the default) whose copy to dst, asynchronous where dst is
    page-locked, is queued on the same stream, so the next chunk's cast waits for it. Then it waits for the last."""
    assert dst.device.type == "cpu" and src.is_contiguous() and dst.is_contiguous(), (src.device, dst.device)
    assert src.numel() == dst.numel(), f"{src.numel()} parameters for {dst.numel()} fp32 values"
    _through_staging(dst, src, gpu=src.device, chunk_elements=chunk_elements)


def _through_staging(dst: torch.Tensor, src: torch.Tensor, gpu: torch.device, chunk_elements: int,
                     wait: bool = True) -> None:
    """The loop both chunked copies share: one fp32 staging block on `gpu`, each chunk copied from src into it and from
    it into dst, both on the current stream (so the next chunk waits until the block has been read), the copy that
    crosses PCIe asynchronous; then wait for the last chunk (unless wait=False). The block goes back to PyTorch's
    allocator on return, which hands it out again only to work queued after it on the same stream. On a CPU the same
    loop runs as plain copies."""
    flat_src, flat_dst = src.view(-1), dst.view(-1)
    staging = torch.empty(min(chunk_elements, src.numel()), dtype=torch.float32, device=gpu)
    for start in range(0, src.numel(), staging.numel()):
        n = min(staging.numel(), src.numel() - start)
        staging[:n].copy_(flat_src[start:start + n], non_blocking=True)
        flat_dst[start:start + n].copy_(staging[:n], non_blocking=True)
    if gpu.type == "cuda" and wait:
        torch.cuda.current_stream(gpu).synchronize()


def copy_updated_weights(dst: torch.Tensor, src: torch.Tensor, register=None, wait: bool = True) -> None:
    """dst.copy_(src), through copy_in_chunks where src is fp32 master weights in host memory and dst a partition of
    another dtype: on a GPU, after page-locking src where it lies with `register(address, bytes)` unless it is
    page-locked already; on a CPU host (the tests), as plain chunked copies; without waiting for the GPU where
    wait=False. Any other pair (the sub-groups whose optimizer state stayed on the GPU, or the same dtype on both
    sides) goes through copy_ as DeepSpeed does, which waits where it must."""
    if not (src.device.type == "cpu" and src.dtype == torch.float32 and dst.dtype != src.dtype and
            src.is_contiguous() and dst.is_contiguous()):
        dst.copy_(src)
        return
    if dst.device.type == "cuda" and not src.is_pinned() and not _page_lock(src.untyped_storage(), register):
        dst.copy_(src)              # CUDA refused to page-lock this master: DeepSpeed's copy
        return
    copy_in_chunks(dst, src, wait=wait)


def _page_lock(storage, register) -> bool:
    """Page-lock a master's storage where it lies, once (registering a range twice is an error in CUDA); False where
    CUDA refuses (a locked-memory limit, say): said once, and not tried again for that storage."""
    address = storage.data_ptr()
    if address in _REGISTERED:
        return True
    if address in _UNREGISTRABLE:
        return False
    try:
        register(address, storage.nbytes())
    except RuntimeError as error:
        if not _UNREGISTRABLE:
            print(f"labs: could not page-lock an offloaded master ({error}); its updated weights are copied as "
                  "DeepSpeed copies them (slower)", file=sys.stderr, flush=True)
        _UNREGISTRABLE.add(address)
        return False
    _REGISTERED.add(address)
    return True


def _reassign_or_swap_out_partitioned_parameters(self, sub_group_id):
    """DeepSpeed 0.19.8's method (runtime/zero/stage3.py, Apache-2.0) with the line marked changed."""
    if self.fp16_partitioned_groups_flat[sub_group_id] is not None:
        # When torch autocast is enabled, groups in fp16_partitioned_groups are in fp32 already and those in
        # fp32_partitioned_groups are aliases: then the copy copies nothing, as DeepSpeed's does.
        copy_updated_weights(self.fp16_partitioned_groups_flat[sub_group_id].data,          # the change
                             self.fp32_partitioned_groups_flat[sub_group_id].data, _register_host_memory,
                             wait=waits_after(sub_group_id, len(self.fp16_partitioned_groups_flat)))

        #unflatten fp16 parameter subgroup
        self._unflatten_partitioned_parameters(sub_group_id)
    else:
        self._partitioned_params_swap_out(sub_group_id)


def waits_after(sub_group_id: int, sub_groups: int) -> bool:
    """Whether the step waits for this sub-group's copy before going on: after the last sub-group only (every caller
    in DeepSpeed 0.19.8's stage3.py, the step and the swap-buffer resets, walks all sub-groups in order, so that wait
    covers the copies queued before it: they share the stream), or after every one under LABS_OFFLOAD_COPY=gpu-wait.
    Only a later step's CPU Adam writes a master again, and the forward that reads the partitions runs after."""
    return _WAIT_EACH or sub_group_id == sub_groups - 1


def _register_host_memory(address: int, num_bytes: int) -> None:
    from deepspeed.accelerator import get_accelerator
    get_accelerator().register_host_memory(address, num_bytes)


def install() -> bool:
    """Give ZeRO-3 labs' copy of the updated weights, waiting once per step or (LABS_OFFLOAD_COPY=gpu-wait) after each
    sub-group (unless LABS_OFFLOAD_COPY=deepspeed, or this DeepSpeed's method is not 0.19.8's: then DeepSpeed's stays,
    with a note). Idempotent; returns whether labs' copy is in place."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as Stage3

    global _WAIT_EACH
    name = "_reassign_or_swap_out_partitioned_parameters"
    choice = chosen()
    if choice == "deepspeed":
        return False
    _WAIT_EACH = choice == "gpu-wait"
    if getattr(Stage3, name) is _reassign_or_swap_out_partitioned_parameters:
        return True
    if source_sha256(getattr(Stage3, name)) != RESTATED_SHA256:
        print("labs: this DeepSpeed's ZeRO-3 copy of updated weights is not the one labs.offload_copy restates "
              "(0.19.8's): left as it is", file=sys.stderr, flush=True)
        return False
    setattr(Stage3, name, _reassign_or_swap_out_partitioned_parameters)
    return True
