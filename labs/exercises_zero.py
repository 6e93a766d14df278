"""Exercise checkers for chapters 02 (ZeRO stages) and 03 (offload). Each `check_<chapter>_<name>(answer)`
prints one verdict line and returns True/False; None means "not answered yet" and prints a hint.
The expected answers are computed here from labs' own models, never typed in."""
from __future__ import annotations

from labs import comm, models

QWEN25_PARAMS = models.param_counts(models.shape("qwen2.5-7b"))["total"]


def _verdict(answer, expected, *, hint: str, unit: str = "", rel=0.01) -> bool:
    if answer is None:
        print(f"not answered yet. Hint: {hint}")
        return False
    try:
        ok = abs(float(answer) - expected) <= rel * abs(expected)
    except (TypeError, ValueError):
        print(f"'{answer}' is not a number. Hint: {hint}")
        return False
    if ok:
        print(f"correct: {expected:,.0f}{unit}")
    elif rel == 0:
        print(f"not quite: {float(answer):,.0f}{unit} is not the answer. Hint: {hint}")
    else:
        print(f"not quite: {float(answer):,.0f}{unit} is more than {rel:.0%} away from the answer. Hint: {hint}")
    return ok


def _choice(answer, expected: str, *, hint: str) -> bool:
    if answer is None:
        print(f"not answered yet. Hint: {hint}")
        return False
    ok = str(answer).strip().strip('"').split(":")[0].strip().lower() == expected.lower()
    print(f"correct: {expected}" if ok else f"not quite. Hint: {hint}")
    return ok


# ---------------------------------------------------------------------------------------------- chapter 02
def check_02_zero3_volume(answer_bytes) -> bool:
    """Qwen2.5-7B in bf16 on 8 GPUs with ZeRO-3: the paper's communication volume per GPU per step, in bytes."""
    expected = comm.paper_volume_elements(3, QWEN25_PARAMS) * 2
    return _verdict(answer_bytes, expected, unit=" bytes",
                    hint="ZeRO-3 moves 3 Psi elements per rank per step (two all-gathers, one reduce-scatter); "
                         "bf16 is 2 bytes; the number of GPUs does not enter")


def check_02_bucket_bytes(answer_bytes) -> bool:
    """ZeRO-2 in bf16 with overlap_comm and contiguous_gradients on and DeepSpeed's default reduce_bucket_size
    (5e8): bytes of gradient buckets per GPU."""
    expected = 2 * int(5e8) * 2
    return _verdict(answer_bytes, expected, unit=" bytes",
                    hint="one bucket of reduce_bucket_size elements, a second one with overlap_comm, "
                         "in the gradient dtype (the table of bucket runs shows the rule)")


def check_02_paper_reduction_key(answer_key) -> bool:
    """The zero_optimization key that, set to false, makes DeepSpeed's ZeRO-1/2 reduce each gradient slice to
    the rank that owns it (the paper's 2 Psi) instead of all-reducing whole buckets (3 Psi)."""
    return _choice(answer_key, "use_multi_rank_bucket_allreduce",
                   hint="look at the knob run whose reduce calls replaced the all-reduce calls")


# ---------------------------------------------------------------------------------------------- chapter 03
def check_03_host_bytes_per_param(answer) -> bool:
    """ZeRO-2 + optimizer offload of a bf16 model with Adam: bytes the host holds per parameter, summed over
    ranks, staging buffers left out."""
    expected = 4 + 4 + 4 + 4
    return _verdict(answer, expected, unit=" bytes per parameter",
                    hint="fp32 master weights, Adam's momentum and variance, and the fp32 gradient the CPU "
                         "optimizer steps with (ZeRO-3 adds its bf16 gradient partition)")


def check_03_omp_threads(answer, cores=64, ranks=8) -> bool:
    """A node with 64 cores runs 8 ranks with the optimizer offloaded: OMP_NUM_THREADS per rank."""
    from labs.env import repaired_environment

    expected = int(repaired_environment(ranks, True, base={"OMP_NUM_THREADS": "1"}, cores=cores)[0]["OMP_NUM_THREADS"])
    return _verdict(answer, expected, unit=" threads", rel=0,
                    hint="labs gives each rank its share of the cores")


def smallest_offload_that_fits(preset="qwen-7b", gpus=4, gpu="RTX3090", **options) -> str:
    """'none', 'optimizer' or 'optimizer+param': the least offloading with which labs.memory says it fits."""
    from labs import memory

    for name, optimizer, param in (("none", None, None), ("optimizer", "cpu", None),
                                   ("optimizer+param", "cpu", "cpu")):
        estimate = memory.estimate(preset, stage=3, gpus_per_node=gpus, offload_optimizer=optimizer,
                                   offload_param=param, **options)
        if estimate.fits(memory.GPUS[gpu]):
            return name
    return "does not fit"


def check_03_single_4090(answer) -> bool:
    """Qwen2.5-7B on ONE RTX 4090 (24 GB), ZeRO-3, bf16, micro-batch 1, sequence 2048, full activation
    checkpointing: the least offloading that fits ('none', 'optimizer', 'optimizer+param' or 'does not fit')."""
    expected = smallest_offload_that_fits("qwen2.5-7b", gpus=1, gpu="RTX4090", micro_batch=1, seq_len=2048,
                                          activation_checkpointing="full")
    return _choice(answer, expected, hint="ask labs.memory.estimate(...).fits(memory.GPUS['RTX4090']) for "
                                          "each offload setting, from none upwards")
