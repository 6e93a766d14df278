"""fp16 dynamic loss scaling as DeepSpeed does it, run on a CPU with DeepSpeed's own scaler.

labs runs DeepSpeed's fp16 engine only on GPU ranks (DeepSpeed's CPU accelerator offers fp16 only where oneDNN
supports it on the processor: `deepspeed_fp16_support`), but the scaler (deepspeed/runtime/fp16/loss_scaler.py) is
plain Python. `deepspeed_scaler` builds it from a config's "fp16" section through DeepSpeed's own config class and the
same `CreateLossScaler` call its ZeRO optimizers make; `train_steps` drives it with real gradients of the tiny
model, step by step as the fp16 engine does: scale the loss, backward, store the gradients in fp16, check them
for inf/nan, then either unscale and step or skip the step, and let the scaler update its scale.

    from labs.course import loss_scaling
    scaler = loss_scaling.deepspeed_scaler({"enabled": True, "loss_scale": 0, "loss_scale_window": 4})
    records = loss_scaling.train_steps(fp16_section, steps=20, spikes=(4, 9))
    loss_scaling.last_cycle(loss_scaling.steady_state(fp16_section, limit=2 ** 17, steps=5000))
"""
from __future__ import annotations

import contextlib
import importlib
import logging
import tempfile
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist

from labs import config, data, env, launch, models, resolve
from labs.errors import LabsError

SPIKE = 1000.0        # an injected overflow: this batch's loss (so its gradients) x 1000 before the scaled backward


def one_rank_group():
    """A world-size-1 gloo group in this process: the scaler asks DeepSpeed's comm layer for the rank before it
    logs. A private in-memory store, so nothing is read from or written to the environment. The accelerator is
    named before DeepSpeed is imported (else it warns while guessing), and DeepSpeed's shared-memory allreduce op
    is not built: it is a C++ extension compiled on first use (a minute, a compiler, and the probes of every
    optional op print linker errors), and a single rank never reduces anything."""
    env.name_deepspeed_accelerator()
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    import deepspeed

    backend = importlib.import_module("deepspeed.comm.torch")    # not `import ... as`: deepspeed.comm.torch is torch
    no_shm_op = (mock.patch.object(backend, "build_shm_op", return_value=None) if hasattr(backend, "build_shm_op")
                 else contextlib.nullcontext())
    with no_shm_op:
        deepspeed.init_distributed(dist_backend="gloo")


def deepspeed_fp16_support() -> tuple[str, bool]:
    """DeepSpeed's own answer for this machine: its accelerator's name and `is_fp16_supported()`. On a CPU that is
    true only where oneDNN reports fp16 support for the processor (deepspeed/accelerator/cpu_accelerator.py)."""
    env.name_deepspeed_accelerator()
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    return accelerator.device_name(), bool(accelerator.is_fp16_supported())


def deepspeed_scaler(fp16_section: dict):
    """DeepSpeed's loss scaler for a config's "fp16" section, made as DeepSpeed's ZeRO optimizers make it
    (stage_1_and_2.py, stage3.py): static scale `loss_scale`, dynamic when it is 0, with the dynamic arguments
    DeepSpeed's config class derives from initial_scale_power, loss_scale_window, hysteresis, min_loss_scale."""
    env.name_deepspeed_accelerator()
    from pydantic import ValidationError
    try:                                  # the scaler's interface as of DeepSpeed 0.19 (requirements.txt pins it)
        from deepspeed.runtime.fp16.loss_scaler import CreateLossScaler
        from deepspeed.runtime.precision_config import get_float16_config
    except ImportError as error:
        import deepspeed

        raise LabsError(f"DeepSpeed {deepspeed.__version__} lacks the loss-scaler interface this chapter drives "
                        f"({error}); install the pinned version: pip install -r requirements.txt") from None

    if not isinstance(fp16_section, dict) or fp16_section.get("enabled") is not True:
        raise LabsError('config key \'fp16.enabled\' must be true for a loss scaler: '
                        '{"enabled": true, "loss_scale": 0, ...}')
    try:
        checked = get_float16_config({"fp16": fp16_section})
    except ValidationError as error:
        first = error.errors()[0]
        key = ".".join(["fp16", *map(str, first["loc"])])
        raise LabsError(f"config key '{key}': {first['msg'].removeprefix('Value error, ')}") from None
    one_rank_group()
    return CreateLossScaler(dtype=torch.float16, static_loss_scale=checked.loss_scale,
                            dynamic_scaling=checked.loss_scale == 0,
                            dynamic_loss_args=checked.dynamic_loss_scale_args())


