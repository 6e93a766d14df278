"""Chapter 00 (quickstart): exercises. Each asks for a number the chapter has not printed, to be reasoned out from
what it has: the presets table, tiny's run defaults and the resolved config of its run. Expected answers come from
the code the run itself uses: labs.models for the untrained loss, labs.resolve for the batch and the "auto" values."""
from __future__ import annotations

from labs import models, resolve
from labs.course.exercises.registry import exercise


def _resolved(preset, world_size, **flags) -> dict:
    """zero3.json as `labs train --preset PRESET --nproc WORLD_SIZE ...` resolves it on a machine without a GPU."""
    return resolve.ds_config(resolve.default_config(), world_size=world_size, dims=models.shape(preset), steps=30,
                             on_gpu=False, preset=preset, **flags)


@exercise("00.1", "Before the launch: the loss at step 1 of an untrained `tiny`, in nats (natural logarithm)?",
          "nats", rel=0.01,
          hint="an untrained model gives every token of the vocabulary (the presets table) about the same "
               "probability; the loss is minus the log of the probability it gives the right token")
def _first_loss():
    return models.expected_initial_loss(models.shape("tiny")["vocab_size"])


@exercise("00.2", "`labs train --preset tiny --nproc 4 --micro-batch 4 --grad-accum 8` (zero3.json, tiny's default "
          "sequence length): how many tokens does one optimizer step train on?", "tokens", rel=0,
          hint="every rank runs its own micro-batches of sequences before the one optimizer step; the sequence "
               "length is in tiny's run defaults")
def _tokens_per_step():
    resolved = _resolved("tiny", world_size=4, micro_batch=4, grad_accum=8)
    return resolved["train_batch_size"] * resolve.run_defaults("tiny")["seq_len"]


@exercise("00.3", "The same zero3.json launched with `--preset qwen2.5-7b`: what does labs make of "
          "zero_optimization.reduce_bucket_size (\"auto\")?", "elements", rel=0,
          hint="compare tiny's resolved value with tiny's hidden size in the presets table, then take Qwen2.5-7B's")
def _reduce_bucket():
    return _resolved("qwen2.5-7b", world_size=2)["zero_optimization"]["reduce_bucket_size"]
