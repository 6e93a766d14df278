"""Chapter 08 (HF Trainer and accelerate): exercises, each a prediction. Expected answers come from HF's own "auto"
filler run in this process, from labs' reading of accelerate's rules (checked against the chapter's runs in
tests/test_trainer_routes.py), from DeepSpeed's own scheduler class, and from torch's bf16."""
from __future__ import annotations

from labs import CONFIGS, config, models, resolve
from labs.course import route_checks, tutorial_snippets
from labs.course.exercises.registry import exercise


@exercise("08.1", "You want 2**20 tokens per optimizer step at sequence 4096 with the Trainer on 2 nodes x 8 GPUs, "
          "TrainingArguments(per_device_train_batch_size=4) and ds_configs/zero3.json: what "
          "gradient_accumulation_steps do you pass?", "steps",
          hint="tokens per step = sequence x train_batch_size, and HF fills train_batch_size = ranks x micro-batch x "
               "accumulation, with the ranks of the whole job")
def _hf_accumulation():
    zero3 = config.load(CONFIGS / "zero3.json")
    for accumulation in range(1, 257):
        filled, _ = tutorial_snippets.hf_fill(zero3, world_size=16, per_device_train_batch_size=4,
                                              gradient_accumulation_steps=accumulation, adam_beta2=0.95, bf16=True,
                                              use_cpu=True)
        if filled["train_batch_size"] * 4096 == 2**20:
            return accumulation
    raise AssertionError("no accumulation gives 2**20 tokens per step")


@exercise("08.2", "Your accelerate loop (4 processes, batches not split) uses ds_configs/zero2.json and "
          "DummyScheduler(total_num_steps=1000, warmup_num_steps=100), and makes 1000 optimizer steps: how many of "
          "them update on the cosine's way down, after the peak rate and above the floor (cos_min_ratio x the peak)?",
          "steps", rel=0.01,
          hint="accelerate divides total_num_steps by the processes (it counts batches of the unsharded loader) "
               "but passes warmup_num_steps as it is; the schedule stays at its floor after its last step")
def _steps_on_the_way_down():
    raw = config.load(CONFIGS / "zero2.json")
    given = route_checks.accelerate_scheduler_steps(1000, 4)          # what DeepSpeed's scheduler gets
    scheduled = config.variant(raw, {"optimizer.params.lr": 1e-4, "scheduler.params.warmup_num_steps": 100,
                                     "scheduler.params.total_num_steps": given})
    rates = route_checks.scheduled_rates(scheduled, 1000)
    peak, floor = max(rates), 1e-4 * raw["scheduler"]["params"]["cos_min_ratio"]
    return sum(floor < rate < peak for rate in rates[rates.index(peak):])    # the warm-up passes the floor too


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
