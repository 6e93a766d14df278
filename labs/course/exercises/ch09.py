"""Chapter 09 (Qwen-7B on GPUs): exercises. Answers are computed from the committed GPU results."""
from labs import models
from labs.bench import results
from labs.course.exercises.registry import exercise


def _case(run: str, case: str) -> dict:
    return results.find(results.rows(results.load_all()), run, case)


@exercise("09.1", "Run a: by what factor did dropping activation checkpointing alone (lever-nockpt) speed up "
          "stock-zero3? (tokens/s per GPU ratio)", "x", rel=0.02,
          hint="divide lever-nockpt's tokens/s per GPU by stock-zero3's, both from run a")
def _nockpt_speedup():
    return _case("a_zero3_2xh200", "lever-nockpt")["tokens_per_s_per_gpu"] / \
        _case("a_zero3_2xh200", "stock-zero3")["tokens_per_s_per_gpu"]


@exercise("09.2", "What MFU (in %) is 10,000 tokens/s per GPU for Qwen2.5-7B at sequence 4096 on an H200 "
          "(989 TFLOP/s dense bf16)?", "%", rel=0.02,
          hint="FLOPs per token = 6 (N - input embedding) + 12 L H S; multiply by tokens/s, divide by the peak")
def _mfu_at_10k():
    return 100 * 10_000 * models.flops_per_token(models.shape("qwen2.5-7b"), 4096) / 989e12


@exercise("09.3", "Run a: how many GiB of peak memory per GPU did Liger's kernels and fused loss save when "
          "checkpointing stayed on (stock-zero3 minus lever-liger)?", "GiB", rel=0.03,
          hint="the fp32 logits of the stock loss are most of it: compare the two peak_gib values of run a")
def _liger_saving():
    return _case("a_zero3_2xh200", "stock-zero3")["peak_gib"] - _case("a_zero3_2xh200", "lever-liger")["peak_gib"]
