"""fp16 dynamic loss scaling as DeepSpeed does it, run on a CPU with DeepSpeed's own scaler.

DeepSpeed's fp16 engine runs only on GPUs, but its scaler (deepspeed/runtime/fp16/loss_scaler.py) is plain
Python. `deepspeed_scaler` builds it from a config's "fp16" section through DeepSpeed's own config class and the
same `CreateLossScaler` call its ZeRO optimizers make; `train_steps` drives it with real gradients of the tiny
model, step by step as the fp16 engine does: scale the loss, backward, store the gradients in fp16, check them
for inf/nan, then either unscale and step or skip the step, and let the scaler update its scale.

    from labs.course import loss_scaling
    scaler = loss_scaling.deepspeed_scaler({"enabled": True, "loss_scale": 0, "loss_scale_window": 4})
    records = loss_scaling.train_steps(fp16_section, steps=20, spikes=(4, 9))
"""
from __future__ import annotations

import contextlib
import logging

import torch
import torch.distributed as dist

from labs import data, launch, models, resolve
from labs.errors import LabsError

SPIKE = 1000.0        # an injected overflow: this batch's loss (so its gradients) x 1000 before the scaled backward


def one_rank_group():
    """A world-size-1 gloo group in this process: the scaler asks DeepSpeed's comm layer for the rank before it
    logs. A private in-memory store, so nothing is read from or written to the environment."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")


def deepspeed_scaler(fp16_section: dict):
    """DeepSpeed's loss scaler for a config's "fp16" section, made as DeepSpeed's ZeRO optimizers make it
    (stage_1_and_2.py, stage3.py): static scale `loss_scale`, dynamic when it is 0, with the dynamic arguments
    DeepSpeed's config class derives from initial_scale_power, loss_scale_window, hysteresis, min_loss_scale."""
    from deepspeed.runtime.fp16.loss_scaler import CreateLossScaler
    from deepspeed.runtime.precision_config import get_float16_config
    from pydantic import ValidationError

    if not isinstance(fp16_section, dict) or fp16_section.get("enabled") is not True:
        raise LabsError('config key \'fp16.enabled\' must be true for a loss scaler: '
                        '{"enabled": true, "loss_scale": 0, ...}')
    try:
        config = get_float16_config({"fp16": fp16_section})
    except ValidationError as error:
        first = error.errors()[0]
        key = ".".join(["fp16", *map(str, first["loc"])])
        raise LabsError(f"config key '{key}': {first['msg'].removeprefix('Value error, ')}") from None
    one_rank_group()
    return CreateLossScaler(dtype=torch.float16, static_loss_scale=config.loss_scale,
                            dynamic_scaling=config.loss_scale == 0, dynamic_loss_args=config.dynamic_loss_scale_args())


@contextlib.contextmanager
def deepspeed_log():
    """DeepSpeed's own log lines (its logger at INFO) collected in a list while the block runs."""
    from deepspeed.utils import logger

    lines, level = [], logger.level

    class Collect(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    handler = Collect(logging.INFO)
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def drive(scaler, overflows) -> list[dict]:
    """Feed the scaler a sequence of overflow verdicts, nothing else: the scale each step ran at, whether it was
    skipped, the hysteresis left after it. DeepSpeed stops a run (raises) when an overflow arrives at the minimum
    scale; that step is recorded with stopped=True and the sequence ends there."""
    history = []
    for step, overflow in enumerate(overflows, start=1):
        row = dict(step=step, scale=scaler.cur_scale, overflow=bool(overflow), stopped=False)
        try:
            scaler.update_scale(bool(overflow))
        except Exception as error:                  # DeepSpeed raises a bare Exception at the floor
            history.append(dict(row, stopped=True, message=str(error)))
            break
        history.append(dict(row, hysteresis=scaler.cur_hysteresis, next_scale=scaler.cur_scale))
    return history


def train_steps(fp16_section: dict, steps: int, spikes=(), preset="tiny", seq_len=64, micro_batch=1,
                lr=None, seed=0) -> dict:
    """Train the preset for `steps` steps with DeepSpeed's scaler, as the fp16 engine does each step:
    loss x scale -> backward -> gradients stored in fp16 (the engine's gradient buffers) -> DeepSpeed's
    has_inf_or_nan -> on overflow skip the step, else unscale in fp32, clip to 1.0 and step AdamW on the fp32
    weights -> scaler.update_scale(overflow). `spikes`: steps whose loss is multiplied by SPIKE first (an
    injected overflow). Forward and backward run in fp32 here: this CPU's fp16 matrix multiply is far slower,
    and the gradients' fp16 storage is where loss scaling acts. Returns the step records and DeepSpeed's log."""
    from deepspeed.runtime.utils import has_inf_or_nan

    scaler = deepspeed_scaler(fp16_section)
    model = models.CausalLM(models.build(preset, dtype=torch.float32, device=torch.device("cpu"), seed=seed))
    params = [p for p in model.parameters() if p.requires_grad]
    lr = lr if lr is not None else resolve.run_defaults(preset)["lr"]
    optimizer = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)  # as zero3.json
    batches = data.rank_batches(data.pack(data.corpus_tokens(), seq_len), micro_batch, 0, 1, seed)
    records = []
    with deepspeed_log() as log:
        for step in range(1, steps + 1):
            scale, before = scaler.cur_scale, params[0].detach().clone()     # the embedding: 99% of 'tiny'
            loss = model(next(batches))
            scaler.backward(loss * SPIKE if step in spikes else loss)       # DeepSpeed's scale-then-backward
            grads = [p.grad.to(torch.float16) for p in params]              # what an fp16 engine stores
            bad = [has_inf_or_nan(g) for g in grads]
            overflow = any(bad)
            finite = [g.float().abs().max() for g, b in zip(grads, bad) if not b]
            if not overflow:
                for p, g in zip(params, grads):
                    p.grad = g.float() / scale
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scaler.update_scale(overflow)
            records.append(dict(step=step, loss=float(loss.detach()), scale=scale, spike=step in spikes,
                                overflow=overflow,
                                weights_changed=not torch.equal(before, params[0].detach()),
                                largest_scaled_grad=float(max(finite)) if finite else float("nan"),
                                hysteresis=scaler.cur_hysteresis, next_scale=scaler.cur_scale))
    return dict(records=records, log=list(log), lr=lr, fp16=dict(fp16_section))


def first_gradients(preset="tiny", seq_len=64, micro_batch=1, seed=0) -> torch.Tensor:
    """All fp32 gradients of the preset's first batch (the loss unscaled), flattened into one tensor."""
    model = models.CausalLM(models.build(preset, dtype=torch.float32, device=torch.device("cpu"), seed=seed))
    batch = next(data.rank_batches(data.pack(data.corpus_tokens(), seq_len), micro_batch, 0, 1, seed))
    model(batch).backward()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def engine_run(config_path, out, steps=20) -> tuple:
    """The real fp16 engine: a labs run of the tiny preset with an fp16 config, where a GPU exists.
    Returns (Run, steps DeepSpeed skipped) on a GPU host; (None, why not) without one, from labs' own check."""
    if not torch.cuda.is_available():
        try:
            launch.prepare(preset="tiny", config=config_path, steps=steps)
        except LabsError as error:
            return None, str(error)
        return None, "no GPU here"
    run = launch.run(preset="tiny", config=config_path, steps=steps, out=out, stream=False)
    skipped = [r["step"] for r in run.metrics if r.get("grad_norm") is not None
               and not torch.isfinite(torch.tensor(r["grad_norm"]))]
    return run, skipped
