"""Chapters 02 (ZeRO stages) and 03 (offload): exercises registered into labs.exercises. The expected answers
are computed from labs' own models, never typed in."""
from __future__ import annotations

from labs import comm, models
from labs.exercises import exercise

QWEN25_PARAMS = models.param_counts(models.shape("qwen2.5-7b"))["total"]


# ---------------------------------------------------------------------------------------------- chapter 02
@exercise("02.1", "Qwen2.5-7B in bf16 on 8 GPUs with ZeRO-3: the paper's communication volume per GPU per step?",
          "bytes", hint="ZeRO-3 moves 3 Psi elements per rank per step (two all-gathers, one reduce-scatter); "
                        "bf16 is 2 bytes; the number of GPUs does not enter")
def _zero3_volume():
    return comm.paper_volume_elements(3, QWEN25_PARAMS) * 2


@exercise("02.2", "ZeRO-2 in bf16 with overlap_comm and contiguous_gradients on and DeepSpeed's default "
          "reduce_bucket_size (5e8): bytes of gradient buckets per GPU during backward?", "bytes",
          hint="one bucket of reduce_bucket_size elements, a second one with overlap_comm, in the gradient dtype "
               "(the table of bucket runs shows the rule)")
def _bucket_bytes():
    return 2 * int(5e8) * 2


@exercise("02.3", "Which zero_optimization key, set to false, makes DeepSpeed's ZeRO-1/2 reach the paper's 2 Psi?",
          "key name", hint="look at the knob run whose reduce calls replaced the all-reduce calls")
def _paper_reduction_key():
    return "use_multi_rank_bucket_allreduce"


# ---------------------------------------------------------------------------------------------- chapter 03
@exercise("03.1", "ZeRO-2 + optimizer offload of a bf16 model with Adam: bytes the host holds per parameter, "
          "summed over ranks, staging buffers left out?", "bytes per parameter", rel=0,
          hint="fp32 master weights, Adam's momentum and variance, and the fp32 gradient the CPU optimizer steps "
               "with (ZeRO-3 adds its bf16 gradient partition)")
def _host_bytes_per_param():
    return 4 + 4 + 4 + 4


@exercise("03.2", "A node with 64 cores runs 8 ranks with the optimizer offloaded, under torchrun: what "
          "OMP_NUM_THREADS does labs give each rank?", "threads", rel=0,
          hint="labs gives each rank its share of the cores")
def _omp_threads(cores=64, ranks=8):
    from labs.env import repaired_environment

    return int(repaired_environment(ranks, True, base={"OMP_NUM_THREADS": "1"}, cores=cores)[0]["OMP_NUM_THREADS"])


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


@exercise("03.3", "Qwen2.5-7B on ONE RTX 4090 (24 GB), ZeRO-3, bf16, micro-batch 1, sequence 2048, full activation "
          "checkpointing: the least offloading that fits ('none', 'optimizer', 'optimizer+param' or 'does not "
          "fit')?", "choice", hint="ask labs.memory.estimate(...).fits(memory.GPUS['RTX4090']) for each offload "
                                   "setting, from none upwards")
def _single_4090():
    return smallest_offload_that_fits("qwen2.5-7b", gpus=1, gpu="RTX4090", micro_batch=1, seq_len=2048,
                                      activation_checkpointing="full")
