"""Chapter 08 (HF Trainer and accelerate): exercises, each a prediction. Expected answers come from HF's own "auto"
filler run in this process, from labs' reading of accelerate's rules (checked against the chapter's runs in
tests/test_trainer_routes.py), from DeepSpeed's own scheduler class, and from torch's bf16."""
from __future__ import annotations

from labs import CONFIGS, config, models, resolve
from labs.course import route_checks, tutorial_snippets
from labs.course.exercises.registry import exercise


@exercise("08.1", "The Trainer on 2 nodes x 8 GPUs with TrainingArguments(per_device_train_batch_size=4, "
          "gradient_accumulation_steps=8) and ds_configs/zero3.json: what train_batch_size does HF write into the "
          "DeepSpeed config?", "sequences", hint="HF fills train_batch_size = ranks x micro-batch x accumulation, and "
                                                 "the ranks are those of the whole job")
def _hf_train_batch_size():
    filled, _ = tutorial_snippets.hf_fill(config.load(CONFIGS / "zero3.json"), world_size=16,
                                          per_device_train_batch_size=4, gradient_accumulation_steps=8,
                                          adam_beta2=0.95, bf16=True, use_cpu=True)
    return filled["train_batch_size"]


@exercise("08.2", "Your accelerate loop runs with a DeepSpeed config file on 4 processes, and the learning rate "
          "should decay over 1000 optimizer steps: what total_num_steps do you pass to DummyScheduler?", "steps",
          rel=0.0005, hint="accelerate takes DummyScheduler's count for batches of the loader before it is sharded "
                           "over the processes; undo what it does to the number")
def _dummy_scheduler_steps():
    passed = route_checks.dummy_scheduler_steps(1000, 4)
    assert route_checks.accelerate_scheduler_steps(passed, 4) == 1000      # what DeepSpeed then gets
    return passed


@exercise("08.3", "zero3.json with warmup_min_ratio 0.1 instead of 0.0, labs train for 1000 steps: how many "
          "optimizer steps update the weights with a learning rate of exactly 0?", "steps",
          hint="two different things make a rate 0 in the 8-step runs: which of them does warmup_min_ratio control?")
def _zero_rate_steps():
    raw = config.variant(config.load(CONFIGS / "zero3.json"), {"scheduler.params.warmup_min_ratio": 0.1})
    resolved = resolve.ds_config(raw, world_size=2, dims=models.shape("tiny"), steps=1000, on_gpu=False, preset="tiny")
    return sum(rate == 0 for rate in route_checks.scheduled_rates(resolved, 1000))


@exercise("08.4", "accelerate's FSDP policy (mixed_precision: bf16) returns the loss in bf16. Late in a run the true "
          "loss is 2.7: what is the largest error the cast to bf16 can add to it?", "nats", rel=0.001,
          hint="bf16 keeps 8 significant bits; the spacing of its numbers depends on the power of two below the "
                "value; rounding errs by at most half a spacing")
def _bf16_rounding():
    return route_checks.bf16_rounding(2.7)
