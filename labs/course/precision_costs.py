"""What mixed precision keeps in fp32 and what it costs: bytes per parameter and the peak per GPU by precision
(labs.memory), next to the committed H200 runs that trained one setup in fp16 and in bf16 (results/gpu, run e:
cases `labs-zero3` and `labs-zero3-fp16`, read with labs.bench.results).

    from labs.course import precision_costs
    bf16, fp16 = precision_costs.recorded_pair()
    precision_costs.peak_rows(bf16, measured={"bf16": bf16["peak_gib"], "fp16": fp16["peak_gib"]})
"""
from __future__ import annotations

from labs import memory, models
from labs.bench import results
from labs.errors import LabsError, check_choice

RUN = "e_zero3_final_2xh200"               # the run that measured both formats, same settings, one invocation
CASES = {"bf16": "labs-zero3", "fp16": "labs-zero3-fp16"}
PARTS = ("params", "grads", "optimizer", "activations", "buffers")


def recorded_pair() -> tuple[dict, dict]:
    """The bf16 and fp16 rows of run e (labs.bench.results rows: throughput, MFU in both attention conventions,
    peak, losses, config), each with what the result file records beside them: the peak reserved by PyTorch's
    caching allocator (`reserved_gib`, max over ranks), how the step time was taken (`timing`), the MFU formula
    (`mfu_formula`) and its peak (`peak_tflops`)."""
    recorded = results.load_all()
    result = next(r for name, r in recorded.items() if name.endswith(RUN))
    table = results.rows(recorded)
    pair = []
    for name in ("bf16", "fp16"):
        summary = result["cases"][CASES[name]]["summary"]
        pair.append(dict(results.find(table, RUN, CASES[name]), timing=summary["timing"],
                         reserved_gib=max(summary["peak_reserved_bytes"]) / memory.GiB,
                         mfu_formula=result["mfu_formula"], peak_tflops=summary["peak_flops"] / 1e12))
    return tuple(pair)


def recorded_grad_norms(precision: str) -> list[float]:
    """The gradient norm DeepSpeed reported at each step of run e's case in that precision (an fp16 step that
    overflows is skipped and reported with an infinite norm)."""
    check_choice("recorded precision", precision, CASES)
    result = next(r for name, r in results.load_all().items() if name.endswith(RUN))
    return [m["grad_norm"] for m in result["cases"][CASES[precision]]["metrics"]]


def bytes_per_parameter(precisions=("fp32", "fp16", "bf16"), preset="qwen2.5-7b", stage=0) -> list[dict]:
    """What one rank holds per parameter (of its partition) after backward at a ZeRO stage, on one GPU
    (labs.memory): weights, gradients and the optimizer's states (in mixed precision with the fp32 master)."""
    rows = []
    for precision in precisions:
        est = memory.estimate(preset, stage=stage, precision=precision)
        held = est.resident_per_rank[0]
        parts = {key: held[f"{key}_bytes"] / est.params for key in ("params", "grads", "optimizer")}
        rows.append(dict(precision=precision, **parts, total=sum(parts.values())))
    return rows


def estimate_like(row: dict, precision: str):
    """labs.memory's estimate for a recorded case's setup (model, GPUs, batch, loss, kernels, checkpointing, the
    recorded DeepSpeed config), in `precision`."""
    check_choice("precision", precision, ("fp32", "fp16", "bf16"))
    return memory.estimate(dims=models.shape(row["preset"]), gpus_per_node=row["gpus"], seq_len=row["seq_len"],
                           loss=row["loss"], kernels=row["kernels"], activation_checkpointing=row["checkpointing"],
                           ds_config=row["ds_config"], engine=row["engine"], micro_batch=row["micro_batch"],
                           precision=precision)


def peak_rows(row: dict, precisions=("fp32", "fp16", "bf16"), measured: dict | None = None, gpu="H200") -> list[dict]:
    """For each precision: the parts live at labs.memory's predicted peak (GiB per GPU), the peak, whether it fits
    the GPU, and the measured peak where `measured` ({precision: GiB}) has one."""
    found = []
    for precision in precisions:
        est = estimate_like(row, precision)
        parts = est.phases[est.peak_phase]
        found.append(dict(precision=precision, **{p: parts[p] / memory.GiB for p in PARTS},
                          model_states=sum(parts[p] for p in ("params", "grads", "optimizer")) / memory.GiB,
                          peak=est.total_per_gpu_bytes / memory.GiB, fits=est.fits(memory.GPUS[gpu]),
                          measured=(measured or {}).get(precision)))
    return found


def fp32_advice(row: dict, gpu="H200"):
    """labs.memory.advise for the recorded setup trained in fp32: does it fit, and the cheapest change if not."""
    return memory.advise(gpu, **estimate_like(row, "fp32").inputs)


def fp32_fitting_row(row: dict, gpu="H200") -> dict:
    """The recorded setup changed the cheapest way labs.memory.advise finds for fp32 to fit the GPU. Applied to
    every precision alike, it gives fp32 and bf16 one setup to be compared on."""
    rename = {"activation_checkpointing": "checkpointing"}          # advise's setting -> the results row's key
    change = fp32_advice(row, gpu).change
    if set(change) - set(rename):
        raise LabsError(f"fp32 fits only with {change}; compare precisions on that setup by hand")
    return dict(row, **{rename[key]: value for key, value in change.items()})


def compared(new: float, base: float) -> str:
    """`new` against `base` in words: 'N% less', 'N% more', or 'the same' (within 0.05%)."""
    if not base > 0:
        raise LabsError(f"a baseline must be positive, not {base!r}")
    saved = 1 - new / base
    return "the same" if abs(saved) < 0.0005 else f"{abs(saved):.0%} {'less' if saved > 0 else 'more'}"
