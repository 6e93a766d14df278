"""PyTorch FSDP2 (`fully_shard`) behind the same interface as a DeepSpeed engine, driven by the same JSON config,
so `labs.train` runs one loop for both and the chapters can compare them on equal terms.

Mapping from the DeepSpeed config: bf16.enabled -> MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) with
fp32 sharded master parameters (what DeepSpeed's bf16 + ZeRO-3 keeps too); optimizer.params -> torch AdamW
(fused on GPU); scheduler -> the very same DeepSpeed scheduler class; gradient_clipping -> clip_grad_norm_.
Every decoder layer is one FSDP unit; the wrapper (embedding, final norm, head, loss) is the root unit.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from labs import models


class Fsdp2Engine:
    def __init__(self, module, optimizer, scheduler, clip):
        self.module, self.optimizer, self.scheduler, self.clip = module, optimizer, scheduler, clip
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
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    mesh = torch.distributed.device_mesh.init_device_mesh(device.type, (dist.get_world_size(),))
    # Built whole in fp32 on the device (FSDP2 keeps fp32 shards and casts per layer for compute), with the same
    # seed and init order as the DeepSpeed engines, then sharded: simple, and fine while one model fits one
    # device's memory for a moment (7B fp32: 30 GB). Larger models would start on the meta device instead.
    hf = models.build(spec["preset"], dtype=torch.float32, device=device, seed=spec["seed"],
                      model_path=spec["model_path"])
    if spec["stock"]:        # plain PyTorch FSDP2 as a user writes it: HF's own gradient checkpointing
        if spec["activation_checkpointing"] != "none":
            hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
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
    for layer in models.decoder_layers(hf):
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(module, mesh=mesh, mp_policy=policy)
    for name, param in module.named_parameters():   # what FSDP2 promises: fp32 shards, one dim-0 slice per rank
        assert param.dtype == torch.float32 and param.placements[0].is_shard(0), (name, param.placements)

    params = dict(ds_config.get("optimizer", {}).get("params", {}))
    for key in ("torch_adam", "adam_w_mode"):
        params.pop(key, None)
    params.setdefault("fused", device.type == "cuda")
    optimizer = torch.optim.AdamW(module.parameters(), **params)
    scheduler = None
    if "scheduler" in ds_config:
        from deepspeed.runtime import lr_schedules

        scheduler = getattr(lr_schedules, ds_config["scheduler"]["type"])(optimizer, **ds_config["scheduler"]["params"])
    engine = Fsdp2Engine(module, optimizer, scheduler, ds_config.get("gradient_clipping"))
    engine.accumulation, engine._micro = ds_config["gradient_accumulation_steps"], 0
    return engine
