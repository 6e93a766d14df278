"""A fix for DeepSpeed 0.19.8's ZenFlow under ZeRO-1/2: the columns it updates on the GPU do not train at a fine-tuning
learning rate, because it updates them in bf16 with no fp32 master.

ZenFlow splits each step. The top-k columns of every matrix (by gradient size), and every vector (norms, biases), are
updated on the GPU at every step by its selective optimizer (ops/adam/zenflow_torch_adam.py: `group_step`,
`_step_without_offload`). That optimizer runs AdamW on `param.data[:, selected_indices]`: the bf16 weights
themselves, with bf16 moments. Everything else waits for the CPU's fp32 update every `update_interval` steps. The CPU
updates the chosen columns too, but DeepSpeed throws that result away: it copies the GPU's bf16 values back over them
after every CPU update (`temp_copy_param`). So the chosen columns live in bf16 only. An AdamW step moves a weight by
about the learning rate, and at 1e-5 that is under half a bf16 step for any weight above 2**-8 in size (at 0.02 a
bf16 step is 1.2e-4). The step rounds back to the same bf16 value, and the weight never moves. On the tiny model on
a CPU (lr 1e-5, 32 steps), 15.5% of the chosen columns' elements moved, against 96.8% of the same elements without
ZenFlow. Those are the columns with the largest gradients, and they are the ones that stand still.

The fix gives the chosen columns an fp32 master on the GPU (`fp32_columns`) and fp32 moments. The selective
optimizer's two steps become one function that runs AdamW on those masters and writes them to the bf16 weights,
rounded once. When the columns are chosen again, the refresh of the CPU's master partition (`sync_fp32_param_from_gpu`)
writes only what the GPU owned, the old chosen columns and the vectors, exactly in fp32. DeepSpeed (and
labs.zenflow_host) copy the whole bf16 partition there, rounding every weight the CPU had been moving.
A column chosen again keeps its fp32 master. A newly chosen column starts from its bf16 weight, which every rank
holds alike. Every rank runs the same update on the same values, so all ranks keep identical copies. Seeding from
the CPU's master would not: each rank holds only its own part of it.

Cost on the GPU: 12 bytes per chosen element (master and two moments, all fp32), where DeepSpeed keeps 4 (two bf16
moments); like DeepSpeed's moments, every rank holds them for every chosen column (they are not partitioned).
labs.memory counts it.

A checkpoint saves the host's master partition, where the chosen columns hold the CPU's discarded values; labs writes
the GPU's masters there first (`state_dict`), so a checkpoint and `labs export` hold the columns the GPU trained.

Limits: with the overlapped step, the refresh at a new choice (step 5 at interval 4) runs while the optimizer process
is still applying the update submitted one step before, slice by slice, to the same partition. labs writes the GPU's
masters into the partition and into the copy the process hands back (`stale_param`). Where the process reaches a
slice after that write, those columns get that update's gradient on top of the GPU's, which already applied it: one
update counted twice, for the columns leaving the choice. DeepSpeed's own refresh has the same race. A checkpoint
saved while an update runs has it too (DeepSpeed saves the partition the process is writing). With
`zenflow.offload: true` (moments on the host) DeepSpeed's own steps stay, and labs says so.
"""
from __future__ import annotations

import sys

import torch

from labs.zenflow_host import source_sha256

_MASTER = "_labs_fp32_columns"        # the fp32 master of a parameter's chosen columns (or of a whole vector)
_CHOSEN = "_labs_fp32_columns_for"    # the selected_indices tensor that master was made for

# DeepSpeed 0.19.8's sources (Apache-2.0), hashed as labs.zenflow_host hashes: what the functions below replace.
GROUP_STEP_SHA256 = "5fcdff8ae931c251"
STEP_SHA256 = "40fae3cd4f38fa7b"


