"""Read the committed GPU results (results/gpu/*.json, written by `labs bench`) into rows the chapters show.
Each file records the machine, versions, command, date, every case's resolved config, per-step metrics and
summary, so every figure shown can be traced to the run that measured it."""
from __future__ import annotations

import json
from pathlib import Path

from labs import RESULTS, memory, models
from labs.table import Table


def load_all(folder: Path = RESULTS / "gpu") -> dict[str, dict]:
    """{file stem: bench result}, oldest first (the files are named by date and run: a ... z, then x2 after x)."""
    paths = sorted(Path(folder).glob("*.json"), key=lambda p: (p.stem[:10], run_label(p.stem), p.stem))
    return {path.stem: json.loads(path.read_text()) for path in paths}


def rows(results: dict[str, dict], valid_only: bool = True) -> list[dict]:
    """One flat row per measured case: run, case, throughput, MFU, memory, timers."""
    table = []
    for run, result in results.items():
        for case, entry in result["cases"].items():
            if entry.get("status") != "ok" or (valid_only and entry.get("valid") is False):
                continue
            s = entry["summary"]
            timers = entry.get("timers_ms") or {}
            options = entry.get("options", {})
            table.append(dict(
                run=run, case=case, preset=s["preset"], seq_len=s["seq_len"], gpus=s["world_size"], engine=s["engine"], stage=s["zero_stage"],
                precision=s["precision"], micro_batch=s["micro_batch"], grad_accum=s["gradient_accumulation"],
                tokens_per_step=s["tokens_per_step"], loss=s["loss"], kernels=s.get("kernels", "stock"),
                checkpointing=s["activation_checkpointing"], tokens_per_s_per_gpu=s["tokens_per_s_per_gpu"],
                tflops_per_gpu=s["tflops_per_gpu"], mfu=s["mfu"], peak_gib=max(s["peak_memory_bytes"]) / 2**30,
                after_init_gib=max(s["allocated_after_init_bytes"]) / 2**30, step_s=s["median_step_time_s"],
                fwd_ms=timers.get("fwd"), bwd_ms=timers.get("bwd"), step_ms=timers.get("step"),
                losses=[m["loss"] for m in entry["metrics"]], ds_config=entry.get("ds_config"),
                date=result["date"], gpu=result["host"]["gpus"][0], mfu_causal=_mfu_causal(s),
                fp8=options.get("fp8") == "True", compile=options.get("compile") == "True",
                sdpa=options.get("sdpa", "default"), gpu_memory_cap=result.get("gpu_memory")))
    return table


def _mfu_causal(summary: dict) -> float | None:
    """MFU with the causal attention convention; runs recorded before it was stored get it from their dims."""
    if summary.get("mfu_causal") is not None or summary.get("mfu") is None:
        return summary.get("mfu_causal")
    dims = models.shape(summary["preset"])
    full, causal = (models.flops_per_token(dims, summary["seq_len"], causal=c) for c in (False, True))
    return summary["mfu"] * causal / full


def estimate_for(row: dict) -> memory.MemoryEstimate:
    """labs.memory's estimate for a recorded case, from the configuration the result file records (computed now,
    not stored): the same model, ranks, DeepSpeed config, batch, loss, kernels and checkpointing."""
    return memory.estimate(dims=models.shape(row["preset"]), gpus_per_node=row["gpus"], seq_len=row["seq_len"],
                           loss=row["loss"], kernels=row["kernels"], activation_checkpointing=row["checkpointing"],
                           ds_config=row["ds_config"], engine=row["engine"], micro_batch=row["micro_batch"],
                           grad_accum=row["grad_accum"])


def predicted_peak_gib(row: dict) -> float:
    """labs.memory's predicted peak (GiB of torch.cuda.max_memory_allocated) for a recorded case."""
    return estimate_for(row).total_per_gpu_bytes / 2**30


