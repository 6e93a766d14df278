"""`labs bench`: the stock reference and the labs fast path, run one after the other on the same GPUs in one
invocation, with throughput, MFU, memory (measured and predicted) and where the time goes.

Stock = what a user gets today from HF + DeepSpeed: the HF model and its loss (full logits upcast to fp32),
HF's gradient checkpointing on every layer, DeepSpeed's FusedAdam, the stock config (ds_configs/bench/stock_*).
labs = the same model, data, precision (bf16 weights, fp32 master weights and AdamW), still plain DeepSpeed, with
levers chosen per case: Liger kernels and fused linear cross-entropy, less or no activation checkpointing,
torch's fused AdamW, larger buckets, and for offload partial offload and bigger batches.

MFU = flops_per_token * tokens/s per GPU / peak, flops_per_token = 6 * (N - input embedding) + 12 * L * H * S
(labs.models.flops_per_token; the formula of the shared reference figures), peak 989 TFLOP/s dense bf16 (H100/H200).
"""
from __future__ import annotations

import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from labs import CONFIGS, env, launch, memory
from labs.errors import LabsError, RankFailed
from labs.table import Table

# name -> (what it is, launch options). nproc None = every GPU (or 2 CPU ranks).
CASES: dict[str, tuple[str, dict]] = {
    "stock-zero3": ("stock HF + DeepSpeed ZeRO-3, full activation checkpointing",
                    dict(config="bench/stock_zero3.json", stock=True, activation_checkpointing="full")),
    "stock-zero2": ("stock HF + DeepSpeed ZeRO-2, full activation checkpointing",
                    dict(config="bench/stock_zero2.json", stock=True, activation_checkpointing="full")),
    "stock-zero3-offload": ("stock ZeRO-3 + optimizer offload to CPU (DeepSpeedCPUAdam), full checkpointing, 1 GPU",
                            dict(config="bench/stock_zero3_offload.json", stock=True,
                                 activation_checkpointing="full", nproc=1)),
    "labs-zero3": ("labs ZeRO-3: Liger kernels + fused linear CE, no activation checkpointing, fused AdamW, "
                   "1e9 buckets", dict(config="bench/labs_zero3.json", fast=True, activation_checkpointing="none")),
    "labs-zero3-granular": ("labs-zero3 fetching each decoder layer as one unit (stage3_module_granularity_threshold); "
                            "REJECTED: its loss stopped tracking stock on H200", dict(
                                config="bench/labs_zero3_granular.json", fast=True, activation_checkpointing="none")),
    "labs-zero3-mb3": ("labs-zero3 at micro-batch 3 (more tokens per gather and per optimizer step)",
                       dict(config="bench/labs_zero3.json", fast=True, activation_checkpointing="none",
                            micro_batch=3)),
    "labs-zero3-mb4-sel8": ("labs-zero3 at micro-batch 4, checkpointing 8 of 28 layers to fit",
                            dict(config="bench/labs_zero3.json", fast=True, activation_checkpointing="8",
                                 micro_batch=4)),
    "labs-zero3-subgroup": ("labs-zero3 with one optimizer sub-group per rank (sub_group_size 1e10)",
                            dict(config="bench/labs_zero3_subgroup.json", fast=True, activation_checkpointing="none")),
    "labs-zero2": ("labs ZeRO-2 (levers of labs-zero3)",
                   dict(config="bench/labs_zero2.json", fast=True, activation_checkpointing="none")),
    "labs-zero1": ("labs ZeRO-1 (levers of labs-zero3)",
                   dict(config="bench/labs_zero1.json", fast=True, activation_checkpointing="none")),
    "labs-fsdp2": ("FSDP2 (fully_shard per layer), same levers", dict(config="bench/labs_zero3.json", fast=True,
                                                                       engine="fsdp2", activation_checkpointing="none")),
    "labs-zero3-fp16": ("labs-zero3 in fp16 with dynamic loss scaling",
                        dict(config="bench/labs_zero3_fp16.json", fast=True, activation_checkpointing="none")),
    "labs-zero3-ckpt": ("labs-zero3 with full activation checkpointing (isolates the recompute lever)",
                        dict(config="bench/labs_zero3.json", fast=True, activation_checkpointing="full")),
    "lever-liger": ("stock-zero3 + Liger kernels and fused linear CE only (checkpointing kept)",
                    dict(config="bench/stock_zero3.json", fast=True, activation_checkpointing="full")),
    "lever-nockpt": ("stock-zero3 without activation checkpointing only (stock kernels and loss)",
                     dict(config="bench/stock_zero3.json", stock=True, activation_checkpointing="none")),
    "labs-zero3-offload": ("labs ZeRO-3 + full optimizer offload: Liger, no checkpointing, micro-batch 4, 1 GPU",
                           dict(config="bench/labs_zero3_offload.json", fast=True, activation_checkpointing="none",
                                micro_batch=4, nproc=1)),
    "labs-zero3-offload-ga4": ("labs-zero3-offload with 4 micro-batches per optimizer step (amortises the CPU step)",
                               dict(config="bench/labs_zero3_offload.json", fast=True, activation_checkpointing="none",
                                    micro_batch=4, grad_accum=4, nproc=1)),
    "labs-zero3-offload-half": ("labs-zero3-offload keeping half of the optimizer on the GPU (offload ratio 0.5)",
                                dict(config="bench/labs_zero3_offload_half.json", fast=True,
                                     activation_checkpointing="none", micro_batch=4, nproc=1)),
}
PAIRS = [("labs-zero3", "stock-zero3"), ("labs-zero3-mb3", "stock-zero3"), ("labs-zero3-mb4-sel8", "stock-zero3"),
         ("labs-zero3-subgroup", "stock-zero3"), ("labs-zero3-granular", "labs-zero3"), ("labs-zero3-offload", "stock-zero3-offload"),
         ("labs-zero3-offload-ga4", "stock-zero3-offload"), ("labs-zero3-offload-half", "stock-zero3-offload"),
         ("lever-liger", "stock-zero3"), ("lever-nockpt", "stock-zero3"), ("labs-zero3-ckpt", "stock-zero3"),
         ("labs-zero2", "stock-zero2"), ("labs-fsdp2", "labs-zero3"), ("labs-zero3-fp16", "labs-zero3")]


