"""Chapter 07 (FSDP2 and ZeRO): exercises. Expected answers come from labs.memory's FSDP2 model (which the chapter
checks against what the runs hold), the model's parameter counts and the committed GPU results."""
from __future__ import annotations

from labs import CONFIGS, memory, models
from labs import config as config_lib
from labs.course import fsdp_vs_zero
from labs.course.exercises.registry import exercise

GiB = 2 ** 30


def fsdp2_state_gib(file: str, gpus_per_node: int, nodes: int = 1, preset: str = "qwen2.5-7b") -> float:
    """GiB of sharded parameters, gradients and Adam states per GPU after backward, as labs.memory predicts for
    FSDP2 with the ds_configs/ file `file`."""
    est = memory.estimate(preset, gpus_per_node=gpus_per_node, nodes=nodes, engine="fsdp2",
                          ds_config=config_lib.load(CONFIGS / file))
    held = est.resident_per_rank[0]
    return (held["params_bytes"] + held["grads_bytes"] + held["optimizer_bytes"]) / GiB


@exercise("07.1", "Qwen2.5-7B, FSDP2 FULL_SHARD (fsdp2.json) on 8 GPUs: GiB per GPU of sharded parameters, "
          "gradients and Adam states after backward?", "GiB",
          hint="FSDP2 keeps fp32 parameters (4 bytes), fp32 gradients (4) and Adam's two fp32 moments (8): 16 bytes "
               "per parameter, split over the 8 ranks; Psi is the model's real count (models.param_counts)")
def _full_shard_8():
    return fsdp2_state_gib("fsdp2.json", gpus_per_node=8)


@exercise("07.2", "The same model on 2 nodes x 8 GPUs as HSDP with 2 replicas (fsdp2_hybrid.json): GiB per GPU of "
          "the same states?", "GiB",
          hint="a replica is one node: the states are sharded over the 8 ranks of a shard group, not over all 16")
def _hybrid_16():
    return fsdp2_state_gib("fsdp2_hybrid.json", gpus_per_node=8, nodes=2)


@exercise("07.3", "FSDP2 with param_dtype bf16 all-gathers each decoder layer whole for its forward: MiB of one "
          "gathered Qwen2.5-7B decoder layer?", "MiB",
          hint="the parameters of one layer (models.param_counts(...)['per_layer']) in the compute dtype, 2 bytes each")
def _gathered_layer_mib():
    return 2 * models.param_counts(models.shape("qwen2.5-7b"))["per_layer"] / 2 ** 20


@exercise("07.4", "Qwen2.5-7B on 1 GPU with FSDP2's CPU offload (fsdp2_offload.json): GiB of host memory for the "
          "model states, as labs.memory predicts?", "GiB",
          hint="everything FSDP2 keeps per parameter moves to the host: fp32 parameters, fp32 gradients, Adam's two "
               "fp32 moments")
def _offload_host_gib():
    est = memory.estimate("qwen2.5-7b", gpus_per_node=1, engine="fsdp2",
                          ds_config=config_lib.load(CONFIGS / "fsdp2_offload.json"))
    return est.host_per_node_bytes / GiB


@exercise("07.5", "DeepSpeed's bf16 engine without ZeRO (zero0_ddp.json) counts one zero-gradient Adam step when it "
          "is built. With the config's betas, how large is the first real update, as a fraction of a fresh "
          "AdamW's for the same gradient?", "x",
          hint="the moments are still zero, but bias correction divides by 1 - beta^2 instead of 1 - beta: "
               "update = m_hat / sqrt(v_hat) with m = (1 - beta1) g, v = (1 - beta2) g^2")
def _shifted_adam():
    betas = config_lib.load(CONFIGS / "zero0_ddp.json")["optimizer"]["params"]["betas"]
    return fsdp_vs_zero.adam_first_update_ratio(betas, steps_before=1)
