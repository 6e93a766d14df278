"""Chapter 09 (Qwen-7B on GPUs): exercises. Each asks for a prediction from what chapters 1-8 teach; the expected
answer is the measurement in the committed GPU results (or labs' formula where the question is arithmetic, or
labs.memory where no run measured the case), and the tolerance is what the reasoning can be expected to reach."""
from labs import config, memory, models
from labs.bench import results
from labs.course import autotune_report, gpu_report
from labs.course.exercises.registry import exercise
from labs.memory import activations, layout

QWEN = models.shape("qwen2.5-7b")


def _half_offload_premise() -> dict:
    """Run p's half offload as DeepSpeed 0.19.8 splits it (stage3.py: sub-group i goes to the CPU when
    i >= int((1 - ratio) x count)): the config's ratio, the 3B's sub-groups and those kept on the GPU."""
    zero = config.load("bench/labs_zero3_offload_half.json")["zero_optimization"]
    z3 = layout.zero3_partition(layout.param_layout(models.shape("qwen2.5-3b")), 1,
                                zero["stage3_param_persistence_threshold"], zero["sub_group_size"])
    ratio = zero["offload_optimizer"]["ratio"]
    on_gpu = layout.zero3_gpu_sub_groups(z3, {"offload_ratio": ratio})
    return dict(ratio=ratio, count=len(z3["sub_groups"]), on_gpu=len(on_gpu), gpu_params=sum(on_gpu),
                params=z3["partition"], sub_group_size=zero["sub_group_size"])


_HALF = _half_offload_premise()


def _e(x: float) -> str:
    """A count as DeepSpeed's docs write sizes: 5e8, 1.54e9."""
    return f"{x:.3g}".replace("e+0", "e")


def _case(run: str, case: str) -> dict:
    return results.find(results.rows(results.load_all()), run, case)


@exercise("09.1", "Predict, before reading run a's table: full activation checkpointing recomputes every decoder "
          "layer's forward once in backward. If forward is a third of forward + backward and the layers do nearly all "
          "of the FLOPs, by what factor does dropping checkpointing alone speed stock ZeRO-3 up?", "x", rel=0.06,
          hint="time with recompute ~ (3 + 1) / 3 of the time without; the measured factor is a little lower, since "
               "the head, loss and optimizer are not recomputed")
def _nockpt_speedup():
    return _case("a_zero3_2xh200", "lever-nockpt")["tokens_per_s_per_gpu"] / \
        _case("a_zero3_2xh200", "stock-zero3")["tokens_per_s_per_gpu"]


@exercise("09.2", "What MFU (in %) is 10,000 tokens/s per GPU for Qwen2.5-7B at sequence 4096 on an H200 "
          "(989 TFLOP/s dense bf16), counting attention over the full matrix?", "%", rel=0.02,
          hint="FLOPs per token = 6 (N - input embedding) + 12 L H S; multiply by tokens/s, divide by the peak")
def _mfu_at_10k():
    return 100 * 10_000 * models.flops_per_token(QWEN, 4096) / 989e12


@exercise("09.3", "Predict from chapter 1 how many GiB of peak memory per GPU Liger's fused loss saves at micro-batch "
          "2 x 4096 tokens when checkpointing stays on; then compare with run a (stock-zero3 minus lever-liger).",
          "GiB", rel=0.10,
          hint="the stock loss holds three fp32 [tokens, vocab] tensors at its worst moment (labs.memory.activations."
               "loss_bytes); Liger's keeps the head's gradient and a chunk of logits")
def _liger_saving():
    return _case("a_zero3_2xh200", "stock-zero3")["peak_gib"] - _case("a_zero3_2xh200", "lever-liger")["peak_gib"]


@exercise("09.4", "FSDP2 with gradient accumulation keeps each rank's fp32 gradient shard from one micro-batch to the "
          "next. On 2 GPUs, how many GiB does that add to Qwen2.5-7B's peak per GPU?", "GiB", rel=0.03,
          hint="4 bytes per parameter, divided over the 2 ranks")
def _accumulated_shard():
    est = {ga: memory.estimate("qwen2.5-7b", gpus_per_node=2, micro_batch=4, grad_accum=ga, engine="fsdp2",
                               loss="liger", kernels="liger") for ga in (1, 2)}
    return (est[2].total_per_gpu_bytes - est[1].total_per_gpu_bytes) / 2**30