def _liger_available() -> bool:
    try:
        import liger_kernel  # noqa: F401
        return torch.cuda.is_available()
    except ImportError:
        return False


def case_options(name: str, preset: str, steps: int, seq_len, micro_batch) -> dict:
    if name not in CASES:
        raise LabsError(f"unknown bench case '{name}'; choose from: {', '.join(CASES)}")
    options = dict(CASES[name][1])
    fast = options.pop("fast", False)
    # Liger needs Triton on a GPU; on a CPU the fast path falls back to labs' chunked loss.
    options.update(loss=("liger" if _liger_available() else "chunked") if fast else "hf",
                   kernels="liger" if fast and _liger_available() else "stock")
    options["config"] = CONFIGS / options["config"]
    options.update(preset=preset, steps=steps, seq_len=seq_len, warmup_steps=2)
    if micro_batch and "micro_batch" not in options:
        options["micro_batch"] = micro_batch
    return options


def run_cases(names: list[str], preset="qwen2.5-7b", steps=8, seq_len=None, micro_batch=None, out=None,
              work=None, stream=True) -> dict:
    """Run the named cases one after the other; returns (and writes to `out`, after every case) the result with
    every case's summary, per-step metrics, resolved config and predicted memory. The run folders go to `work`
    (default: a new folder under the system's temporary directory, never into the course checkout)."""
    work = Path(work) if work else Path(tempfile.mkdtemp(prefix="labs-bench-"))
    options = {name: case_options(name, preset, steps, seq_len, micro_batch) for name in names}
    for name, opts in options.items():   # every case's input is checked before the first one runs
        launch.prepare(out=work / name, **opts)
    result = dict(what="labs bench: stock reference and labs fast path on the same machine, one after the other",
                  date=time.strftime("%Y-%m-%dT%H:%M:%S%z"), command=shlex.join([Path(sys.argv[0]).name] + sys.argv[1:]),
                  host=host_info(), preset=preset, steps=steps, timing="median step time of steps 3..N",
                  mfu_formula="(6 * (N - input embedding) + 12 * layers * hidden * seq) * tokens/s per GPU / peak",
                  cases={})
    for name in names:
        print(f"\n=== {name}: {CASES[name][0]}", flush=True)
        entry = dict(description=CASES[name][0], options={k: str(v) for k, v in options[name].items()})
        started = time.time()
        try:
            run = launch.run(out=work / name, stream=stream, **options[name])
            entry.update(status="ok", summary=run.summary, ds_config=run.ds_config, metrics=run.metrics,
                         timers_ms=_mean_timers(run.metrics, warmup=2), predicted=_predicted(run))
        except RankFailed as exc:
            entry.update(status="failed", error=_last_error_line(str(exc)), error_tail=str(exc)[-3000:])
        entry["wall_s"] = round(time.time() - started, 1)
        result["cases"][name] = entry
        if out:   # written after every case, so a later crash or time-out keeps what was measured
            Path(out).parent.mkdir(parents=True, exist_ok=True)
            Path(out).write_text(json.dumps(_with_ratios(result), indent=1) + "\n")
    return _with_ratios(result)


