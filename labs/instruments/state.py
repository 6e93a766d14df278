"""What a DeepSpeed engine really holds on this rank: walk its tensors and add up their bytes.

    labs.instruments.state.engine_state_bytes(engine) -> {"params_bytes": ..., "grads_bytes": ..., "optimizer_bytes": ...,
                                             "by_device": {"params": {"cuda": ..., "cpu": ...}, ...}, ...}

The `StateBytes` instrument calls it on every rank right after the run's last backward, before that step's
optimizer update: the moment when parameters, gradients and optimizer states all exist (the optimizer states
since the first step, so a run needs at least 2 steps). The list (one dict per rank) lands in
summary["state_bytes"].

Bytes are counted per storage, once: tied embeddings share one; ZeRO-1/2 parameters are views into one
flat buffer; ZeRO-3's `ds_tensor`s are views into one flat partition; a gradient view into a bigger buffer
counts the whole buffer (that memory is held). Tensors on the meta device hold no memory and are skipped.
"""
from __future__ import annotations

import re

import torch

from labs.train import Instrument

CATEGORIES = ("params", "grads", "optimizer", "other")
MOMENT = "after the last backward, before its optimizer step"


class StateBytes(Instrument):
    name = "state_bytes"

    def __init__(self):
        self.found = None

    def last_backward(self, engine):
        self.found = engine_state_bytes(engine)

    def summary(self) -> dict:
        return self.found


def engine_state_bytes(engine) -> dict:
    """Bytes of parameters, gradients and optimizer states on this rank, split by device (cuda / cpu)."""
    ledger = _Ledger()
    wrapper = getattr(engine, "optimizer", None)
    basic = getattr(wrapper, "optimizer", wrapper)             # DeepSpeed's wrapper around torch's optimizer
    for name, p in getattr(engine, "module", engine).named_parameters():    # 1. the model's own tensors
        ledger.add(getattr(p, "ds_tensor", None), "params", f"{name}.ds_tensor")
        ledger.add(getattr(p, "ds_secondary_tensor", None), "params", f"{name}.ds_secondary_tensor")  # ZeRO++ hpZ
        ledger.add(p.data, "params", name)
        ledger.add(p.grad, "grads", f"{name}.grad")
        # ZeRO-1/2's link to the master weights: a view of the flat buffer, or a copy (ZenFlow before labs' fix)
        ledger.add(getattr(getattr(p, "_hp_mapping", None), "lp_fragment", None), "params", f"{name}.lp_fragment")
    for group in getattr(basic, "param_groups", []):           # 2. fp32 master weights and their grads
        for i, p in enumerate(group["params"]):
            ledger.add(p.data, "optimizer", f"optimizer master[{i}]")
            ledger.add(p.grad, "grads", f"optimizer master[{i}].grad")
    for state in getattr(basic, "state", {}).values():        # 3. Adam's exp_avg, exp_avg_sq (and step)
        for key, value in state.items():
            ledger.add(value, "optimizer", f"optimizer state {key}")
    if wrapper is not None and wrapper is not basic:          # 4. the wrapper's own buffers, by name
        for name, value in vars(wrapper).items():
            ledger.walk(value, _category(name), name)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    stage = getattr(engine, "zero_optimization_stage", lambda: None)()
    result = dict(rank=rank, world_size=world, zero_stage=stage,
                  optimizer_class=type(wrapper).__name__, moment=MOMENT, by_device=ledger.by_device(),
                  largest=ledger.largest(12))
    for category in CATEGORIES:
        result[f"{category}_bytes"] = sum(result["by_device"][category].values())
    result["total_bytes"] = sum(result[f"{c}_bytes"] for c in CATEGORIES)
    return result


def _category(attribute: str) -> str:
    """DeepSpeed's optimizer wrappers name their buffers after what they hold (stage_1_and_2.py, stage3.py,
    bf16_optimizer.py, fp16/*.py): *grad* and ipg buckets are gradients, *fp32* the master weights,
    *bit16* / *fp16* / *param* the low-precision parameters."""
    name = attribute.lower()
    if re.search(r"grad|ipg", name):
        return "grads"
    if "fp32" in name:
        return "optimizer"
    if re.search(r"bit16|fp16|bf16|param", name):
        return "params"
    return "other"


class _Ledger:
    def __init__(self):
        self.rows, self.seen, self.visited = [], set(), set()

    def add(self, tensor, category, where):
        if hasattr(tensor, "to_local"):                        # a DTensor (FSDP2): this rank's shard
            tensor = tensor.to_local()
        if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
            return
        storage = tensor.untyped_storage()
        key = (tensor.device.type, tensor.device.index, storage.data_ptr())
        if storage.nbytes() == 0 or key in self.seen:
            return
        self.seen.add(key)
        self.rows.append(dict(what=where, category=category, device=tensor.device.type, dtype=str(tensor.dtype),
                              bytes=storage.nbytes()))

    def walk(self, value, category, where, depth=0):
        """Tensors inside lists, dicts and DeepSpeed's small helper objects (buckets), a few levels deep."""
        if depth > 4 or id(value) in self.visited:
            return
        self.visited.add(id(value))
        if isinstance(value, torch.Tensor):
            self.add(value, category, where)
            self.add(value.grad, "grads", f"{where}.grad")
        elif isinstance(value, dict):
            for key, item in value.items():
                self.walk(item, category, f"{where}[{key if isinstance(key, (str, int)) else '.'}]", depth + 1)
        elif isinstance(value, (list, tuple, set)):
            for i, item in enumerate(value):
                self.walk(item, category, f"{where}[{i}]", depth + 1)
        elif type(value).__module__.startswith("deepspeed") and hasattr(value, "__dict__") and \
                not isinstance(value, (torch.nn.Module, torch.optim.Optimizer)):
            for key, item in vars(value).items():
                self.walk(item, category, f"{where}.{key}", depth + 1)

    def by_device(self) -> dict:
        table = {c: {} for c in CATEGORIES}
        for row in self.rows:
            table[row["category"]][row["device"]] = table[row["category"]].get(row["device"], 0) + row["bytes"]
        return table

    def largest(self, n) -> list:
        return sorted(self.rows, key=lambda r: -r["bytes"])[:n]
