"""Best against best: each side (stock, labs) at its own fastest configuration within the same memory, at the same
tokens per optimizer step, measured in one invocation.

    cands = sweep.candidates("labs", batch_per_gpu=8, layers=28)          # composed case names (labs.bench.cases)
    fit = sweep.fitting(cands, preset="qwen2.5-7b", gpus=2, gpu_memory="80GiB")   # labs.memory says they fit
    result = runner.run_cases(chosen, ...); sweep.best_vs_best(result)

A candidate fixes the batch: micro-batch x accumulation = `batch_per_gpu` sequences per GPU per optimizer step, so
every candidate does the same work per step; only how it is cut (and which levers) differ. The memory model prunes
what cannot fit (`MemoryEstimate.fits`: it is within 10% of every recorded peak, and the card's usable memory keeps
1 GiB + 5% free); the planner's cost model
(labs.bench.planner) orders the rest; the sweep measures the best few of each side.
"""
from __future__ import annotations

from labs import config as config_lib
from labs import memory, models
from labs.bench import cases

ENGINES = {"stock": ("zero2", "zero3", "fsdp2"), "labs": ("zero2", "zero3", "fsdp2")}


def candidates(side: str, batch_per_gpu: int, layers: int, engines=None, checkpointing=None) -> list[str]:
    """Every (engine, checkpointed layers, micro-batch) for one side, as composed case names. Stock can only turn
    HF's checkpointing on or off; labs can checkpoint the first k layers (k in steps of a quarter of the model)."""
    engines = engines or ENGINES[side]
    if checkpointing is None:
        checkpointing = ["full", "none"] if side == "stock" else \
            ["none"] + [str(k) for k in range(layers // 4, layers, max(1, layers // 4))] + ["full"]
    names = []
    for engine in engines:
        for ck in checkpointing:
            for mb in (d for d in range(1, batch_per_gpu + 1) if batch_per_gpu % d == 0):
                names.append(f"{side}-{engine}-ck{ck}-mb{mb}-ga{batch_per_gpu // mb}")
    return names


def predicted_estimate(name: str, preset: str, gpus: int, seq_len: int | None = None) -> memory.MemoryEstimate:
    """labs.memory's estimate for a case, with the case's own config, loss, kernels and checkpointing."""
    options = cases.case_options(name, preset, steps=1, seq_len=seq_len, micro_batch=None, on_gpu=True)
    return memory.estimate(preset, gpus_per_node=gpus, seq_len=seq_len, micro_batch=options.get("micro_batch"),
                           grad_accum=options.get("grad_accum"),
                           activation_checkpointing=options["activation_checkpointing"], loss=options["loss"],
                           kernels=options["kernels"], engine=options.get("engine", "deepspeed"),
                           ds_config=config_lib.load(options["config"]))


def predicted_peak_bytes(name: str, preset: str, gpus: int, seq_len: int | None = None) -> int:
    """labs.memory's peak per GPU for a case (predicted_estimate's)."""
    return predicted_estimate(name, preset, gpus, seq_len).total_per_gpu_bytes


def fitting(names: list[str], preset: str, gpus: int, gpu_memory, seq_len: int | None = None) -> list[tuple[str, int]]:
    """The candidates labs.memory says fit `gpu_memory` (a size or a GPU name: `MemoryEstimate.fits`), each with its
    predicted peak."""
    card = memory.parse_bytes(gpu_memory)
    fit = []
    for name in names:
        estimate = predicted_estimate(name, preset, gpus, seq_len)
        if estimate.fits(card):
            fit.append((name, estimate.total_per_gpu_bytes))
    return fit


def best_vs_best(result: dict, tokens_per_step: int | None = None) -> dict:
    """The fastest measured case of each side (tokens/s per GPU), and their ratio. Only cases at `tokens_per_step`
    count (default: all, which must then agree): a ratio of different work is not a result."""
    best, rows = {}, []
    for name, case in result["cases"].items():
        if case.get("status") != "ok":
            continue
        s = case["summary"]
        if tokens_per_step is not None and s["tokens_per_step"] != tokens_per_step:
            continue
        side = name.split("-")[0]
        rows.append(dict(side=side, case=name, tokens_per_step=s["tokens_per_step"],
                         tokens_per_s_per_gpu=s["tokens_per_s_per_gpu"], mfu=s.get("mfu"), mfu_causal=s.get("mfu_causal"),
                         peak_gib=max(s["peak_memory_bytes"]) / 2**30))
        if side in ("stock", "labs") and s["tokens_per_s_per_gpu"] > best.get(side, {}).get("tokens_per_s_per_gpu", 0):
            best[side] = rows[-1]
    steps = {r["tokens_per_step"] for r in rows}
    assert len(steps) <= 1, f"cases ran at different tokens per optimizer step: {sorted(steps)}"
    ratio = best["labs"]["tokens_per_s_per_gpu"] / best["stock"]["tokens_per_s_per_gpu"] \
        if {"labs", "stock"} <= set(best) else None
    return dict(best=best, ratio=ratio, rows=rows, tokens_per_step=steps.pop() if steps else None)


def flops_conventions(preset: str, seq_len: int) -> dict:
    """FLOPs per token under both conventions, for the table's footnote."""
    dims = models.shape(preset)
    return dict(full=models.flops_per_token(dims, seq_len), causal=models.flops_per_token(dims, seq_len, causal=True))
