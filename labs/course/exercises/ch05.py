"""Chapter 05 (checkpointing): exercises. Each is a prediction for Qwen2.5-7B, a 7B model the chapter does not
tabulate (the notebook prints its shape above the exercises). Expected answers come from labs.memory, the FLOP
convention of labs.course.recompute and the save schedule of labs.checkpoint, which the chapter's runs check."""
from __future__ import annotations

from labs import checkpoint, memory, models
from labs.course import recompute
from labs.course.checkpoints import expected_bytes_per_param
from labs.course.exercises.registry import exercise
from labs.memory import activations


@exercise("05.1", "Qwen2.5-7B, micro-batch 1, sequence 4096, bf16, every layer checkpointed: how many GiB do the "
          "decoder layers keep for backward at the end of forward?", "GiB", rel=0.02,
          hint="a checkpointed layer keeps only its input, one bf16 vector of the hidden size per token; count it "
               "in every layer of this model, not of Qwen-7B")
def _checkpointed_inputs_gib(preset="qwen2.5-7b", seq_len=4096):
    parts = activations.activation_bytes(models.shape(preset), 1, seq_len, "full")
    return parts["checkpointed layer inputs"] / memory.GiB


@exercise("05.2", "A ZeRO-2 checkpoint of Qwen2.5-7B trained with Adam in bf16 on 8 GPUs: how many GB (1e9 bytes) "
          "does it take on disk, all ranks' files together?", "GB", rel=0.03,
          hint="the ZeRO-3 checkpoint measured in the chapter holds 12 bytes per parameter; ZeRO-1/2 also save "
               "something ZeRO-3 leaves out")
def _zero2_checkpoint_gb(preset="qwen2.5-7b"):
    per_param = expected_bytes_per_param(2)["DeepSpeed checkpoint (every rank's files)"]
    return per_param * models.param_counts(models.shape(preset))["total"] / 1e9


@exercise("05.3", "A 1,000-step run with --save-every 150 loses a rank while it writes the checkpoint of step 600 "
          "(step 600 itself was finished and logged). How many optimizer steps does `labs train --resume` redo?",
          "steps", rel=0, hint="a save is published only when every rank has written it: which is the newest "
                               "complete checkpoint, and which logged steps come after it?")
def _steps_redone(steps=1000, save_every=150, crash_in_save_of=600):
    complete = [s for s in range(1, crash_in_save_of) if checkpoint.is_due(s, save_every, steps)]
    return crash_in_save_of - complete[-1]


@exercise("05.4", "Qwen2.5-7B at sequence 4096 with every layer checkpointed: what percentage of the whole step's "
          "FLOPs (the output layer included, the chapter's FLOP convention) does recomputation add?", "%",
          rel=0.05, hint="per layer: its forward again (2 FLOPs per weight, 4 x hidden x seq of attention) less "
                         "down_proj's matmul; the step: 6 per weight (output layer included, embedding not) plus "
                         "12 x layers x hidden x seq; Qwen2.5-7B's attention has fewer key/value weights than "
                         "Qwen-7B's")
def _recompute_share(preset="qwen2.5-7b", seq_len=4096):
    dims = models.shape(preset)
    added = dims["num_hidden_layers"] * recompute.recompute_flops_per_token(dims, seq_len)
    return 100 * added / models.flops_per_token(dims, seq_len)
