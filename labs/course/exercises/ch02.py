"""Chapter 02 (ZeRO stages): exercises. Each asks for a number the chapter has not printed, to be reasoned out from
what it measured on `tiny`. Expected answers come from labs' models of what DeepSpeed holds and moves, which the
chapter's runs check against measurement (tests/test_stages.py, tests/test_state_bytes.py)."""
from __future__ import annotations

from labs import memory, models
from labs.course.exercises.registry import exercise
from labs.instruments import comm
from labs.memory import layout, peak

MiB, GB = 2**20, 1e9
QWEN25 = models.shape("qwen2.5-7b")


@exercise("02.1", "tiny in fp32 with ZeRO-1 on 4 ranks instead of 2: how many MiB of optimizer states (fp32 master "
          "copy included) does each rank hold?", "MiB",
          hint="from stage 1 each rank keeps an fp32 master copy, the momentum and the variance of its 1/N of the "
               "parameters: 3 fp32 copies over N ranks")
def _zero1_optimizer_on_4_ranks():
    est = memory.estimate("tiny", stage=1, gpus_per_node=4, precision="fp32")
    return est.resident_per_rank[0]["optimizer_bytes"] / MiB


@exercise("02.2", "Qwen2.5-7B in bf16 with zero3.json (reduce_bucket_size \"auto\" = hidden^2, overlap_comm and "
          "contiguous_gradients on): how many MiB of gradient buckets does each GPU hold during backward?", "MiB",
          hint="ZeRO-3 allocates one contiguous bucket of reduce_bucket_size elements, whatever overlap_comm says; "
               "the two alternating buckets are ZeRO-1/2's")
def _zero3_bucket():
    knobs = memory.estimate("qwen2.5-7b", stage=3, gpus_per_node=8).breakdown["knobs"]     # zero3.json, resolved
    return peak.reduce_bucket_bytes(knobs, memory.DTYPE_BYTES["bf16"], stage=3) / MiB


@exercise("02.3", "Qwen2.5-7B in bf16 with DeepSpeed's ZeRO-2 as it runs by default (gradients all-reduced bucket by "
          "bucket, updated parameters all-gathered) on 8 GPUs with ring collectives: how many GB does each GPU send "
          "per step?", "GB",
          hint="the volume is 3 Psi x 2 bytes (an all-reduce counts twice); a ring puts (N-1)/N of the volume on "
               "each rank's link")
def _zero2_wire_bytes():
    psi_bytes = models.param_counts(QWEN25)["total"] * memory.DTYPE_BYTES["bf16"]
    counts = {"all_reduce": {"bytes": psi_bytes}, "all_gather": {"bytes": psi_bytes}}
    return comm.wire_bytes(counts, 8) / GB


@exercise("02.4", "Qwen2.5-7B with zero3.json's stage3_param_persistence_threshold \"auto\" (10 x hidden "
          "elements): how many parameter elements does every rank keep whole instead of partitioned?", "elements",
          rel=0, hint="a tensor of at most 10 x hidden elements stays whole: per layer the two RMSNorm weights and "
                      "the q, k and v biases (k and v are as wide as the key-value heads), and the final norm")
def _persistent_elements():
    knobs = memory.estimate("qwen2.5-7b", stage=3, gpus_per_node=8).breakdown["knobs"]
    return layout.zero3_partition(layout.param_layout(QWEN25), 8, knobs["stage3_param_persistence_threshold"],
                                  knobs["sub_group_size"])["persistent"]
