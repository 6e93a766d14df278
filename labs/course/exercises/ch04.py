"""Chapter 04 (mixed precision): exercises. Expected answers come from real casts (labs.course.precision),
DeepSpeed's own loss scaler (labs.course.loss_scaling) and labs.memory."""
from __future__ import annotations

from labs import memory, resolve
from labs.course import loss_scaling, precision
from labs.course.exercises.registry import exercise


def largest_count_that_fits(name="fp16", start=60000, stop=70000) -> int:
    """The largest whole number that stays finite when stored in the format (searched by real casts)."""
    values = list(range(start, stop))
    stored = precision.cast(values, name)
    return max(v for v, s in zip(values, stored) if s != float("inf"))


@exercise("04.1", "All-zero logits over a vocabulary of V words: the softmax denominator is V. What is the largest "
          "V whose denominator is still finite in fp16?", "words", rel=0,
          hint="65504 is fp16's largest number and the next step up is 65536, which does not exist; storing "
               "rounds to the nearest, and a tie goes to the even mantissa")
def _largest_fp16_vocabulary():
    return largest_count_that_fits("fp16")


def overflow_stop_step(initial_scale_power=16, hysteresis=2, min_loss_scale=1) -> int:
    """The step at which DeepSpeed's scaler stops a run whose every step overflows."""
    scaler = loss_scaling.deepspeed_scaler(dict(enabled=True, loss_scale=0, initial_scale_power=initial_scale_power,
                                                loss_scale_window=1000, hysteresis=hysteresis,
                                                min_loss_scale=min_loss_scale))
    history = loss_scaling.drive(scaler, [True] * (initial_scale_power + hysteresis + 10))
    return next(row["step"] for row in history if row["stopped"])


@exercise("04.2", "DeepSpeed fp16 with loss_scale 0, initial_scale_power 16, hysteresis 2, min_loss_scale 1, and "
          "every step overflows: at which step does DeepSpeed stop the run?", "step", rel=0,
          hint="the first overflow only uses up hysteresis; each later one halves the scale, down to "
               "min_loss_scale; an overflow at the minimum stops the run")
def _stop_step():
    return overflow_stop_step()


def steps_at_halved_scale(window=1000, hysteresis=2) -> int:
    """After overflows that halve the scale, how many steps run at the halved scale before DeepSpeed doubles it
    (no further overflow)."""
    scaler = loss_scaling.deepspeed_scaler(dict(enabled=True, loss_scale=0, initial_scale_power=16,
                                                loss_scale_window=window, hysteresis=hysteresis, min_loss_scale=1))
    history = loss_scaling.drive(scaler, [True] * hysteresis + [False] * (3 * window))
    halved = history[hysteresis - 1]["next_scale"]
    return sum(1 for row in history[hysteresis:] if row["scale"] == halved)


@exercise("04.3", "loss_scale_window 1000, hysteresis 2: two overflows in a row halve the scale. If nothing "
          "overflows after that, how many steps run at the halved scale before DeepSpeed doubles it?", "steps",
          rel=0, hint="DeepSpeed doubles when (this step - last overflow step - 1) is a positive multiple of the "
                      "window, and the new scale applies from the next step")
def _halved_steps():
    return steps_at_halved_scale()


def bf16_weight_after(updates=100, start=1.0) -> float:
    """An RMSNorm weight (1.0 at initialisation) kept in bf16 with no fp32 master, after `updates` Adam steps of
    size lr (labs' default learning rate for Qwen2.5-7B), each moving it down."""
    lr = resolve.run_defaults("qwen2.5-7b")["lr"]
    return precision.drift(start, -lr, updates, "bf16")["rows"][-1]["alone"]


@exercise("04.4", "An RMSNorm weight starts at 1.0 and is kept in bf16 with no fp32 master. Adam moves it down by "
          "lr = 1e-4 (labs' default for Qwen2.5-7B) at every step. What is it after 100 steps?", "(the weight)",
          rel=1e-3,
          hint="bf16 has 8 significant bits: the spacing just below 1.0 is 2^-8; a result is rounded to the nearest "
               "bf16 number")
def _bf16_weight():
    return bf16_weight_after()


def bf16_saving_percent(gpus=8, micro_batch=1, seq_len=4096, activation_checkpointing="full", loss="liger") -> float:
    """How much less peak memory per GPU bf16 needs than fp32 (percent), by labs.memory, ZeRO-3."""
    peaks = {p: memory.estimate("qwen2.5-7b", stage=3, gpus_per_node=gpus, micro_batch=micro_batch, seq_len=seq_len,
                                activation_checkpointing=activation_checkpointing, loss=loss,
                                precision=p).total_per_gpu_bytes for p in ("bf16", "fp32")}
    return 100 * (1 - peaks["bf16"] / peaks["fp32"])


@exercise("04.5", "Qwen2.5-7B, ZeRO-3 on 8 GPUs, micro-batch 1 x 4096 tokens, full activation checkpointing, Liger "
          "loss: by labs.memory, how many percent less peak memory per GPU does bf16 need than fp32? "
          "(The seed says about 50.)", "percent", rel=0.05,
          hint="under ZeRO model states cost 16 bytes per parameter in bf16 and 20 in fp32; the 2-byte tensors "
               "(activations, gathered weights, buffers) halve; compare memory.estimate(..., precision='bf16') "
               "with precision='fp32'")
def _bf16_saving():
    return bf16_saving_percent()
