"""Chapter 03 (offload): exercises. Each asks for what the chapter has not printed. Expected answers come from
labs.memory (checked against the chapter's runs: tests/test_state_bytes.py) and from run b's recorded timers."""
from __future__ import annotations

from labs import CONFIGS, memory, resolve
from labs import config as config_lib
from labs.bench import results
from labs.course.exercises.registry import exercise

GiB = 2**30


@exercise("03.1", "Qwen2.5-7B in bf16 with ZeRO-2 and the optimizer offloaded (zero2_offload_optimizer.json, "
          "pin_memory true) on one node of 8 GPUs: how many GiB of host memory does the offloaded optimizer take on "
          "the node: fp32 master weights, Adam's two moments, fp32 gradients, bf16 buffers and staging buffers, with "
          "PyTorch's pinning (not the processes themselves)?", "GiB",
          rel=0.02, hint="per rank, pinned and so each rounded up to a power of two: the fp32 master partition (4 "
                         "bytes per partitioned parameter), its fp32 gradient (4), the bf16 buffer for the updated "
                         "weights (2) and a bf16 staging buffer as big as the largest parameter; not pinned: Adam's 8")
def _zero2_offload_host():
    config = config_lib.load(CONFIGS / "zero2_offload_optimizer.json")
    estimate = memory.estimate("qwen2.5-7b", gpus_per_node=8, host_pinning="torch", ds_config=config)
    return estimate.host_per_node_bytes / GiB


@exercise("03.2", "Run b (ZeRO-3 + optimizer offload, 1 x H200): if gradient accumulation 4 "
          "ran four micro-batches' forward and backward at run b's speed before one CPU optimizer step, how many "
          "tokens/s would it train?", "tokens/s", rel=0.02,
          hint="tokens per step x 4 / (4 x (forward + backward) + one optimizer step), with run b's timers")
def _offload_with_accumulation(micro_batches=4):
    run_b = results.find(results.rows(results.load_all()), "b_offload_1xh200", "stock-zero3-offload")
    seconds = (micro_batches * (run_b["fwd_ms"] + run_b["bwd_ms"]) + run_b["step_ms"]) / 1000
    return micro_batches * run_b["tokens_per_step"] / seconds


def smallest_offload_that_fits(preset="qwen-7b", gpus=4, gpu="RTX3090", **options) -> str:
    """The least offloading (a key of labs.resolve.OFFLOAD_LEVELS) with which labs.memory says it fits."""
    for name, (optimizer, param) in resolve.OFFLOAD_LEVELS.items():
        estimate = memory.estimate(preset, stage=3, gpus_per_node=gpus, offload_optimizer=optimizer,
                                   offload_param=param, **options)
        if estimate.fits(memory.GPUS[gpu]):
            return name
    return "does not fit"


# 03.3's setting: sequence 8192 with the 'hf' loss puts every offload level at least 6 GiB from the card's usable
# memory (tests/test_offload_course.py checks the margin), so the answer does not hinge on labs.memory's reserve.
SINGLE_4090 = dict(preset="qwen2.5-7b", gpus=1, gpu="RTX4090", micro_batch=1, seq_len=8192,
                   activation_checkpointing="full", loss="hf")


@exercise("03.3", "Qwen2.5-7B on ONE RTX 4090 (24 GB), ZeRO-3, bf16, micro-batch 1, sequence 8192 (four times the "
          "chapter's), full activation checkpointing, Hugging Face's own loss (labs' loss 'hf'): the least "
          "offloading that fits? One of " + ", ".join(f"'{name}'" for name in resolve.OFFLOAD_LEVELS)
          + " or 'does not fit'.", "choice",
          hint="what grows with the sequence: activations and the 'hf' loss's three fp32 [tokens, vocab] tensors "
               "(labs' 'liger' loss never builds them)")
def _single_4090():
    return smallest_offload_that_fits(**SINGLE_4090)
