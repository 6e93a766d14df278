"""Chapter 10 (ZenFlow on one H200): exercises. Each asks for a prediction from what the chapter's rounds measured; the
expected answer is labs' formula, DeepSpeed's own CPU Adam op, or the recorded GPU runs (results/gpu/zenflow_1xh200),
and the tolerance is what the reasoning can be expected to reach."""
from labs import models
from labs.bench import offload_plan
from labs.memory.layout import param_layout, zero3_gpu_sub_groups, zero3_partition
from labs.course import offload_copy_report, zenflow_moments_report, zenflow_report
from labs.course.exercises.registry import exercise

QWEN = models.shape("qwen2.5-7b")


@exercise("10.1", "ZenFlow with its overlapped step on Qwen2.5-7B (one GPU, ZeRO-2), run by labs: how many GiB of "
          "private host memory would its optimizer process hold? Reason from what that process keeps (round 10's "
          "intro and the section on ZenFlow's CPU Adam), or scale round 10's 3B record, made with DeepSpeed's two sets "
          "of moments, and correct for the set labs drops.", "GiB", rel=0.02,
          hint="it keeps Adam's two moments in fp32, one set under labs.zenflow_moments: 8 bytes per parameter of the "
               "7.6 B; the 3B's record (two sets, 16 bytes per parameter) scales by the parameter counts, then halves")
def _zenflow_optimizer_process_7b():
    return 8 * models.param_counts(QWEN)["total"] / 2**30


def _copy_back_bytes_per_second() -> float:
    """Round 12's labs copy back: the 3B's fp32 weights over the mean copy time of its update steps."""
    updates = zenflow_report.update_steps("zf_fast20")
    seconds = sum(t["optimizer_transmit_time"] for t in updates) / len(updates) / 1e3
    return 4 * zenflow_report.zenflow_runs(("zf_fast20",))["zf_fast20"]["params"] / seconds


@exercise("10.2", "ZenFlow on Qwen2.5-7B, one GPU, with labs' copy back, on a host with the memory for it: at the "
          "GB/s (1e9 bytes per second) round 12's copy delivered the 3B's fp32 result, how many seconds does one "
          "update's copy of the 7B's result to the GPU take?", "s", rel=0.05,
          hint="what crosses is the fp32 result of the optimizer process, 4 bytes per parameter of the 7.6 B (the "
               "cast to bf16 happens on the GPU, after the crossing); divide by the 3B's GB/s")
def _copy_back_7b():
    return 4 * models.param_counts(QWEN)["total"] / _copy_back_bytes_per_second()


@exercise("10.3", "DeepSpeed's ZenFlow at update_interval 8, betas (0.9, 0.95), a steady gradient: its CPU Adam's "
          "first update is handed step 8 while its moments have seen one gradient. How far does that update move a "
          "weight, in learning rates (Adam's answer: 1)?", "x", rel=0.03,
          hint="after one update the moments hold 0.1 g and 0.05 g**2; DeepSpeed divides them by 1 - 0.9**8 and "
               "1 - 0.95**8; the move is the first over the square root of the second")
def _first_update_at_interval_8():
    return zenflow_moments_report.moves("deepspeed", updates=1, interval=8)[0]


@exercise("10.4", "Plain offload of Qwen2.5-7B on one H100 80GB with DeepSpeed's native pinning: at 8 x 1 (8 sequences "
          "of 4,096 tokens per optimizer step as one micro-batch) the host holds the figure in the sizing table "
          "(section \"For you\"). Split the same 8 sequences 4 x 2 instead (fewer layers checkpointed, the GPU peak "
          "still fits): how many GiB of host memory does the run hold?", "GiB", rel=0.02,
          hint="the optimizer state on the host does not change; what accumulation adds is each gradient waiting on "
               "the host between micro-batches, in the model's dtype (bf16: 2 bytes per parameter of the 7.6 B), "
               "each buffer pinned at its own size under native pinning (the 4 x 2 row with PyTorch's pinning rounds "
               "every buffer up to a power of two)")
def _native_pinning_split_host_7b():
    found = offload_plan.fewest_checkpointed("qwen2.5-7b", offload_plan.setup_config("bench/labs_zero2_offload.json"),
                                             "H100", micro_batch=4, grad_accum=2, host_pinning="exact")
    return found["host_gib"]


@exercise("10.5", "labs' copy of the updated weights (this section) page-locks each of ZeRO-3's fp32 masters once and "
          "copies the fp32 bytes to the GPU, which casts them there. From round 29's parts printed above (the copy "
          "DeepSpeed makes, cast on the CPU, and the same fp32 bytes copied uncast from page-locked memory, both "
          "scaled to the parameters round 28's 7B row offloaded: 70% of 5e8 sub-groups), by how many seconds should "
          "it shorten that row's optimizer step?", "s", rel=0.05,
          hint="the copy still happens: what goes is the difference between DeepSpeed's cast copy and the uncast "
               "copy from page-locked memory, not the whole cast copy; the page-locking itself happens once, at the "
               "first step")
def _copy_saving_7b():
    return offload_copy_report.predicted_saving_s()


def _partition_5e8() -> dict:
    """The 7B's ZeRO-3 partition into sub-groups of 5e8 elements, one rank, as DeepSpeed cuts them (labs.memory)."""
    return zero3_partition(param_layout(models.PRESETS["qwen2.5-7b"]), 1, 1e6, 5e8)


_GROUPS = _partition_5e8()["sub_groups"]


@exercise("10.6", "DeepSpeed's ZeRO-3 steps the optimizer in sub-groups: it walks the parameters in model order "
          "(embedding first, lm_head last) and closes a sub-group once it holds sub_group_size elements, so at 5e8 "
          f"the 7B's {sum(_GROUPS) / 1e9:.2f} B parameters make {len(_GROUPS)} sub-groups (the embedding alone, "
          f"{len(_GROUPS) - 2} of {min(_GROUPS[1:-1]) / 1e9:.2f}-{max(_GROUPS[1:-1]) / 1e9:.2f} B, lm_head alone). "
          "Partial offload keeps the first int((1 - ratio) x count) on the GPU. Round 34's run stock65_sg5 set ratio "
          "0.65 with sub_group_size 5e8: how many sub-groups stayed on the GPU?", "sub-groups", rel=0,
          hint="(1 - 0.65) x the count is not a whole number, and int() drops the fraction: fewer sub-groups than "
               "rounding would keep, so more of the parameters are offloaded than the setting says")
def _gpu_sub_groups_at_65():
    return len(zero3_gpu_sub_groups(_partition_5e8(), {"offload_ratio": 0.65}))
