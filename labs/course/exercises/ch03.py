"""Chapter 03 (offload): exercises. Expected answers come from labs.memory and labs.env."""
from __future__ import annotations

from labs import memory, resolve
from labs.course.exercises.registry import exercise
from labs.env import repaired_environment


@exercise("03.1", "ZeRO-2 + optimizer offload of a bf16 model with Adam: bytes the host holds per parameter, "
          "summed over ranks, staging buffers left out?", "bytes per parameter", rel=0,
          hint="fp32 master weights, Adam's momentum and variance, and the fp32 gradient the CPU optimizer steps "
               "with (ZeRO-3 adds its bf16 gradient partition)")
def _host_bytes_per_param():
    est = memory.estimate(params=1e9, stage=2, gpus_per_node=1, offload_optimizer="cpu")
    return est.host_per_node_bytes / est.params


@exercise("03.2", "A node with 64 cores runs 8 ranks with the optimizer offloaded, under torchrun: what "
          "OMP_NUM_THREADS does labs give each rank?", "threads", rel=0,
          hint="labs gives each rank its share of the cores")
def _omp_threads(cores=64, ranks=8):
    return int(repaired_environment(ranks, True, base={"OMP_NUM_THREADS": "1"}, cores=cores)[0]["OMP_NUM_THREADS"])


def smallest_offload_that_fits(preset="qwen-7b", gpus=4, gpu="RTX3090", **options) -> str:
    """The least offloading (a key of labs.resolve.OFFLOAD_LEVELS) with which labs.memory says it fits."""
    for name, (optimizer, param) in resolve.OFFLOAD_LEVELS.items():
        estimate = memory.estimate(preset, stage=3, gpus_per_node=gpus, offload_optimizer=optimizer,
                                   offload_param=param, **options)
        if estimate.fits(memory.GPUS[gpu]):
            return name
    return "does not fit"


@exercise("03.3", "Qwen2.5-7B on ONE RTX 4090 (24 GB), ZeRO-3, bf16, micro-batch 1, sequence 2048, full activation "
          "checkpointing: the least offloading that fits ('none', 'optimizer', 'optimizer+params' or 'does not "
          "fit')?", "choice", hint="ask labs.memory.estimate(...).fits(memory.GPUS['RTX4090']) for each offload "
                                   "setting, from none upwards")
def _single_4090():
    return smallest_offload_that_fits("qwen2.5-7b", gpus=1, gpu="RTX4090", micro_batch=1, seq_len=2048,
                                      activation_checkpointing="full")
