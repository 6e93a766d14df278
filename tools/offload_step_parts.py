"""The parts of ZeRO-3's offloaded optimizer step, timed one by one on a GPU host over NUMEL fp32 parameters, as
DeepSpeed 0.19.8's stage3.py runs them for each sub-group whose optimizer state is on the CPU:

    unscale_and_clip_grads   grad.mul_(1 / combined_scale)           a pass over the pinned fp32 gradients
    _optimizer_step          DeepSpeedCPUAdam.step()                 CPU Adam over the pinned fp32 master weights
    _reassign_or_swap_out... fp16_flat.copy_(fp32_flat)              pinned fp32 on the host -> bf16 on the GPU

plus, for comparison, the same copy without the dtype change (fp32 -> fp32 on the GPU), the cast alone on the host,
and a gradient norm on the host. Round 29 timed these with the master page-locked; ZeRO-3 keeps its masters in pageable
memory (`pin_memory` pins the gradient buffers only), so the two copies are also timed from a pageable master
(`*_pageable_s`, added after round 29), and from a pageable master page-locked in place with cudaHostRegister, as
labs.offload_copy does under LABS_OFFLOAD_COPY=gpu (`*_registered_s`). Prints one JSON line. Round 28's 7B
(results/gpu/one_card_7b_1xh100) spent 4.73 s in the optimizer step, of which CPU Adam alone accounts for about 1.34 s:
which part is the rest?

    python3 tools/offload_step_parts.py 1000000000 5
"""
import json
import statistics
import sys
import time

import torch
from deepspeed.ops.adam import DeepSpeedCPUAdam


def timed(step, repeats):
    seconds = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def main(numel: int, repeats: int) -> dict:
    master = torch.nn.Parameter(torch.zeros(numel).pin_memory())
    master.grad = torch.full((numel,), 1e-3).pin_memory()
    optimizer = DeepSpeedCPUAdam([master], lr=1e-5, betas=(0.9, 0.95), weight_decay=0.0)
    optimizer.step()                                       # state allocation and first touch
    on_gpu_bf16 = torch.empty(numel, dtype=torch.bfloat16, device="cuda")
    on_gpu_fp32 = torch.empty(numel, dtype=torch.float32, device="cuda")
    scale = torch.tensor(1.0)                              # 1 / combined_scale, a 0-dim tensor as in stage3.py
    result = dict(numel=numel, repeats=repeats, threads=torch.get_num_threads(), torch=torch.__version__)
    result["grad_mul_s"] = timed(lambda: master.grad.mul_(scale), repeats)
    result["cpu_adam_s"] = timed(optimizer.step, repeats)
    result["copy_to_gpu_bf16_s"] = timed(lambda: on_gpu_bf16.copy_(master.data), repeats)
    result["copy_to_gpu_fp32_s"] = timed(lambda: on_gpu_fp32.copy_(master.data), repeats)
    result["cast_on_host_s"] = timed(lambda: master.data.to(torch.bfloat16), repeats)
    result["grad_norm_s"] = timed(lambda: master.grad.norm(2), repeats)
    pageable = master.data.clone()                         # as stage3.py's _create_fp32_partitions makes it
    assert not pageable.is_pinned()
    result["copy_to_gpu_bf16_pageable_s"] = timed(lambda: on_gpu_bf16.copy_(pageable), repeats)
    result["copy_to_gpu_fp32_pageable_s"] = timed(lambda: on_gpu_fp32.copy_(pageable), repeats)
    storage = pageable.untyped_storage()
    start = time.perf_counter()
    torch.cuda.check_error(int(torch.cuda.cudart().cudaHostRegister(storage.data_ptr(), storage.nbytes(), 0)))
    result["register_s"] = time.perf_counter() - start
    result["copy_to_gpu_fp32_registered_s"] = timed(lambda: on_gpu_fp32.copy_(pageable, non_blocking=True), repeats)
    return result


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]), int(sys.argv[2]))))