def fp32_columns(param: torch.Tensor) -> torch.Tensor:
    """The fp32 master of what the GPU updates in `param`. A vector gets all of its elements; a matrix gets the columns
    in `param.selected_indices`, shaped like `param.data[:, selected_indices]`. Made from the bf16 weights when the
    columns change, and columns chosen before keep their fp32 values. At a step that ends an update round the CPU's
    result has already been copied over every weight; DeepSpeed's snapshot from before that copy
    (`temp_selected_param`) is then what the GPU's columns held, and it is what a new master starts from."""
    before_cpu = getattr(param, "temp_selected_param", None)
    if param.dim() == 1:
        if getattr(param, _MASTER, None) is None:
            setattr(param, _MASTER, (param.data if before_cpu is None else before_cpu).float())
        return getattr(param, _MASTER)
    chosen, old, old_chosen = param.selected_indices, getattr(param, _MASTER, None), getattr(param, _CHOSEN, None)
    if old is not None and old_chosen is chosen:
        return old
    master = (param.data[:, chosen] if before_cpu is None else before_cpu).float()
    if old is not None:
        where_before = torch.full((param.shape[1],), -1, dtype=torch.long, device=chosen.device)
        where_before[old_chosen] = torch.arange(old_chosen.numel(), device=chosen.device)
        before = where_before[chosen]
        kept = before >= 0
        master[:, kept] = old[:, before[kept]]
    setattr(param, _MASTER, master)
    setattr(param, _CHOSEN, chosen)
    return master


def step_fp32(optimizer, group: dict, params) -> None:
    """One AdamW step for the chosen columns of `params` (those with a `selected_grad`), in fp32: on each master from
    fp32_columns, with fp32 moments in the optimizer's state, at the group's hyper-parameters; then each master,
    rounded once, into the bf16 weights."""
    from deepspeed.ops.adam import zenflow_torch_adam as ds

    masters, grads, exp_avgs, exp_avg_sqs, steps, stepped = [], [], [], [], [], []
    for param in params:
        if getattr(param, "selected_grad", None) is None:
            continue
        master = fp32_columns(param)
        state = optimizer.state.setdefault(param, {})
        if len(state) == 0:
            state["step"] = torch.zeros((), dtype=torch.float32, device=master.device)
            state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(master), torch.zeros_like(master)
        assert state["exp_avg"].dtype == torch.float32, "labs.zenflow_columns: bf16 moments from another step"
        masters.append(master)
        grads.append(param.selected_grad.float())
        exp_avgs.append(state["exp_avg"])
        exp_avg_sqs.append(state["exp_avg_sq"])
        steps.append(state["step"])
        stepped.append(param)
    if not masters:
        return
    assert not group["amsgrad"], "labs.zenflow_columns: ZenFlow with amsgrad is not handled"
    beta1, beta2 = group["betas"]
    ds.adamw(masters, grads, exp_avgs, exp_avg_sqs, [], steps, amsgrad=False, beta1=beta1, beta2=beta2,
             lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)
    for param, master in zip(stepped, masters):
        if param.dim() == 1:
            param.data.copy_(master)
        else:
            param.data[:, param.selected_indices] = master.to(param.dtype)
        param.selected_grad = None
        param.temp_selected_param = None     # DeepSpeed's bf16 snapshot of them: the master replaces it


_ORIGINALS = {}       # the methods replaced, for `zenflow.offload: true` (moments on the host), which keeps them
_SAID = []


def _deepspeeds(name: str, *args):
    if not _SAID:
        _SAID.append(name)
        print("labs: ZenFlow with `offload: true` keeps DeepSpeed's bf16 steps for the chosen columns "
              "(labs.zenflow_columns handles the moments on the GPU only)", file=sys.stderr, flush=True)
    return _ORIGINALS[name](*args)


def group_step(self, group_to_paramlist):
    """ZenFlowSelectiveAdamW.group_step (the steps between two CPU updates), in fp32."""
    if self.offload:
        return _deepspeeds("group_step", self, group_to_paramlist)
    for group_id, params in group_to_paramlist.items():
        step_fp32(self, self.param_groups[group_id], params)


def step_without_offload(self):
    """ZenFlowSelectiveAdamW._step_without_offload (the step at a CPU update, after the CPU's values were copied over
    every weight), in fp32: writing the masters back is what restores the chosen columns."""
    for group in self.param_groups:
        step_fp32(self, group, group["params"])


