"""Chapter 08 (HF Trainer and accelerate): exercises. Expected answers come from HF's own "auto" filler run in this
process, from labs' reading of accelerate's rules (checked against the chapter's runs in tests/test_trainer_routes.py),
and from the model's parameter count."""
from __future__ import annotations

from labs import CONFIGS, config, models
from labs.course import route_checks, seed_snippets
from labs.course.exercises.registry import exercise


@exercise("08.1", "The Trainer on 2 nodes x 8 GPUs with TrainingArguments(per_device_train_batch_size=4, "
          "gradient_accumulation_steps=8) and ds_configs/zero3.json: what train_batch_size does HF write into the "
          "DeepSpeed config?", "sequences", hint="HF fills train_batch_size = ranks x micro-batch x accumulation")
def _hf_train_batch_size():
    filled, _ = seed_snippets.hf_fill(config.load(CONFIGS / "zero3.json"), world_size=16, per_device_train_batch_size=4,
                                      gradient_accumulation_steps=8, adam_beta2=0.95, bf16=True, use_cpu=True)
    return filled["train_batch_size"]


@exercise("08.2", "accelerate with a DeepSpeed config file on 4 processes: your loop passes "
          "DummyScheduler(optimizer, total_num_steps=1000). What total_num_steps does DeepSpeed's scheduler get?",
          "steps", hint="accelerate takes total_num_steps to count batches of the unsharded loader and divides it by "
                        "the number of processes")
def _accelerate_total_steps():
    return route_checks.accelerate_scheduler_steps(1000, 4)


@exercise("08.3", "The accelerate + DeepSpeed route of this chapter (ds_configs/zero2.json, 2 ranks, tiny preset): "
          "how many parameter elements does each rank hold during training?", "elements", rel=0.001,
          hint="ZeRO-2 partitions gradients and optimizer states, not parameters")
def _zero2_params_held():
    return models.param_counts(models.shape("tiny"))["total"]


@exercise("08.4", "The FSDP route reports its loss in bf16 (accelerate's output_dtype). For a true loss of 11.3, "
          "what is the largest error that rounding to bf16 can add?", "nats", rel=0.001,
          hint="bf16 stores 8 significant bits: numbers between 8 and 16 are 2**-4 apart; rounding errs by half that")
def _bf16_rounding():
    return route_checks.bf16_rounding(11.3)
