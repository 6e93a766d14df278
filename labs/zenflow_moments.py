"""A fix for DeepSpeed 0.19.8's ZenFlow: its CPU Adam, which updates every weight every `update_interval` steps, keeps
two sets of moments, each fed every other update, and corrects their bias by the training step's number.

Adam's moments are running averages that start at zero: after n updates the first holds (1 - beta1**n) of the mean
gradient, and Adam divides by that factor ("bias correction"), with n the number of updates the average has seen.

- Two sets. With the overlapped step (`zenflow.overlap_step: true`) the optimizer process allocates exp_avg and
  exp_avg_sq twice per partition (runtime/zenflow/zenflow_utils.py `zenflow_optimizer_process`) and its native step
  (ops/csrc/adam/cpu_adam_impl.cpp `ZenFlowAdam::run_step`) uses set `now_state`, the same index as the gradient
  buffer it reads, which alternates from one update to the next so that the GPU can fill one buffer while the CPU
  reads the other. The gradient buffers need two copies; the moments do not (only the optimizer process touches
  them, one update after the other). So each set averages every other update's gradient and sees half the
  updates, and the process holds 16 bytes per parameter of moments where Adam needs 8 (24.7 GB on Qwen2.5-3B).
  ZenFlow without the overlap (ops/adam/zenflow_cpu_adam.py `_sequential_step`) keeps one set.
- The count. Both paths pass the training step's number (`micro_step + 1`: 4, 8, 12, ... at interval 4) as Adam's
  step, while the moments are updated once per `update_interval` steps: the first update divides the moments by
  factors made for 4 updates. For a steady gradient and betas (0.9, 0.95), Adam moves each weight by the learning
  rate at every update; this count moves it by 0.56 of it at the first update, 0.73 at the fourth and 1.07 at the
  sixteenth: both moments are under-corrected, the second more, so the step first falls short, then overshoots.

labs keeps one set of moments, handed to the native step as both sets (`optimizer_process`), and passes the number
of updates made so far as the step: the overlapped path through the training side's handle on the native op
(`CountedSubmit`), the sequential path in its own step (`sequential_step`, per parameter, as torch's Adam counts).
Measured on the tiny model on a CPU (tools/zenflow_moments_loss.py, results/cpu/zenflow_moments): each change
lowers ZenFlow's loss, one at a time. On one H200 (round 19, the 3B shape) the optimizer process held 23.3 GiB of
private memory with one set against 46.3 GiB with two, as labs.memory predicts (23.0 and 46.0 GiB of moments), and
the loss over steps 49-64 was 0.05 nats lower (results/gpu/zenflow_finetune_1xh200/round19).
The moments still live only in the optimizer process: a checkpoint does not hold them (as with DeepSpeed), and a
resumed run starts them, and the count, from zero, which is consistent (DeepSpeed's count would resume high).
"""
from __future__ import annotations

import os
import sys

import torch

from labs.zenflow_host import source_sha256

# DeepSpeed 0.19.8's sources (Apache-2.0), hashed as labs.zenflow_host hashes: what the functions below replace or
# rely on (the two steps that submit `micro_step + 1` as the step, and the process that allocates two sets).
PROCESS_SHA256 = "7c923187afbe41cc"
START_SHA256 = "1d3dc0445e7c3874"
SUBMIT_STEP_SHA256 = {"zero12": "9eca9aa956b7efba", "zero3": "32900f39e246db42"}
SEQUENTIAL_STEP_SHA256 = "1e6f46846492fafb"


def optimizer_process(groups, ctrl, ready, zf_affinity, adamw_mode):
    """zenflow_utils.zenflow_optimizer_process with one set of Adam moments per partition, registered as both of the
    native step's sets: whichever gradient buffer an update reads, it updates the same moments."""
    import psutil
    from deepspeed.ops.op_builder import CPUAdamBuilder
    from deepspeed.runtime.zenflow.zenflow_utils import disable_accelerator

    disable_accelerator()
    psutil.Process().cpu_affinity(zf_affinity)
    os.environ['OMP_NUM_THREADS'] = str(len(zf_affinity))
    op = CPUAdamBuilder().load()
    op.create_adam(0, 1e-3, 0.9, 0.999, 1e-8, 0.0, adamw_mode, False)
    handle = op.zenflow_adam_create(0, list(zf_affinity))
    for param, overlap_grad0, overlap_grad1, stale in groups:
        exp_avg, exp_avg_sq = torch.zeros_like(param), torch.zeros_like(param)
        op.zenflow_adam_register_group(handle, param, overlap_grad0, overlap_grad1, exp_avg, exp_avg, exp_avg_sq,
                                       exp_avg_sq, stale)
    ready.set()
    op.zenflow_adam_run_worker(handle, ctrl.data_ptr())
    op.zenflow_adam_destroy(handle)
    op.destroy_adam(0)


