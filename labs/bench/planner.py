"""`labs memory --plan`: the fastest configuration that fits, named with zero trial runs.

The memory model (labs.memory) says what fits; a small cost model says what is fast. Step time of a case:

    step_s = optimizer_s + accumulation * (engine_overhead_s + micro_batch * (seq_s + checkpointed/layers * recompute_s))

- optimizer_s: the fused AdamW pass over this rank's partition, from memory traffic (about 32 bytes per parameter
  read and written at an effective 3 TB/s on an H100/H200 class card): a few tens of milliseconds.
- engine_overhead_s (per micro-step; one per engine): parameter gathers, hooks, launch latency that do not grow with
  the micro-batch.
- seq_s (per sequence; one for the stock kernels and loss, one for Liger's): forward and backward compute.
- recompute_s (per sequence, for the whole model): the forward recomputed when every layer is checkpointed.
The six unknowns are fitted by least squares (none negative) to the recorded runs in results/gpu, so the planner
knows only what was measured there: one GPU model, one sequence length, two GPUs. Its picks are checked against the sweep.
"""
from __future__ import annotations

import numpy as np

from labs import memory, models
from labs.bench import results as results_lib
from labs.bench import sweep
from labs.errors import LabsError

ENGINES = ("zero1", "zero2", "zero3", "fsdp2")
SIDES = ("stock", "liger")             # the kernels and loss: stock HF, or Liger's fused ones
OPTIMIZER_BYTES_PER_PARAM, HBM_BYTES_PER_S = 32, 3.0e12
FITTED_PRESET, FITTED_SEQ_LEN = "qwen2.5-7b", 4096     # what every fitted run trained
# ... on 2 GPUs: the per-micro-step term holds the communication two ranks wait for, which one GPU does not have.
# Runs on one GPU (x-z of results/gpu) are left out of the fit and test how the model carries over instead.
FITTED_GPUS = 2


def features(engine: str, kernels: str, micro_batch: int, grad_accum: int, checkpointed: int, layers: int) -> list:
    """The row of the linear model for one configuration: coefficients of the unknowns, in `unknowns()` order."""
    row = [0.0] * (len(ENGINES) + 2 * len(SIDES))
    row[ENGINES.index(engine)] = grad_accum
    side = SIDES.index("liger" if kernels == "liger" else "stock")
    row[len(ENGINES) + 2 * side] = grad_accum * micro_batch
    row[len(ENGINES) + 2 * side + 1] = grad_accum * micro_batch * checkpointed / layers
    return row


def unknowns() -> list[str]:
    return [f"{e}_overhead_s" for e in ENGINES] + [f"{s}_{x}_s" for s in SIDES for x in ("seq", "recompute")]


def optimizer_seconds(params: int, gpus: int) -> float:
    return OPTIMIZER_BYTES_PER_PARAM * params / gpus / HBM_BYTES_PER_S


def _engine(row: dict) -> str:
    return "fsdp2" if row["engine"] == "fsdp2" else f"zero{row['stage']}"


def fit(rows: list[dict]) -> dict:
    """Least-squares coefficients (none negative) from measured rows of labs.bench.results (GPU-resident runs)."""
    # GPU-resident bf16 runs of the stock kernels or Liger's; levers the model has no term for are left out
    used = [r for r in rows if "offload" not in r["case"] and r["preset"] == FITTED_PRESET and not r["fp8"]
            and r["seq_len"] == FITTED_SEQ_LEN and r["gpus"] == FITTED_GPUS
            and not r["compile"] and r["sdpa"] == "default" and r["precision"] == "bf16"]
    if not used:
        raise LabsError("no recorded GPU runs to fit the cost model to (results/gpu/*.json)")
    layers = models.shape(FITTED_PRESET)["num_hidden_layers"]
    params = models.param_counts(models.shape(FITTED_PRESET))["total"]
    a = np.array([features(_engine(r), r["kernels"], r["micro_batch"], r["grad_accum"],
                           models.checkpointed_layers(r["checkpointing"], layers), layers) for r in used])
    b = np.array([r["step_s"] - optimizer_seconds(params, r["gpus"]) for r in used])
    keep = np.ones(a.shape[1], dtype=bool)
    keep[~a.any(axis=0)] = False                  # unknowns no row informs stay 0
    while True:                                   # non-negative least squares, the simple way: drop negatives
        x = np.zeros(a.shape[1])
        x[keep] = np.linalg.lstsq(a[:, keep], b, rcond=None)[0]
        if (x >= 0).all():
            break
        keep &= x > 0
    residual = a @ x - b
    measured = np.array([r["step_s"] for r in used])
    return dict(coefficients=dict(zip(unknowns(), x.tolist())), rows=len(used),
                rms_error_s=float(np.sqrt(np.mean(residual ** 2))),
                rms_relative_error=float(np.sqrt(np.mean((residual / measured) ** 2))),
                runs=sorted({r["run"] for r in used}))


def compute_scale(preset: str, seq_len: int) -> float:
    """A sequence's training FLOPs for `preset` over one fitted sequence's (Qwen2.5-7B at 4,096 tokens). Every fitted
    term (per sequence and per micro-step) is scaled by it for another model or length: compute follows the FLOPs,
    and the per-micro-step gathers and hooks grow with the model too. The ranking within one preset is unchanged."""
    return models.flops_per_token(models.shape(preset), seq_len) * seq_len / \
        (models.flops_per_token(models.shape(FITTED_PRESET), FITTED_SEQ_LEN) * FITTED_SEQ_LEN)


def predict_step_seconds(coefficients: dict, engine, kernels, micro_batch, grad_accum, checkpointed, layers, params,
                         gpus, scale: float = 1.0) -> float:
    x = np.array([coefficients[name] * scale for name in unknowns()])
    return float(np.dot(features(engine, kernels, micro_batch, grad_accum, checkpointed, layers), x)) + \
        optimizer_seconds(params, gpus)


def plan(preset="qwen2.5-7b", gpus=2, gpu_memory="H200", batch_per_gpu=8, seq_len=4096, sides=("stock", "labs"),
         rows=None) -> list[dict]:
    """Every candidate of each side that labs.memory says fits, with its predicted tokens/s per GPU, fastest first."""
    rows = results_lib.rows(results_lib.load_all()) if rows is None else rows
    model = fit(rows)
    dims = models.shape(preset)
    layers, params = dims["num_hidden_layers"], models.param_counts(dims)["total"]
    scale = compute_scale(preset, seq_len)
    plans = []
    for side in sides:
        for name, peak in sweep.fitting(sweep.candidates(side, batch_per_gpu, layers), preset, gpus, gpu_memory, seq_len):
            _, engine, ck, mb, ga = name.split("-")
            mb, ga = int(mb[2:]), int(ga[2:])
            step = predict_step_seconds(model["coefficients"], engine, "liger" if side == "labs" else "stock", mb, ga,
                                        models.checkpointed_layers(ck[2:], layers), layers, params, gpus, scale)
            plans.append(dict(side=side, case=name, predicted_peak_gib=peak / memory.GiB, predicted_step_s=step,
                              predicted_tokens_per_s_per_gpu=batch_per_gpu * seq_len / step))
    return sorted(plans, key=lambda p: -p["predicted_tokens_per_s_per_gpu"])