@exercise("09.5", "Run m (one H200, 3B shape, 32,768 tokens per step; its table above): the optimizer step of plain "
          "offload runs on the CPU and takes about the same time whoever drives the GPU. From run m's table, predict "
          "the most labs' offload could reach over stock's best offload case if everything labs does on the GPU took "
          "no time at all.", "x", rel=0.05,
          hint="stock's whole step (tokens per step / tokens per second) over labs' optimizer-step seconds")
def _offload_ceiling():
    return gpu_report.offload_bounds(gpu_report.RUNS["offload"])["ratio_if_gpu_part_were_free"]


@exercise("09.6", "Predict, before reading run p's table: DeepSpeed 0.19.8 steps ZeRO-3's optimizer in sub-groups and, "
          "at offload_optimizer.ratio r, sends sub-group i to the CPU when i >= int((1 - r) x count), so the first "
          f"int((1 - r) x count) stay on the GPU and are stepped there. Run p's half offload (r = {_HALF['ratio']:g}, "
          f"sub_group_size {_e(_HALF['sub_group_size'])}) on the 3B shape keeps {_HALF['on_gpu']} of its "
          f"{_HALF['count']} sub-groups on the GPU, holding {_e(_HALF['gpu_params'])} of its {_e(_HALF['params'])} "
          "parameters. How many GiB more does the GPU peak at than with the whole optimizer offloaded (same "
          "micro-batch)? Think about every fp32 tensor a GPU-side Adam step needs.",
          "GiB", rel=0.05,
          hint="per parameter of a GPU sub-group: the fp32 master and both Adam moments (12 bytes) and the fp32 "
               "gradient the step reads (4 bytes: DeepSpeed moves it to the sub-group's device)")
def _half_offload_extra_gib():
    return _case("p_offload_ratio_3b_1xh200", "labs-zero3-offloadhalf-mb8-gpus1")["peak_gib"] - \
        _case("p_offload_ratio_3b_1xh200", "labs-zero3-offload-mb8-gpus1")["peak_gib"]


def stock_loss_saving_predicted_gib() -> float:
    """What chapter 1's accounting predicts for 09.3: the stock loss's worst moment minus Liger's."""
    hf, liger = (sum(activations.loss_bytes(QWEN, loss, 2, 4096).values()) for loss in ("hf", "liger"))
    return (hf - liger) / 2**30


@exercise("09.7", "Run s's table gives labs' measured ZeRO-2 peaks at micro-batch 2 and 4 (3B shape, no "
          "checkpointing, Liger's loss, both with gradient accumulation). Predict the peak at micro-batch 3 with "
          "accumulation 2, which no run tried, in GiB. Decide first what grows with the micro-batch and what does "
          "not.", "GiB", rel=0.04,
          hint="the weights, gradients and optimizer states stay; each sequence adds its activations. The answer is "
               "checked against labs.memory, which lands within 3% of run s's measured peaks")
def _micro_batch_3_peak():
    two = next(r for r in autotune_report.found(autotune_report.LABS_RUN)["experiments"] if r["micro_batch"] == 2)
    # with accumulation, as both measured runs: ZeRO-2's gradient partition is there when a later micro-batch peaks
    return autotune_report.predicted_peak_gib(autotune_report.LABS_RUN, two["name"], micro_batch=3, grad_accum=2)


@exercise("09.8", "Run y's failure, on a bigger cluster: stock ZeRO-2 on 4 GPUs, Qwen2.5-7B shape, HF's loss, micro-batch "
          "2 with accumulation 4. How many GiB more does each GPU hold at the loss moment of the second micro-batch "
          "than at the first's? Decide what ZeRO-2 keeps from one micro-batch to the next, and how big it is on one "
          "rank.", "GiB", rel=0.05,
          hint="ZeRO-2's gradient partition buffer lives from the first backward to the step: bf16, and each rank's "
               "partition is a quarter of the parameters (labs.memory's worst rank holds a little more: the "
               "gradients of parameters that straddle its partition's edges)")
def _accumulated_zero2_partition():
    one, four = (memory.estimate("qwen2.5-7b", stage=2, gpus_per_node=4, micro_batch=2, grad_accum=ga, loss="hf")
                 for ga in (1, 4))
    return (four.phases["loss_backward"]["total"] - one.phases["loss_backward"]["total"]) / 2**30
