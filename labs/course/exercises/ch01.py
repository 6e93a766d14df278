"""Chapter 01 (memory math): exercises. Each asks for a prediction about a setting the chapter never prints; every
expected answer is computed by labs.memory, the model the chapter proves against the paper, DeepSpeed and
measurement."""
from __future__ import annotations

from labs import memory
from labs.course.exercises.registry import exercise

# The setting of 01.2 to 01.4: activations made small (full checkpointing, the fused loss), so that what each stage
# keeps between the loss and the update decides the peak.
SMALL_ACTIVATIONS = dict(preset="qwen2.5-7b", micro_batch=2, seq_len=4096, activation_checkpointing="full",
                         loss="liger")


@exercise("01.1", "DeepSpeed's estimator rules as labs extends them to ZeRO-1, on 16 GPUs (2 nodes of 8): model "
          "states per GPU divided by the model's parameter count?", "bytes per parameter", rel=0,
          hint="of DeepSpeed's 2 + 18 bytes, ask which ZeRO-1 splits over the GPUs (what the optimizer keeps) and "
               "which stay whole on every GPU (the DeepSpeed comparison cell and the tutorials' sums)")
def _zero1_bytes_per_param():
    return memory.estimate(params=1e9, stage=1, gpus_per_node=8, nodes=2).model_states_per_gpu_bytes / 1e9


@exercise("01.2", "Qwen2.5-7B, ZeRO-2 on 8 GPUs, micro-batch 2 x 4096, full checkpointing, Liger loss: at which "
          "moment is the peak (init, loss_backward, layer_backward, first_reduce, backward_end or optimizer_step)?",
          "a moment's name",
          hint="with activations this small, ask which moment adds a copy of something to the model states")
def _zero2_peak_moment():
    return memory.estimate(**SMALL_ACTIVATIONS, stage=2, gpus_per_node=8).peak_phase


@exercise("01.3", "Same setting: how many GiB lower is ZeRO-2's peak than ZeRO-1's? (With the stock loss and no "
          "checkpointing, the chapter's table shows them equal.)", "GiB", rel=0.05,
          hint="find each stage's peak moment first; ZeRO-1 holds every bf16 gradient at the end of backward")
def _zero1_minus_zero2():
    zero1, zero2 = (memory.estimate(**SMALL_ACTIVATIONS, stage=stage, gpus_per_node=8) for stage in (1, 2))
    return (zero1.total_per_gpu_bytes - zero2.total_per_gpu_bytes) / memory.GiB


@exercise("01.4", "01.2's setting on 64 GPUs (8 nodes of 8), each an RTX 4090 (24 GB): how many GiB per GPU does "
          "labs.memory's fit verdict weigh against the card's usable memory (the estimate's fit_bytes_on the card)?",
          "GiB", rel=0.03,
          hint="the peak is the start-up flatten, twice the bf16 weights: is it more than the card's whole memory, "
               "what does DeepSpeed then do, and which moment is the largest after it?")
def _zero2_on_64_small_cards():
    estimate = memory.estimate(**SMALL_ACTIVATIONS, stage=2, gpus_per_node=8, nodes=8)
    return estimate.fit_bytes_on(memory.gpu_bytes("RTX4090")) / memory.GiB


@exercise("01.5", "Qwen2.5-7B, ZeRO-3 with the optimizer offloaded to the CPU, one node of 8 GPUs: host memory of "
          "the node, in GB (1e9 B), by labs' accounting?", "GB", rel=0.02,
          hint="the chapter's offload cell gives the bytes per parameter of each GPU's partition; the node holds "
               "eight partitions")
def _offload_host_gb():
    est = memory.estimate("qwen2.5-7b", stage=3, gpus_per_node=8, offload_optimizer="cpu")
    return est.host_per_node_bytes / memory.GB


@exercise("01.6", "Qwen2.5-7B, FSDP2 on 4 GPUs, Liger loss and kernels, every layer checkpointed, micro-batch 8 x 4096: "
          "how many GiB does labs.memory's end-of-backward moment (backward_end) hold per GPU?", "GiB", rel=0.03,
          hint="take the one-GPU breakdown of round 8's record part by part, and ask of each part whether FSDP2 "
               "shards it over the GPUs (on 4 GPUs this moment is no longer the peak: the start of backward, with "
               "every saved activation, is a little larger)")
def _fsdp2_backward_end_on_4():
    est = memory.estimate("qwen2.5-7b", engine="fsdp2", gpus_per_node=4, micro_batch=8, grad_accum=1,
                          activation_checkpointing="full", loss="liger", kernels="liger")
    return est.phases["backward_end"]["total"] / memory.GiB