def master_positions(param, source_offset: int, num_elements: int):
    """Where the GPU-owned values of `param` lie in a slice of the flat partition that holds its elements
    [source_offset, source_offset + num_elements) in ZenFlow's order (a matrix stored transposed: column j is the
    contiguous run j*rows .. (j+1)*rows). Returns (first column, column count, chosen columns in range, their place
    among the chosen) for a matrix; a column cut by the slice's edges is never chosen (DeepSpeed rounds inwards)."""
    rows = param.shape[0]
    first = -(-source_offset // rows)
    end = (source_offset + num_elements) // rows
    chosen = getattr(param, _CHOSEN)
    inside = (chosen >= first) & (chosen < end)
    return first, end - first, (chosen[inside] - first).long(), inside.nonzero().flatten()


def write_back(self) -> int:
    """Write the GPU's fp32 masters into this rank's fp32 master partition(s), exactly, at their places, and into the
    copy the optimizer process hands back (`stale_param`, where it exists: the overlapped step), so that the next
    copy to the GPU brings them too. Only what the GPU owned is written; every other weight keeps the CPU's value.
    Returns the elements written."""
    written = 0
    for i, params in enumerate(self.params_in_partition):
        partition = self.single_partition_of_fp32_groups[i]
        targets = [partition.data] + ([partition.stale_param.data] if hasattr(partition, "stale_param") else [])
        for param in params:
            master = getattr(param, _MASTER, None)
            if master is None:
                continue
            _, source_offset, dest_offset, num_elements = self.grad_position[self.get_param_id(param)]
            if param.dim() == 1:
                values = master.narrow(0, source_offset, num_elements).to("cpu")
                for target in targets:
                    target.narrow(0, dest_offset, num_elements).copy_(values)
                written += num_elements
                continue
            first, count, columns, places = master_positions(param, source_offset, num_elements)
            if count <= 0 or columns.numel() == 0:
                continue
            rows = param.shape[0]
            values, columns = master[:, places].t().contiguous().to("cpu"), columns.cpu()
            for target in targets:
                block = target.narrow(0, dest_offset + first * rows - source_offset, count * rows).view(count, rows)
                block.index_copy_(0, columns, values)
            written += columns.numel() * rows
    return written


def sync_fp32_param_from_gpu(self):
    """ZeRO-1/2 ZenFlow's refresh of the CPU's master partition at a step that chooses the columns again (called
    before the new choice, so `selected_indices` is still the old one): the GPU's fp32 masters only, see write_back."""
    if self.selective_optimizer.offload:
        return _deepspeeds("sync_fp32_param_from_gpu", self)
    if self.micro_step == 0:
        return
    with torch.no_grad():
        write_back(self)


def state_dict(self):
    """ZenFlowZeroOptimizer.state_dict (what a checkpoint saves), after write_back: the master partition a checkpoint
    holds, and so `labs export`, then has the chosen columns the GPU trained, not the CPU's discarded values."""
    if not self.selective_optimizer.offload:
        with torch.no_grad():
            write_back(self)
    return _ORIGINALS["state_dict"](self)


def install() -> None:
    """Give ZeRO-1/2's ZenFlow fp32 masters for its chosen columns: the selective optimizer's two steps and the refresh
    of the master partition (after labs.zenflow_host.install, whose chunked refresh this one replaces). Only where
    DeepSpeed's sources are the ones restated here (0.19.8); otherwise it says so and changes nothing. Idempotent."""
    from deepspeed.ops.adam.zenflow_torch_adam import ZenFlowSelectiveAdamW
    from deepspeed.runtime.zenflow.zenflow_stage_1_and_2 import ZenFlowZeroOptimizer

    if ZenFlowSelectiveAdamW.group_step is group_step:
        return
    if (source_sha256(ZenFlowSelectiveAdamW.group_step), source_sha256(ZenFlowSelectiveAdamW._step_without_offload)) \
            != (GROUP_STEP_SHA256, STEP_SHA256):
        print("labs: this DeepSpeed's ZenFlow selective optimizer is not the one labs.zenflow_columns restates "
              "(0.19.8's): its bf16 steps are left as they are", file=sys.stderr, flush=True)
        return
    _ORIGINALS["group_step"] = ZenFlowSelectiveAdamW.group_step
    ZenFlowSelectiveAdamW.group_step = group_step
    ZenFlowSelectiveAdamW._step_without_offload = step_without_offload
    _ORIGINALS["sync_fp32_param_from_gpu"] = ZenFlowZeroOptimizer.sync_fp32_param_from_gpu
    ZenFlowZeroOptimizer.sync_fp32_param_from_gpu = sync_fp32_param_from_gpu
    _ORIGINALS["state_dict"] = ZenFlowZeroOptimizer.state_dict
    ZenFlowZeroOptimizer.state_dict = state_dict