def _with_ratios(result):
    cases = result["cases"]
    ok = {n for n, c in cases.items() if c.get("status") == "ok"}
    result["ratios"] = {f"{a} / {b}": cases[a]["summary"]["tokens_per_s_per_gpu"] / cases[b]["summary"]["tokens_per_s_per_gpu"]
                        for a, b in PAIRS if a in ok and b in ok}
    return result


def _mean_timers(records, warmup):
    kept = [r["timers_ms"] for r in records[warmup:] if r.get("timers_ms")]
    if not kept:
        return None
    return {k: statistics.mean(t[k] for t in kept) for k in kept[0]}


def _predicted(run) -> dict:
    """labs.memory's prediction for this run's configuration: the peak and what it is made of."""
    est = memory.from_run(run)
    return dict(total_per_gpu_bytes=est.total_per_gpu_bytes, peak_phase=est.peak_phase,
                model_states_per_gpu_bytes=est.model_states_per_gpu_bytes, phases=est.phases)


def _last_error_line(message: str) -> str:
    lines = [line for line in message.strip().splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or "error" in line]
    return (errors or lines or ["unknown"])[-1][:500]


def host_info() -> dict:
    info = dict(env.versions(), cuda=torch.version.cuda, cpu_cores=os.cpu_count(), hostname=platform.node())
    if torch.cuda.is_available():
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        try:
            info["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                            capture_output=True, text=True, timeout=20).stdout.split()[0]
        except Exception:
            info["driver"] = None
    try:
        info["host_memory_gib"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError):
        pass
    return info


def format_table(result: dict) -> str:
    rows = []
    for name, case in result["cases"].items():
        if case["status"] != "ok":
            rows.append(dict(case=name, gpus="", tok=case["status"], tflops="", mfu="", peak="", pred="",
                             timers=case.get("error", "")[:60]))
            continue
        s, t = case["summary"], case.get("timers_ms") or {}
        predicted = (case.get("predicted") or {}).get("total_per_gpu_bytes")
        rows.append(dict(case=name, gpus=str(s["world_size"]), tok=f"{s['tokens_per_s_per_gpu']:,.0f}",
                         tflops=f"{s['tflops_per_gpu']:.1f}", mfu=f"{s['mfu']:.1%}" if s.get("mfu") else "-",
                         peak=f"{max(s['peak_memory_bytes']) / 2**30:.1f}",
                         pred=f"{predicted / 2**30:.1f}" if predicted else "-",
                         timers="/".join(f"{t[k]:.0f}" for k in ("fwd", "bwd", "step") if k in t) or "-"))
    headers = dict(case="case", gpus="GPUs", tok="tokens/s/GPU", tflops="TFLOP/s", mfu="MFU", peak="peak GiB",
                   pred="pred GiB", timers="fwd/bwd/step ms")
    lines = [str(Table(rows, [(headers[k], k, "") for k in headers]))] if rows else []
    lines += [f"ratio {pair}: {ratio:.2f}x tokens/s per GPU" for pair, ratio in result["ratios"].items()]
    return "\n".join(lines)
