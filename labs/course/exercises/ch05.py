"""Chapter 05 (checkpointing): exercises. Each is a prediction for Qwen2.5-7B, the model chapter 9 trains on GPUs,
where the chapter's tables are for the seed tutorials' Qwen-7B (the notebook prints Qwen2.5-7B's shape above the
exercises). Expected answers come from labs.memory, the FLOP convention of labs.course.recompute, the bytes per
parameter of labs.course.checkpoints (checked against real conversions in tests/test_checkpoint.py) and the save
schedule of labs.checkpoint, which the chapter's runs check."""
from __future__ import annotations

from labs import checkpoint, memory, models
from labs.course import recompute
from labs.course.checkpoints import expected_bytes_per_param, tied_share
from labs.course.exercises.registry import exercise
from labs.memory import activations


@exercise("05.1", "Qwen2.5-7B, micro-batch 1, sequence 4096, bf16, every layer checkpointed: how many GiB do the "
          "checkpointed layers' inputs take, all layers together (what the Qwen-7B table's 'decoder GiB' column "
          "counts at k = 32: the final norm, the token ids and the loss not included)?", "GiB", rel=0.02,
          hint="a checkpointed layer keeps only its input, one bf16 vector of the hidden size per token; count it "
               "in every layer of this model, not of Qwen-7B")
def _checkpointed_inputs_gib(preset="qwen2.5-7b", seq_len=4096):
    parts = activations.activation_bytes(models.shape(preset), 1, seq_len, "full")
    return parts["checkpointed layer inputs"] / memory.GiB


@exercise("05.2", "A ZeRO-2 run of Qwen2.5-7B (Adam, bf16) on 8 GPUs is resumed on 4 (labs train --resume RUN_DIR "
          "--nproc 4); before the first step labs converts its newest checkpoint to a universal one. How many GB "
          "(1e9 bytes) do that checkpoint and its universal copy take together?", "GB", rel=0.01,
          hint="the chapter measured a ZeRO-3 checkpoint; at ZeRO-1/2 the checkpoint also holds the bf16 module, "
               "and the converter keeps different things per stage (Part 3's table of universal copies); "
               "Qwen2.5-7B does not tie its output layer to the embedding")
def _zero2_checkpoint_and_universal_gb(preset="qwen2.5-7b", ranks=8):
    dims = models.shape(preset)
    expected = expected_bytes_per_param(2, ranks, tied_share(dims))
    per_param = expected["DeepSpeed checkpoint (every rank's files)"] + expected["universal checkpoint"]
    return per_param * models.param_counts(dims)["total"] / 1e9


@exercise("05.3", "A 1,000-step run with --save-every 300 stops when a rank is lost between steps 700 and 701. "
          "`labs train --resume` continues it, and that run loses a rank while it writes the checkpoint of step "
          "1,000; a second `--resume` finishes. How many optimizer steps do the three launches complete in all, "
          "steps trained again included?", "steps", rel=0,
          hint="each resume starts from the newest complete checkpoint (a save is published only when every rank "
               "has written it), and a run saves every N steps and at its last step")
def _steps_trained_in_all(steps=1000, save_every=300, lost_after=700):
    def newest_complete(before):        # the newest step a finished save published, before step `before`
        return max([0] + [s for s in range(1, before) if checkpoint.is_due(s, save_every, steps)])

    first = lost_after                                  # steps 1..700
    second = steps - newest_complete(lost_after + 1)    # from the newest checkpoint to the end, its last save cut
    third = steps - newest_complete(steps)              # the save of the last step never published
    return first + second + third


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
