"""Chapter 01 (memory math): exercises. Every expected answer is computed by labs.memory."""
from __future__ import annotations

from labs import memory, models
from labs.course.exercises.registry import exercise
from labs.memory import activations


@exercise("01.1", "Mixed-precision AdamW without ZeRO, paper accounting: bytes of model states per parameter?",
          "bytes", rel=0, hint="bf16 params and grads, plus K = fp32 master + momentum + variance")
def _bytes_per_param():
    return memory.estimate(params=1e9, stage=0).paper_model_states_per_gpu_bytes / 1e9


@exercise("01.2", "Qwen2.5-7B, ZeRO-2 on 8 GPUs: model states per GPU by the paper's accounting, in GB (1e9 B)?",
          "GB", hint="2 Psi + (2 + K) Psi / N_d; Psi is the model's real parameter count, not 7e9")
def _zero2_states():
    return memory.estimate("qwen2.5-7b", stage=2, gpus_per_node=8).paper_model_states_per_gpu_bytes / 1e9


@exercise("01.3", "Same setup: how many GB more does DeepSpeed's own estimator count than the paper, and why?",
          "GB", hint="DeepSpeed copies each gradient partition to fp32 for the update: 4 bytes per parameter / N")
def _deepspeed_extra():
    est = memory.estimate("qwen2.5-7b", stage=2, gpus_per_node=8)
    return (est.model_states_per_gpu_bytes - est.paper_model_states_per_gpu_bytes) / 1e9


@exercise("01.4", "Stock HF loss, Qwen2.5-7B, micro-batch 2 x 4096 tokens: GiB of the three fp32 [tokens, vocab] "
          "tensors alive in log_softmax's backward?", "GiB",
          hint="12 bytes per logit: tokens = 2 * 4096 (labels are padded, not cut), vocab = 152,064")
def _loss_gib():
    return sum(activations.loss_bytes(models.shape("qwen2.5-7b"), "hf", 2, 4096).values()) / 2 ** 30


@exercise("01.5", "Fewest GPUs (one node, ZeRO-3, no offload) for Qwen2.5-7B, micro-batch 2 x 4096, full "
          "checkpointing, Liger loss, to fit 80 GiB cards by the labs peak (est.fits)?", "GPUs", rel=0,
          hint="try memory.estimate(..., gpus_per_node=n).fits(memory.parse_bytes('80GiB')) for n = 1, 2, ...")
def _fewest_gpus():
    for gpus in range(1, 65):
        est = memory.estimate("qwen2.5-7b", stage=3, gpus_per_node=gpus, micro_batch=2,
                              activation_checkpointing="full", loss="liger")
        if est.fits(memory.parse_bytes("80GiB")):
            return gpus
    raise AssertionError("no GPU count up to 64 fits")