@contextlib.contextmanager
def deepspeed_log():
    """DeepSpeed's own log lines (its logger at INFO) collected in a list while the block runs."""
    env.name_deepspeed_accelerator()
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
        history.append(_update(scaler, step, bool(overflow)))
        if history[-1]["stopped"]:
            break
    return history


def steady_state(fp16_section: dict, limit: float, steps: int) -> list[dict]:
    """DeepSpeed's scaler in a run whose gradients overflow fp16 whenever the scale is above `limit` and never
    at or below it: the scale settles at the limit, tries the next power of two after each window of clean steps,
    and pays skipped steps for every failed try. The step records of `drive`."""
    scaler = deepspeed_scaler(fp16_section)
    return [_update(scaler, step, scaler.cur_scale > limit) for step in range(1, steps + 1)]


def _update(scaler, step: int, overflow: bool) -> dict:
    row = dict(step=step, scale=scaler.cur_scale, overflow=overflow, stopped=False)
    try:
        scaler.update_scale(overflow)
    except Exception as error:                      # DeepSpeed raises a bare Exception at the floor
        return dict(row, stopped=True, message=str(error))
    return dict(row, hysteresis=scaler.cur_hysteresis, next_scale=scaler.cur_scale)


def last_cycle(history: list[dict]) -> dict:
    """The last full cycle of a steady state (`steady_state`): the steps after one growth of the scale up to and
    including the next, and how many of them overflowed (and were skipped)."""
    grew = [r["step"] for r in history if r.get("next_scale", 0) > r["scale"]]
    if len(grew) < 2:
        raise LabsError("the scale grew fewer than twice: run more steps to see a full cycle")
    rows = history[grew[-2]:grew[-1]]                  # history[i] is step i + 1
    skipped = sum(r["overflow"] for r in rows)
    return dict(steps=len(rows), skipped=skipped, clean=len(rows) - skipped, skipped_share=skipped / len(rows))


def train_steps(fp16_section: dict, steps: int, spikes=(), preset="tiny", seq_len=64, micro_batch=1,
                lr=None, seed=0, progress=False) -> dict:
    """Train the preset for `steps` steps with DeepSpeed's scaler, as the fp16 engine does each step:
    loss x scale -> backward -> gradients stored in fp16 (the engine's gradient buffers) -> DeepSpeed's
    has_inf_or_nan -> on overflow skip the step, else unscale in fp32, clip to 1.0 and step AdamW on the fp32
    weights -> scaler.update_scale(overflow). `spikes`: steps whose loss is multiplied by SPIKE first (an
    injected overflow). Forward and backward run in fp32 here: a CPU without fp16 arithmetic multiplies fp16
    matrices far more slowly (`precision.matmul_ms` times it), and the gradients' fp16 storage is where loss scaling
    acts. The learning rate is constant (a labs run warms
    up from 0, so its first steps would leave the weights unchanged without any overflow). Each record has the
    loss of that step's own batch and, after the step, the loss on one fixed batch the model never trains on.
    `progress`: show the step reached (`progress_line`). Returns the step records and DeepSpeed's log."""
    env.name_deepspeed_accelerator()
    from deepspeed.runtime.utils import has_inf_or_nan

    scaler = deepspeed_scaler(fp16_section)
    model = models.CausalLM(models.build(preset, dtype=torch.float32, device=torch.device("cpu"), seed=seed))
    params = [p for p in model.parameters() if p.requires_grad]
    lr = lr if lr is not None else resolve.run_defaults(preset)["lr"]
    optimizer = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)  # as zero3.json
    batches = data.rank_batches(data.pack(data.corpus_tokens(), seq_len), micro_batch, 0, 1, seed)
    batches = [next(batches) for _ in range(steps + 1)]
    probe = batches.pop()                                                # the batch after the last one trained on
    records, show = [], progress_line(steps) if progress else None
    with deepspeed_log() as log:
        for step in range(1, steps + 1):
            scale, before = scaler.cur_scale, params[0].detach().clone()     # the embedding: 99% of 'tiny'
            loss = model(batches[step - 1])
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
            with torch.no_grad():
                probe_loss = float(model(probe))
            records.append(dict(step=step, loss=float(loss.detach()), probe_loss=probe_loss, scale=scale,
                                spike=step in spikes, overflow=overflow,
                                weights_changed=not torch.equal(before, params[0].detach()),
                                largest_scaled_grad=float(max(finite)) if finite else float("nan"),
                                hysteresis=scaler.cur_hysteresis, next_scale=scaler.cur_scale))
            if progress:
                show(step)
    return dict(records=records, log=list(log), lr=lr, fp16=dict(fp16_section))


