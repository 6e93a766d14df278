"""Chapter 04 (mixed precision): exercises. Each asks for a prediction the chapter's rules let a reader reason out;
the expected answer comes from real casts and sums (labs.course.precision), DeepSpeed's own loss scaler
(labs.course.loss_scaling) or labs.memory, never from a typed-in number."""
from __future__ import annotations

from labs import memory, resolve
from labs.course import loss_scaling, precision, precision_costs
from labs.course.exercises.registry import exercise


@exercise("04.1", "A gradient is accumulated in a 16-bit buffer, 1.0 at a time, every partial sum stored in the "
          "format. Section 3 shows a bf16 total stopping at 256. At what value does an fp16 total stop growing?",
          "(the total)", rel=0,
          hint="a total stops when the gap between neighbouring numbers around it reaches 2: then total + 1 is a tie "
               "and rounds back to the even neighbour. How many significant bits does fp16 keep, against bf16's 8?")
def _fp16_running_total():
    return precision.running_total("fp16")


def overflow_stop_step(initial_scale_power=16, hysteresis=2, min_loss_scale=1) -> int:
    """The step at which DeepSpeed's scaler stops a run whose every step overflows."""
    scaler = loss_scaling.deepspeed_scaler(dict(enabled=True, loss_scale=0, initial_scale_power=initial_scale_power,
                                                loss_scale_window=1000, hysteresis=hysteresis,
                                                min_loss_scale=min_loss_scale))
    history = loss_scaling.drive(scaler, [True] * (initial_scale_power + hysteresis + 10))
    return next(row["step"] for row in history if row["stopped"])


@exercise("04.2", "DeepSpeed fp16 with loss_scale 0, initial_scale_power 16, hysteresis 2, min_loss_scale 1, and "
          "every step overflows: at which step does DeepSpeed stop the run?", "step", rel=0,
          hint="count the overflows that only use up hysteresis, then the halvings from 2^16 down to min_loss_scale, "
               "then the overflow that arrives at the minimum")
def _stop_step():
    return overflow_stop_step()


def skipped_in_first(steps=3000, window=500, hysteresis=3, limit=2 ** 12) -> int:
    """How many of a run's first `steps` steps DeepSpeed's scaler skips when the gradients overflow fp16 whenever
    the scale is above `limit` and never at or below it, starting from 2^16 (run e's initial_scale_power): the way
    down to the limit, then the steady state's failed tries."""
    section = dict(enabled=True, loss_scale=0, initial_scale_power=16, loss_scale_window=window,
                   hysteresis=hysteresis, min_loss_scale=1)
    return sum(r["overflow"] for r in loss_scaling.steady_state(section, limit=limit, steps=steps))


@exercise("04.3", "DeepSpeed fp16 starting at 2^16 (initial_scale_power 16), with loss_scale_window 500 and "
          "hysteresis 3 (not the chapter's 1000 and 2). The gradients overflow whenever the scale is above 2^12 and "
          "never at or below it. How many of the run's first 3,000 steps does DeepSpeed skip?", "steps", rel=0,
          hint="first the way down from 2^16 to 2^12: which overflows only use up hysteresis, and does halving the "
               "scale give any back? Then the tries at 2^13: how many clean steps between two, how many steps each "
               "try costs once growing has refilled the hysteresis, and how many tries fit before step 3,000")
def _skipped_in_first():
    return skipped_in_first()


def bf16_weight_after(updates=100, start=1.0) -> float:
    """An RMSNorm weight (1.0 at initialisation) kept in bf16 with no fp32 master, after `updates` Adam steps of
    size lr (labs' default learning rate for Qwen2.5-7B), each moving it down."""
    lr = resolve.run_defaults("qwen2.5-7b")["lr"]
    return precision.drift(start, -lr, updates, "bf16")["rows"][-1]["alone"]


@exercise("04.4", "An RMSNorm weight starts at 1.0 and is kept in bf16 with no fp32 master. Adam moves it down by "
          "lr = 1e-4 (labs' default for Qwen2.5-7B) at every step. What is it after 100 steps?", "(the weight)",
          rel=0, hint="compare one step's change with the gap between 1.0 and the bf16 number just below it; where "
                      "does rounding send 1.0 - 1e-4?")
def _bf16_weight():
    return bf16_weight_after()


def bf16_saving_percent(gpus=8, micro_batch=1, seq_len=4096, activation_checkpointing="full", loss="liger") -> float:
    """How much less peak memory per GPU bf16 needs than fp32 (percent), by labs.memory, ZeRO-3."""
    peaks = {p: memory.estimate("qwen2.5-7b", stage=3, gpus_per_node=gpus, micro_batch=micro_batch, seq_len=seq_len,
                                activation_checkpointing=activation_checkpointing, loss=loss,
                                precision=p).total_per_gpu_bytes for p in ("bf16", "fp32")}
    return 100 * (1 - peaks["bf16"] / peaks["fp32"])


def run_e_saving_percent() -> float:
    """bf16's saving against fp32 for run e's setup with the checkpointing that lets fp32 fit (section 5)."""
    bf16_run, _ = precision_costs.recorded_pair()
    by = {r["precision"]: r["peak"] for r in precision_costs.peak_rows(precision_costs.fp32_fitting_row(bf16_run))}
    return 100 * (1 - by["bf16"] / by["fp32"])


@exercise("04.5", "Qwen2.5-7B, ZeRO-3 on 8 GPUs, micro-batch 1 x 4096 tokens, full activation checkpointing, the Liger "
          "loss. Against fp32, does bf16 save a larger or a smaller share of the peak memory per GPU than it saves "
          "for run e's setup with 8 checkpointed layers in both (section 5)? Answer 'larger' or 'smaller'.", "choice",
          hint="what halves in bf16 and what shrinks by only a fifth under ZeRO; which of the two does full "
               "checkpointing on 8 GPUs leave as most of the peak?")
def _bf16_saving():
    return "smaller" if bf16_saving_percent() < run_e_saving_percent() else "larger"
