"""PyTorch FSDP2 (`fully_shard`) behind the same interface as a DeepSpeed engine, driven by the same JSON config,
so `labs.train` runs one loop for both and the chapters can compare them on equal terms.

Mapping from the DeepSpeed config: bf16.enabled -> MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) with
fp32 sharded parameters (FSDP2's master weights are the parameters themselves, cast per layer for compute);
optimizer.params -> torch AdamW (fused on GPU), built after sharding, over the sharded parameters; scheduler -> the
very same DeepSpeed scheduler class; gradient_clipping -> clip_grad_norm_. Every decoder layer is one FSDP unit;
the wrapper (embedding, final norm, head, loss) is the root unit.

FSDP2's own settings come from a top-level "fsdp" block of the same file (ds_configs/fsdp2*.json):

    "fsdp": {"reshard_after_forward": true, "offload": "none", "replicas": 1}

- reshard_after_forward: true frees each layer's gathered parameters after its forward and gathers them again in
  backward (FSDP1's FULL_SHARD, DeepSpeed's ZeRO-3); false keeps them until backward (SHARD_GRAD_OP, ~ZeRO-2); a
  number k keeps them sharded over groups of k ranks in between, so backward gathers within k ranks (~ZeRO++ hpZ).
- offload: "cpu" keeps sharded parameters, gradients and the optimizer step on the host (CPUOffloadPolicy).
- replicas: r splits the ranks into r groups that each hold a full sharded copy (a 2-D mesh, replicate x shard:
  HYBRID_SHARD; DeepSpeed 0.19 removed its own, MiCS); "all" makes every rank a replica (NO_SHARD, i.e. DDP).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from labs import models
from labs.errors import LabsError

DEFAULTS = {"reshard_after_forward": True, "offload": "none", "replicas": 1}
OFFLOADS = ("none", "cpu")


def settings(config: dict, world_size: int) -> dict:
    """The config's "fsdp" block, checked against `world_size` ranks, defaults filled, replicas as a number."""
    block = config.get("fsdp", {})
    if not isinstance(block, dict):
        raise LabsError("config key 'fsdp' must be an object such as {\"reshard_after_forward\": true}")
    for key in block:
        if key not in DEFAULTS:
            raise LabsError(f"config key 'fsdp.{key}' is unknown; FSDP2 reads {', '.join(DEFAULTS)}")
    if config.get("fp16", {}).get("enabled") is True:
        raise LabsError("config key 'fp16.enabled': labs runs FSDP2 in bf16 or fp32; use \"bf16\"")
    offloads = [k for k in ("offload_optimizer", "offload_param")
                if (config.get("zero_optimization", {}).get(k) or {}).get("device", "none") != "none"]
    if offloads:
        raise LabsError(f"config key 'zero_optimization.{offloads[0]}' is DeepSpeed's; FSDP2 does not read it: "
                        "set \"fsdp\": {\"offload\": \"cpu\"} instead")
    found = {**DEFAULTS, **block}
    if found["offload"] not in OFFLOADS:
        raise LabsError(f"config key 'fsdp.offload' is {found['offload']!r}: \"none\" or \"cpu\" (FSDP2 has no NVMe "
                        "offload)")
    replicas = world_size if found["replicas"] == "all" else found["replicas"]
    if not _positive_int(replicas) or world_size % replicas:
        raise LabsError(f"config key 'fsdp.replicas' is {found['replicas']!r}: it must divide the {world_size} "
                        "ranks (1: every rank holds a shard; \"all\": every rank a full copy)")
    reshard, shard_size = found["reshard_after_forward"], world_size // replicas
    if not isinstance(reshard, bool) and not (_positive_int(reshard) and 1 < reshard < shard_size
                                              and shard_size % reshard == 0):
        raise LabsError(f"config key 'fsdp.reshard_after_forward' is {reshard!r}: true, false, or a divisor of the "
                        f"{shard_size} ranks of a shard group other than 1 and {shard_size}")
    return dict(found, replicas=replicas)


def strategy(fsdp_settings: dict, world_size: int) -> str:
    """FSDP1's name for these settings (the names most docs and the Accelerate prompt still use)."""
    replicas, reshard = fsdp_settings["replicas"], fsdp_settings["reshard_after_forward"]
    if replicas == world_size and world_size > 1:
        return "NO_SHARD"
    name = "FULL_SHARD" if reshard is True else "SHARD_GRAD_OP" if reshard is False else \
        f"FULL_SHARD (reshard to {reshard})"
    return ("HYBRID_SHARD" if reshard is True else f"HYBRID_SHARD + {name}") if replicas > 1 else name