def progress_line(steps: int):
    """A function of the step that shows progress: in a notebook one line updated in place (stored once, in its
    last state), elsewhere a dot per step."""
    try:
        from IPython import get_ipython
        from IPython.display import display
    except ImportError:                                  # labs installed without Jupyter
        get_ipython = lambda: None                       # noqa: E731
    if get_ipython() is None:
        return lambda step: print("." + (f" {steps} steps\n" if step == steps else ""), end="", flush=True)
    handle = display({"text/plain": f"step 0 of {steps}"}, raw=True, display_id=True)
    return lambda step: handle.update({"text/plain": f"step {step} of {steps}"}, raw=True)


def first_gradients(preset="tiny", seq_len=64, micro_batch=1, seed=0) -> dict[str, torch.Tensor]:
    """The fp32 gradients of the preset's first batch (the loss unscaled), flattened, in two groups: the input
    embedding (tied to the output head in 'tiny') and everything else (the decoder layers and the final norm)."""
    model = models.CausalLM(models.build(preset, dtype=torch.float32, device=torch.device("cpu"), seed=seed))
    batch = next(data.rank_batches(data.pack(data.corpus_tokens(), seq_len), micro_batch, 0, 1, seed))
    model(batch).backward()
    groups = {"embedding": [], "rest": []}
    for name, p in model.named_parameters():
        if p.grad is not None:
            groups["embedding" if "embed_tokens" in name or "lm_head" in name else "rest"].append(p.grad.flatten())
    return {group: torch.cat(grads) for group, grads in groups.items()}


def engine_run(fp16_config: dict, out, steps=20) -> tuple:
    """The real fp16 engine: a labs run of the tiny preset with an fp16 config, where a GPU exists (the config
    is written into `out`'s parent folder). Returns (Run, steps DeepSpeed skipped) on a GPU host; (None, why not)
    without one, from labs' own check of a copy written to a temporary folder (nothing kept)."""
    if not torch.cuda.is_available():
        with tempfile.TemporaryDirectory() as folder:
            try:
                launch.prepare(preset="tiny", config=config.write(fp16_config, Path(folder) / "fp16.json"),
                               steps=steps)
            except LabsError as error:
                return None, str(error)
        return None, "no GPU here"
    path = config.write(fp16_config, Path(out).parent / f"{Path(out).name}_ds_config.json")
    run = launch.run(preset="tiny", config=path, steps=steps, out=out, stream=False)
    skipped = [r["step"] for r in run.metrics if r.get("grad_norm") is not None
               and not torch.isfinite(torch.tensor(r["grad_norm"]))]
    return run, skipped
