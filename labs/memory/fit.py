"""The one rule of every fit verdict: which bytes a card must hold for a setting to fit, given the card.

Every moment of a step counts (labs.memory.peak), ZeRO-1/2's start-up flatten (`init`, the model copied into one flat
buffer while the original tensors exist) included, except where DeepSpeed surely makes that copy on the CPU.
DeepSpeed 0.19.8's ZeRO-1/2 optimizer (stage_1_and_2.py, `flatten_on_accelerator`) flattens on the GPU when
`available_memory()` is at least the flat buffer: nvml's free memory if pynvml is importable, else the card's total
less what PyTorch has allocated, which ignores the CUDA context (cuda_accelerator.py; pynvml is not in labs'
requirements). So without pynvml it falls back only when the parameters and the flat copy exceed the card's total
memory; between labs' usable memory (labs.memory.usable_bytes) and that total it flattens on the GPU, where it may
run out (the CUDA context and the allocator's cache take their share). The rule: the start-up flatten is left out
only when it exceeds the card's total (then DeepSpeed falls back, with or without pynvml); otherwise it counts
against usable memory like every moment, the same allowance every other moment gets.

Where it falls back, the host pays: each rank moves its parameters to the CPU (`param.cpu_data`) and builds the flat
buffer there from them, so it holds its weights twice at once, as the GPU would have (`start_up_host_per_node_bytes`).
"""
from __future__ import annotations

from labs.memory.units import parse_bytes

FP32_NAMES = ("fp32", "float32", "float", "torch.float32")     # DeepSpeed's DtypeEnum names for fp32


def init_falls_back(stage: int, precision: str, offload_optimizer, data_types: dict | None = None,
                    engine: str = "deepspeed") -> bool:
    """Whether DeepSpeed 0.19.8 flattens the model on the CPU when the GPU has no room for the flat copy.
    `offload_optimizer`: the estimate's own ("cpu", "nvme" or None), not its config file's (advise varies it);
    `data_types`: the config's block of that name. ZeRO-1/2's optimizer (DeepSpeedZeroOptimizer, ZenFlow's included)
    does: short of room it moves the group's parameters to the CPU, flattens there and copies only the flat buffer
    back, so the GPU never holds both. The others have no such check: ZeRO-0's FP16_Optimizer (bf16 and fp16:
    fused_optimizer.py clones and flattens on the GPU), BF16_Optimizer (engine.py picks it for ZeRO-1 with bf16 weights,
    fp32 gradient accumulation, `data_types.grad_accum_dtype`, and no CPU offload; labs never sets it), FSDP2; ZeRO-3
    makes no whole flat copy."""
    if engine != "deepspeed" or stage not in (1, 2):
        return False
    accumulates_fp32 = str((data_types or {}).get("grad_accum_dtype")) in FP32_NAMES
    offloaded = offload_optimizer == "cpu"     # engine.py's zero_cpu_offload(): NVMe offload still takes BF16_Optimizer
    return not (stage == 1 and precision == "bf16" and accumulates_fp32 and not offloaded)


def flattens_on_cpu(est, gpu_memory_bytes, total=None) -> bool:
    """Whether DeepSpeed surely makes this estimate's start-up flatten on the CPU on a card of `gpu_memory_bytes`:
    the parameters and the flat copy exceed the card's total memory. `total`: the total DeepSpeed sees where it is
    not the card's, as under `--gpu-memory`, which caps PyTorch's share of a larger card (labs.card_cap) while
    DeepSpeed's available_memory() still reads the whole card."""
    return bool(est.init_falls_back) and est.phases["init"]["total"] > parse_bytes(
        gpu_memory_bytes if total is None else total)


def phase_on(est, gpu_memory_bytes, total=None) -> str:
    """The moment a fit verdict on this card weighs: the largest, leaving out a start-up flatten made on the CPU."""
    return _largest(est, leave_out_init=flattens_on_cpu(est, gpu_memory_bytes, total))


def _largest(est, leave_out_init: bool) -> str:
    """The moment of the largest total, the start-up flatten (`init`) left out if asked."""
    return max((name for name in est.phases if not (leave_out_init and name == "init")),
               key=lambda name: est.phases[name]["total"])


def start_up_host_per_node_bytes(est, gpu_memory_bytes, total=None) -> int:
    """Host memory the start-up needs per node where the flatten falls back to the CPU on this card (0 elsewhere):
    each rank's parameters (`cpu_data`) and the CPU flat buffer at once, for every GPU of the node."""
    if not flattens_on_cpu(est, gpu_memory_bytes, total):
        return 0
    return int(est.phases["init"]["total"] * est.inputs["gpus_per_node"])


def note(est) -> str | None:
    """The estimate's note where its peak is a start-up flatten that can fall back to the CPU; None elsewhere."""
    init = est.phases.get("init", {}).get("total", 0)
    if not est.init_falls_back or init < est.total_per_gpu_bytes:
        return None
    rest = _largest(est, leave_out_init=True)
    return (f"the peak is the start-up flatten (init, {init / 2**30:.1f} GiB): on a card of less memory in all, "
            f"DeepSpeed makes it on the CPU ({est.inputs['gpus_per_node'] * init / 2**30:.1f} GiB of host memory per "
            f"node while its ranks start) and the fit weighs {rest} ({est.phases[rest]['total'] / 2**30:.1f} GiB); "
            "on a card of more it counts against the usable memory like every moment")