class Fsdp2Engine:
    def __init__(self, module, optimizer, scheduler, clip, fsdp_settings):
        self.module, self.optimizer, self.scheduler, self.clip = module, optimizer, scheduler, clip
        self.settings = fsdp_settings
        self._grad_norm = None

    def __call__(self, input_ids):
        return self.module(input_ids)

    def backward(self, loss):
        loss.backward()

    def step(self):
        # labs.train calls backward/step once per micro-batch; FSDP2 accumulates gradients itself, so only the
        # last micro-batch of a step (counted here) runs the optimizer.
        self._micro += 1
        if self._micro % self.accumulation:
            return
        if self.clip:
            self._grad_norm = torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.clip).full_tensor()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.scheduler is not None:
            self.scheduler.step()

    def get_lr(self):
        return [group["lr"] for group in self.optimizer.param_groups]

    def get_global_grad_norm(self):
        return None if self._grad_norm is None else float(self._grad_norm)


def _float8_linears(hf):
    """torchao's float8 training: every Linear of the decoder layers computes its matmuls in fp8 (e4m3 forward,
    e5m2 gradients, dynamic scaling), with bf16/fp32 weights kept as they were. The head stays in bf16 (Liger's
    fused loss reads its weight directly)."""
    from torchao.float8 import convert_to_float8_training

    convert_to_float8_training(hf.model, module_filter_fn=lambda module, fqn: "layers." in fqn)


def initialize(spec: dict, ds_config: dict, device: torch.device) -> Fsdp2Engine:
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    world = dist.get_world_size()
    found = settings(ds_config, world)
    mesh = device_mesh(device.type, world, found["replicas"])
    # Built whole in fp32 on the device (FSDP2 keeps fp32 shards and casts per layer for compute), with the same
    # seed and init order as the DeepSpeed engines, then sharded: simple, and fine while one model fits one
    # device's memory for a moment (7B fp32: 30 GB). Larger models would start on the meta device instead.
    hf = models.build(spec["preset"], dtype=torch.float32, device=device, seed=spec["seed"],
                      model_path=spec["model_path"])
    if spec["stock"]:        # plain PyTorch FSDP2 as a user writes it: HF's own gradient checkpointing
        if spec["activation_checkpointing"] != "none":
            models.hf_checkpointing(hf)
    else:
        models.checkpoint_layers(hf, spec["activation_checkpointing"])
    if spec.get("fp8"):
        _float8_linears(hf)
    if spec.get("compile"):
        models.compile_layers(hf)
    module = models.CausalLM(hf, loss=spec["loss"])
    bf16 = spec["precision"] == "bf16"
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else \
        MixedPrecisionPolicy()
    # Offloaded shards live on the host; pinned host memory only means something next to a GPU.
    offload = CPUOffloadPolicy(pin_memory=device.type == "cuda") if found["offload"] == "cpu" else OffloadPolicy()
    for layer in models.decoder_layers(hf):
        fully_shard(layer, mesh=mesh, mp_policy=policy, offload_policy=offload,
                    reshard_after_forward=found["reshard_after_forward"])
    # The root keeps FSDP2's default (gathered through backward: backward needs the head first).
    fully_shard(module, mesh=mesh, mp_policy=policy, offload_policy=offload)
    for name, param in module.named_parameters():   # what FSDP2 promises: fp32 shards, one dim-0 slice per rank
        assert param.dtype == torch.float32 and param.placements[-1].is_shard(0), (name, param.placements)

    # The optimizer comes after sharding: fully_shard replaced every parameter by a sharded DTensor, and an
    # optimizer built earlier would hold (and update) the old, unsharded tensors that training no longer uses.
    params = dict(ds_config.get("optimizer", {}).get("params", {}))
    for key in ("torch_adam", "adam_w_mode"):
        params.pop(key, None)
    params.setdefault("fused", device.type == "cuda")   # torch's fused AdamW runs on CUDA and on the host
    optimizer = torch.optim.AdamW(module.parameters(), **params)
    scheduler = None
    if "scheduler" in ds_config:
        from deepspeed.runtime import lr_schedules

        scheduler = getattr(lr_schedules, ds_config["scheduler"]["type"])(optimizer, **ds_config["scheduler"]["params"])
    engine = Fsdp2Engine(module, optimizer, scheduler, ds_config.get("gradient_clipping"), found)
    engine.accumulation, engine._micro = ds_config["gradient_accumulation_steps"], 0
    return engine


def device_mesh(device_type: str, world_size: int, replicas: int):
    """1-D (every rank one shard) or 2-D (replicas x shard group): FSDP2 reads a 2-D mesh as HSDP."""
    from torch.distributed.device_mesh import init_device_mesh

    if replicas == 1:
        return init_device_mesh(device_type, (world_size,), mesh_dim_names=("shard",))
    return init_device_mesh(device_type, (replicas, world_size // replicas), mesh_dim_names=("replicate", "shard"))


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1
