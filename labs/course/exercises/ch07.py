"""Chapter 07 (FSDP2 and ZeRO): exercises. Expected answers come from labs.memory's FSDP2 model (which the chapter
checks against what the runs hold), the model's parameter counts, and the learning-rate schedule and Adam
bias correction the chapter's runs use."""
from __future__ import annotations

from labs import CONFIGS, memory, models
from labs import config as config_lib
from labs.course import fsdp_vs_zero
from labs.course.exercises.registry import exercise

GiB = 2 ** 30
# The chapter's runs: 6 steps of the tiny model.
CHAPTER_STEPS = 6


def fsdp2_state_gib(file: str, gpus_per_node: int, nodes: int = 1, preset: str = "qwen2.5-7b") -> float:
    """GiB of sharded parameters, gradients and Adam states per GPU after backward, as labs.memory predicts for
    FSDP2 with the ds_configs/ file `file`."""
    est = memory.estimate(preset, gpus_per_node=gpus_per_node, nodes=nodes, engine="fsdp2",
                          ds_config=config_lib.load(CONFIGS / file))
    held = est.resident_per_rank[0]
    return (held["params_bytes"] + held["grads_bytes"] + held["optimizer_bytes"]) / GiB


@exercise("07.1", "Qwen2.5-7B, FSDP2 FULL_SHARD (fsdp2.json) on 8 GPUs: GiB per GPU of sharded parameters, "
          "gradients and Adam states after backward?", "GiB",
          hint="FSDP2 keeps fp32 parameters (4 bytes), fp32 gradients (4) and Adam's two fp32 moments (8) per "
               "parameter, split over the 8 ranks; count the model's real parameters (the table of chapter 1)")
def _full_shard_8():
    return fsdp2_state_gib("fsdp2.json", gpus_per_node=8)


@exercise("07.2", "The same model on 2 nodes x 8 GPUs as HSDP with 2 replicas (fsdp2_hybrid.json): GiB per GPU of "
          "the same states?", "GiB",
          hint="a replica is one node: the states are sharded over the 8 ranks of a shard group, not over all 16")
def _hybrid_16():
    return fsdp2_state_gib("fsdp2_hybrid.json", gpus_per_node=8, nodes=2)


@exercise("07.3", "FSDP2 with param_dtype bf16 all-gathers each decoder layer whole for its forward: MiB of one "
          "gathered Qwen2.5-7B decoder layer?", "MiB",
          hint="attention: q and o are hidden x hidden, k and v hidden x (kv heads x head dim), q, k and v have "
               "biases; the MLP has three hidden x intermediate matrices; two RMSNorm weights; 2 bytes each")
def _gathered_layer_mib():
    return 2 * models.param_counts(models.shape("qwen2.5-7b"))["per_layer"] / 2 ** 20


@exercise("07.4", "Qwen2.5-7B on 2 nodes x 8 GPUs with FSDP2's CPU offload (fsdp2_offload.json, one shard group of "
          "16 ranks): GiB of host memory per node for the model states, as labs.memory predicts?", "GiB",
          hint="every byte FSDP2 keeps per parameter moves to the host, and each node's host holds the shards of "
               "its own 8 ranks: a sixteenth of the model each")
def _offload_host_gib():
    est = memory.estimate("qwen2.5-7b", gpus_per_node=8, nodes=2, engine="fsdp2",
                          ds_config=config_lib.load(CONFIGS / "fsdp2_offload.json"))
    return est.host_per_node_bytes / GiB


@exercise("07.5", "DeepSpeed's bf16 engine without ZeRO (zero0_ddp.json) counts one zero-gradient Adam step when it "
          "is built, and the chapter's schedule gives the first steps lr 0. For a steady gradient, how large is "
          "the first update with a non-zero lr, as a fraction of FSDP2's at the same step?", "x",
          hint="the lr-0 steps still count in Adam and fill its moments; at the first non-zero lr FSDP2's Adam has "
               "seen k gradients and DeepSpeed's counter says k + 1: compare the bias corrections "
               "(1 - beta^k) / (1 - beta^(k+1)), the square root of it for beta2")
def _shifted_adam():
    betas = config_lib.load(CONFIGS / "zero0_ddp.json")["optimizer"]["params"]["betas"]
    lrs = fsdp_vs_zero.schedule_lrs("zero0_ddp.json", CHAPTER_STEPS)
    first_nonzero = next(step for step, lr in enumerate(lrs, start=1) if lr > 0)
    return fsdp_vs_zero.adam_update_ratio(betas, steps_before=1, real_steps=first_nonzero)