def find(table: list[dict], run_suffix: str, case: str) -> dict:
    """The row of `case` in the run whose name ends with `run_suffix` (e.g. 'a_zero3_2xh200')."""
    matches = [r for r in table if r["run"].endswith(run_suffix) and r["case"] == case]
    if len(matches) != 1:
        raise KeyError(f"{case} in *{run_suffix}: {len(matches)} matches")
    return matches[0]


def gpus_used(result: dict) -> str:
    """The GPUs a bench invocation ran on, as the file records them: "2 x NVIDIA H200", or "1 of 2 x NVIDIA H200"
    where its cases ran on fewer GPUs (their world size) than the host had."""
    host = result["host"]["gpus"]
    used = {case["summary"]["world_size"] for case in result["cases"].values() if case.get("status") == "ok"}
    used |= {int(case["options"]["nproc"]) for case in result["cases"].values() if "nproc" in case.get("options", {})}
    most = max(used, default=len(host))
    return f"{len(host)} x {host[0]}" if most >= len(host) else f"{most} of {len(host)} x {host[0]}"


def provenance(results: dict[str, dict]) -> list[str]:
    lines = []
    for run, r in results.items():
        h = r["host"]
        lines.append(f"{run}: {r['date'][:16]}, {gpus_used(r)} (driver {h['driver']}), "
                     f"torch {h['torch']}, deepspeed {h['deepspeed']}, transformers {h['transformers']}, "
                     f"liger-kernel {h['liger-kernel']}; `{r['command'].replace('__main__.py', 'labs')}`")
    return lines


def format_rows(table: list[dict], columns: list[str]) -> Table:
    """The chosen columns of result rows as a table (MFU as a percentage, large numbers with separators)."""
    def spec(column):
        values = [row[column] for row in table]
        if column == "mfu":
            return ".1%"
        if all(isinstance(v, float) for v in values):
            return ",.0f" if min(values) >= 1000 else ",.1f"
        return ""
    return Table(table, [(c, c, spec(c)) for c in columns])


def run_label(stem: str) -> str:
    """The run's name in results/README.md: the word after the date, "a" ... "z", "x2" (2026-12-02_x2_repeat_...)."""
    return stem[11:].split("_")[0]


def peak_comparisons(merge_repeats: bool = False) -> list[dict]:
    """Every valid recorded bf16/fp16 case: the measured peak (max over ranks of torch.cuda.max_memory_allocated)
    against labs.memory's prediction for the same configuration, with that configuration. The fp8 cases are left
    out: float8 training's casts are not in the memory model. `merge_repeats`: one row per case measured again in
    later runs with the same prediction, `runs` listing them all and the measurement farthest from it kept."""
    found = []
    for row in (r for r in rows(load_all()) if not r["fp8"]):
        predicted = predicted_peak_gib(row) * memory.GiB
        measured = row["peak_gib"] * memory.GiB
        run = run_label(row["run"])
        found.append(dict(name=f"{run}:{row['case']}", run=run, case=row["case"], preset=row["preset"],
                          device=f"{row['gpus']} x {row['gpu']}", gpus=row["gpus"],
                          engine=_engine_name(row), micro_batch=row["micro_batch"], grad_accum=row["grad_accum"],
                          checkpointing=row["checkpointing"], loss=row["loss"], kernels=row["kernels"],
                          measured_bytes=int(measured), predicted_bytes=int(predicted), ratio=measured / predicted))
    if not merge_repeats:
        return found
    merged: dict[tuple, dict] = {}
    for row in found:
        key = (row["case"], row["device"], row["predicted_bytes"])
        kept = merged.setdefault(key, dict(row, runs=""))
        kept["runs"] = ", ".join(filter(None, [kept["runs"], row["run"]]))
        if abs(row["ratio"] - 1) > abs(kept["ratio"] - 1):
            kept.update(measured_bytes=row["measured_bytes"], ratio=row["ratio"])
    return list(merged.values())


def _engine_name(row: dict) -> str:
    offload = "+offload" if "offload" in row["case"] else ""
    return ("fsdp2" if row["engine"] == "fsdp2" else f"zero{row['stage']}") + offload
