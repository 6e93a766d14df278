"""Chapter 02 (ZeRO stages): exercises. Expected answers come from labs' models of what DeepSpeed moves and holds,
which the chapter's runs check against measurement (tests/test_stages.py)."""
from __future__ import annotations

from labs import memory, models, resolve
from labs.course.exercises.registry import exercise
from labs.instruments import comm
from labs.memory import peak

QWEN25_PARAMS = models.param_counts(models.shape("qwen2.5-7b"))["total"]


@exercise("02.1", "Qwen2.5-7B in bf16 on 8 GPUs with ZeRO-3: the paper's communication volume per GPU per step?",
          "bytes", hint="ZeRO-3 moves 3 Psi elements per rank per step (two all-gathers, one reduce-scatter); "
                        "bf16 is 2 bytes; the number of GPUs does not enter")
def _zero3_volume():
    return comm.paper_volume_elements(3, QWEN25_PARAMS) * memory.DTYPE_BYTES["bf16"]


@exercise("02.2", "ZeRO-2 in bf16 with overlap_comm and contiguous_gradients on and DeepSpeed's default "
          "reduce_bucket_size: bytes of gradient buckets per GPU during backward?", "bytes",
          hint="one bucket of reduce_bucket_size elements, a second one with overlap_comm, in the gradient dtype "
               "(the table of bucket runs shows the rule)")
def _bucket_bytes():
    knobs = dict(resolve.ZERO_DEFAULTS, overlap_comm=True, contiguous_gradients=True)
    return peak.reduce_bucket_bytes(knobs, memory.DTYPE_BYTES["bf16"])


@exercise("02.3", "ZeRO-2 on 2 ranks with use_multi_rank_bucket_allreduce set to false: the communication volume "
          "per rank per step, in units of Psi x bytes per element?", "Psi", rel=0.02,
          hint="each gradient is reduced once to the rank that owns it, then the updated parameters are gathered")
def _paper_reduction_volume():
    return comm.paper_volume_elements(2, 1)