class CountedSubmit:
    """DeepSpeed's cpu_adam op as ZenFlow's training side holds it (`zf_op`), with the step that
    `zenflow_adam_submit` hands the optimizer process replaced by the number of updates submitted so far (1, 2, ...):
    DeepSpeed passes the training step's number there. Everything else goes to the op unchanged."""

    def __init__(self, op):
        self._op = op
        self.updates = 0

    def zenflow_adam_submit(self, control_ptr, now_state, engine_step, *hyperparameters):
        self.updates += 1
        return self._op.zenflow_adam_submit(control_ptr, now_state, self.updates, *hyperparameters)

    def __getattr__(self, name):
        return getattr(self._op, name)


@torch.no_grad()
def sequential_step(self, step_id, closure=None):
    """ZenFlowCPUAdam._sequential_step (ZenFlow without the overlap) with Adam's step counted per parameter, one per
    update, instead of set to `step_id`, the training step's number."""
    loss = None
    if closure is not None:
        with torch.enable_grad():
            loss = closure()
    for group in self.param_groups:
        for p in group['params']:
            if p.grad is None:
                continue
            assert p.device == torch.device('cpu'), f"CPUAdam param is on {p.device} and must be 'cpu'"
            state = self.state[p]
            if len(state) == 0:
                state_dtype = torch.float if self.fp32_optimizer_states else p.dtype
                state['step'] = 0
                state['exp_avg'] = torch.zeros_like(p.data, dtype=state_dtype)
                state['exp_avg_sq'] = torch.zeros_like(p.data, dtype=state_dtype)
            state['step'] += 1
            beta1, beta2 = group['betas']
            self.ds_opt_adam.adam_update(self.opt_id, state['step'], group['lr'], beta1, beta2, group['eps'],
                                         group['weight_decay'], group['bias_correction'], p.data, p.grad.data,
                                         state['exp_avg'], state['exp_avg_sq'])
    return loss


def _counting(start):
    """start_optimizer_process (DeepSpeed's, or labs.zenflow_host's around it), then the op's handle counted."""
    def start_optimizer_process(zf_optimizer):
        found = start(zf_optimizer)
        zf_optimizer.zf_op = CountedSubmit(zf_optimizer.zf_op)
        return found
    return start_optimizer_process


def install() -> None:
    """One set of moments and counted updates for ZenFlow's CPU Adam, overlapped (ZeRO-1/2 and ZeRO-3) and
    sequential. Only where DeepSpeed's sources are the ones described here (0.19.8); otherwise it says so and changes
    nothing. Call after labs.zenflow_host.install (whose wrapper of start_optimizer_process it wraps). Idempotent."""
    from deepspeed.ops.adam.zenflow_cpu_adam import ZenFlowCPUAdam
    from deepspeed.runtime.zenflow import engine_stage3, zenflow_stage_1_and_2, zenflow_utils

    if zenflow_utils.zenflow_optimizer_process is optimizer_process:
        return
    found = (source_sha256(zenflow_utils.zenflow_optimizer_process),
             source_sha256(zenflow_utils.start_optimizer_process),
             source_sha256(zenflow_stage_1_and_2.ZenFlowZeroOptimizerParallel.zenflow_cpu_optimizer_step),
             source_sha256(engine_stage3.zenflow_cpu_optimizer_overlap_step),
             source_sha256(ZenFlowCPUAdam._sequential_step))
    if found != (PROCESS_SHA256, START_SHA256, SUBMIT_STEP_SHA256["zero12"], SUBMIT_STEP_SHA256["zero3"],
                 SEQUENTIAL_STEP_SHA256):
        print("labs: this DeepSpeed's ZenFlow CPU Adam is not the one labs.zenflow_moments describes (0.19.8's): its "
              "moments and step count are left as they are", file=sys.stderr, flush=True)
        return
    zenflow_utils.zenflow_optimizer_process = optimizer_process
    ZenFlowCPUAdam._sequential_step = sequential_step
    for module in (zenflow_stage_1_and_2, engine_stage3):
        module.start_optimizer_process = _counting(module.start_optimizer_process)
