"""Chapter 05 (checkpointing): exercises. Expected answers come from labs.memory, the FLOP count of
labs.course.recompute and the save schedule of labs.checkpoint, which the chapter's runs check."""
from __future__ import annotations

from labs import checkpoint, memory, models
from labs.course import recompute
from labs.course.checkpoints import expected_bytes_per_param
from labs.course.exercises.registry import exercise
from labs.memory import activations


@exercise("05.1", "Qwen2.5-7B, micro-batch 1, sequence 4096, bf16, every layer checkpointed: how many GiB do the "
          "decoder layers keep for backward at the end of forward?", "GiB", rel=0.02,
          hint="a checkpointed layer keeps only its input: hidden size x bytes per element per token, in each of "
               "the 28 layers")
def _checkpointed_inputs_gib(preset="qwen2.5-7b", seq_len=4096):
    parts = activations.activation_bytes(models.shape(preset), 1, seq_len, "full")
    return parts["checkpointed layer inputs"] / memory.GiB


@exercise("05.2", "A ZeRO-3 checkpoint of Qwen2.5-7B trained with Adam in bf16: how many GB (1e9 bytes) does it "
          "take on disk, all ranks' files together?", "GB", rel=0.03,
          hint="ZeRO-3 saves every rank's partition of the fp32 master weights and of Adam's two moments; the "
               "bf16 weights are not saved (they are the master weights rounded)")
def _zero3_checkpoint_gb(preset="qwen2.5-7b"):
    per_param = expected_bytes_per_param(3)["DeepSpeed checkpoint (every rank's files)"]
    return per_param * models.param_counts(models.shape(preset))["total"] / 1e9


@exercise("05.3", "A 1,000-step run with --save-every 150 loses a rank during the save that follows step 600. "
          "How many optimizer steps does `labs train --resume` redo?", "steps", rel=0,
          hint="a save is published only when every rank has written it; list the saves before step 600")
def _steps_redone(steps=1000, save_every=150, crash_after=600):
    complete = [s for s in range(1, crash_after) if checkpoint.is_due(s, save_every, steps)]
    return crash_after - complete[-1]


@exercise("05.4", "Qwen2.5-7B at sequence 4096 with every layer checkpointed: what percentage of the step's "
          "FLOPs (6 per weight + attention) does recomputation add, with torch's early stop?", "%", rel=0.05,
          hint="each layer's forward again, less its last matmul (down_proj), against 6 FLOPs per weight per token "
               "plus attention; recompute.recompute_flops_per_token does one layer")
def _recompute_share(preset="qwen2.5-7b", seq_len=4096):
    dims = models.shape(preset)
    added = dims["num_hidden_layers"] * recompute.recompute_flops_per_token(dims, seq_len)
    return 100 * added / models.flops_per_token(dims, seq_len)
