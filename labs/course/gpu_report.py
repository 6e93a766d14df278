"""Chapter 9's readings of the recorded GPU runs (results/gpu, labs.bench): sweeps, levers, the planner's picks and
the targets, each computed from the files, never typed in.

    gpu_report.sweep_table("f_sweep_2xh200")        # every case of a sweep, with what the planner predicted
    gpu_report.planner_check("f_sweep_2xh200")       # per side: the planner's pick against the best measured
    gpu_report.targets()                             # the issue's targets, met or not, with their numbers
"""
from __future__ import annotations

import json
import re

from labs import RESULTS, models
from labs.bench import cases, results
from labs.course import offload_verdict, zenflow_columns_report, zenflow_long, zenflow_moments_report, zenflow_report
from labs.metrics import read_jsonl
from labs.table import Table

RUNS = dict(sweep="f_sweep_2xh200", levers="g_levers_2xh200", cap="h_cap80_2xh200", cap_more="i_cap80_more_2xh200",
            fp8="j_fp8_compile_2xh200", fp8_vs_stock="k_fp8_vs_stock_2xh200", fp8_cap="l_fp8_cap80_2xh200",
            offload="m_offload_3b_1xh200", offload_stock="n_offload_stock_best_3b_1xh200",
            offload_overlap="o_offload_overlap_3b_1xh200", ratio="p_offload_ratio_3b_1xh200",
            nvme="q_offload_nvme_3b_1xh200")
THREADS = {threads: f"r_offload_omp{threads}_3b_1xh200" for threads in (16, 8, 4)}   # run r: one invocation each
ROUND5, GRANULAR = RESULTS / "gpu" / "round5_1xh200", RESULTS / "gpu" / "granular_1xh200"
MAKE_TRAIN = RESULTS / "gpu" / "make_train"         # 2 x H200 at its root; the one-lever runs on one H200 below
# Run m's cases: labs' fastest without offload at the same 8 sequences per step (what "hidden" is measured against).
OFFLOAD_REFERENCE = "labs-zero2-mb4-ga2-gpus1"
# Run p's: ZeRO-3 with half of the optimizer offloaded, and ZeRO-3 without offload at the same tokens per step.
PARTIAL_OFFLOAD, PARTIAL_REFERENCE = "labs-zero3-offloadhalf-mb8-gpus1", "labs-zero3-mb4-ga2-gpus1"


def result_file(suffix: str) -> dict:
    """The one recorded result file whose name ends with `suffix` (e.g. "x_sweep_3b_1xh200")."""
    matches = [r for name, r in results.load_all().items() if name.endswith(suffix)]
    if len(matches) != 1:
        raise KeyError(f"results/gpu/*{suffix}.json: {len(matches)} files")
    return matches[0]


def case_rows(suffix: str) -> list[dict]:
    """Every case of one recorded invocation, failed ones included (an OOM is a finding)."""
    result = result_file(suffix)
    predicted = {p["case"]: p for p in result.get("sweep", {}).get("plan", [])}
    rows = []
    for name, case in result["cases"].items():
        side = name.split("-")[0]
        row = dict(case=name, side=side, status=case["status"], predicted=predicted.get(name, {}),
                   valid=case.get("valid", True), invalid_reason=case.get("invalid_reason", ""))
        if case["status"] == "ok":
            s = case["summary"]
            row.update(tokens_per_step=s["tokens_per_step"], tokens_per_s_per_gpu=s["tokens_per_s_per_gpu"],
                       mfu=s["mfu"], mfu_causal=s.get("mfu_causal"), peak_gib=max(s["peak_memory_bytes"]) / 2**30,
                       losses=[m["loss"] for m in case["metrics"]])
        else:
            row["error"] = "out of GPU memory" if "OutOfMemory" in case.get("error", "") else case.get("error", "")
        rows.append(row)
    return rows


def sweep_table(suffix: str) -> Table:
    rows = case_rows(suffix)
    for row in rows:
        row["measured"] = f"{row['tokens_per_s_per_gpu']:,.0f}" if row["status"] == "ok" else row["error"]
        row["planned"] = f"{row['predicted']['predicted_tokens_per_s_per_gpu']:,.0f}" if row["predicted"] else "-"
        for key, spec in (("mfu", ".1%"), ("mfu_causal", ".1%"), ("peak_gib", ".1f")):
            row[key + "_text"] = format(row[key], spec) if row["status"] == "ok" else "-"
    return Table(rows, [("case", "case", ""), ("tokens/s per GPU", "measured", ""), ("MFU (full)", "mfu_text", ""),
                        ("MFU (causal)", "mfu_causal_text", ""), ("peak GiB", "peak_gib_text", ""),
                        ("planner's tokens/s", "planned", "")])


def best(suffix: str, side: str, offload: bool | None = None) -> dict:
    """The fastest valid case of one side (only the offload cases, or only the others, when `offload` is given)."""
    ok = [r for r in case_rows(suffix) if r["side"] == side and r["status"] == "ok" and r["valid"]
          and (offload is None or ("offload" in r["case"] or "zenflow" in r["case"]) == offload)]
    return max(ok, key=lambda r: r["tokens_per_s_per_gpu"])


# What to run: (GPUs, model, memory per GPU, the invocation that measured both sides' best there at 8 sequences per
# GPU). Two GPUs at 80 GB: run h, on H200s under the plain cap, whose best cases reserved more than a real H100 leaves
# PyTorch (labs.course.cap_checks). One GPU at 80 GB: run y5 reran run y's best of each side and the stock case y2
# found faster under labs.card_cap's corrected cap (that one does not fit), and run y3 swept the real H100.
RECIPES = ((2, "qwen2.5-7b", "141 GB (H200)", RUNS["sweep"]),
           (2, "qwen2.5-7b", "80 GB (capped H200; fit on a real 80 GB card not verified)", RUNS["cap"]),
           (1, "qwen2.5-3b", "141 GB (H200)", "x_sweep_3b_1xh200"),
           (1, "qwen2.5-3b", "80 GB (H200 under labs.card_cap)", "y5_cap_fixed_3b_1xh200"),
           (1, "qwen2.5-3b", "80 GB (real H100)", "y3_sweep_3b_1xh100"))


def train_command(suffix: str, case: str, gpus: int) -> str:
    """The `labs train` line that runs a recorded case as a training run (its options as the bench launched it, less
    the cap: on a card of that size it is the card's whole memory)."""
    return cases.train_line(result_file(suffix)["cases"][case]["options"], gpus)


def recipes() -> list[dict]:
    """Per setup of RECIPES: each side's fastest measured case, its tokens/s per GPU, MFU, peak and the ratio, with
    the `labs train` line for labs' (same tokens per optimizer step on both sides, one invocation); then the 7B on
    one real H100 with the optimizer offloaded (labs.course.offload_verdict.recipe_row)."""
    rows = []
    for gpus, preset, budget, suffix in RECIPES:
        labs, stock = best(suffix, "labs"), best(suffix, "stock")
        assert labs["tokens_per_step"] == stock["tokens_per_step"], suffix          # like for like
        rows.append(dict(gpus=gpus, preset=preset, budget=budget, run=suffix.split("_")[0],
                         labs=labs["case"], labs_tokens_per_s=labs["tokens_per_s_per_gpu"], mfu=labs["mfu"],
                         mfu_causal=labs["mfu_causal"], peak_gib=labs["peak_gib"], stock=stock["case"],
                         stock_tokens_per_s=stock["tokens_per_s_per_gpu"],
                         ratio=labs["tokens_per_s_per_gpu"] / stock["tokens_per_s_per_gpu"],
                         command=train_command(suffix, labs["case"], gpus)))
    return rows + [offload_verdict.recipe_row()]        # the 7B on one 80 GB card, offloaded (not one invocation:
                                                        # labs' slower run against stock's faster, one host)


def planner_check(suffix: str) -> list[dict]:
    """Per side: the case the planner ranked first (from runs recorded before this one) against the best measured."""
    rows = case_rows(suffix)
    checks = []
    for side in ("stock", "labs"):
        planned = [r for r in rows if r["side"] == side and r["predicted"]]
        pick = max(planned, key=lambda r: r["predicted"]["predicted_tokens_per_s_per_gpu"])
        top = best(suffix, side)
        got = pick["tokens_per_s_per_gpu"] if pick["status"] == "ok" else 0.0
        checks.append(dict(side=side, pick=pick["case"], pick_measured=got,
                           pick_result=f"{got:,.0f}" if got else pick.get("error", pick["status"]), best=top["case"],
                           best_measured=top["tokens_per_s_per_gpu"], pick_over_best=got / top["tokens_per_s_per_gpu"]))
    return checks


def by_case(suffix: str, ok_only: bool = False) -> dict[str, dict]:
    """A recorded bench file's rows (case_rows) by case name; with `ok_only`, only the cases that ran."""
    return {r["case"]: r for r in case_rows(suffix) if r["status"] == "ok" or not ok_only}


def lever_rows(suffix: str, base: str) -> list[dict]:
    """Each case of a lever run against the base case of the same invocation (one lever each)."""
    rows = by_case(suffix, ok_only=True)
    return [dict(r, lever=name.removeprefix(base).strip("-") or "(base)",
                 vs_base=r["tokens_per_s_per_gpu"] / rows[base]["tokens_per_s_per_gpu"])
            for name, r in rows.items()]


def offload_rows(suffix: str = RUNS["offload"]) -> list[dict]:
    """Run m's cases with the optimizer step's seconds (DeepSpeed's `step` timer: on the CPU for offload cases) and
    its share of the whole step; an invalid case keeps its row, with why."""
    timers = {name: case.get("timers_ms") or {} for name, case in result_file(suffix)["cases"].items()}
    rows = []
    for row in case_rows(suffix):
        if row["status"] == "ok":
            step_s, timer = row["tokens_per_step"] / row["tokens_per_s_per_gpu"], timers[row["case"]]
            row.update(optimizer_step_s=timer.get("step", 0.0) / 1000, step_s=step_s, fwd_ms=timer.get("fwd"),
                       bwd_ms=timer.get("bwd"))
            row["step_share"] = row["optimizer_step_s"] / step_s
            row["note"] = f"invalid: {row['invalid_reason']}" if not row["valid"] else ""
        rows.append(row)
    return rows


def offload_bounds(suffix: str = RUNS["offload"], to_preset="qwen2.5-7b") -> dict:
    """What run m's step times allow. The optimizer step (DeepSpeed's `step` timer: CPU Adam and the copy back) is the
    same work on both sides, so labs / stock can grow only through the rest of the step (the GPU part); if that part
    cost nothing, the ratio would be stock's step over labs' CPU step. And the CPU's share of labs' step at another
    size: the CPU step scaled by the parameter count, the GPU part by the FLOPs per token (an estimate, not a run)."""
    rows = {r["case"]: r for r in offload_rows(suffix)}
    labs, stock = best(suffix, "labs", offload=True), best(suffix, "stock", offload=True)
    labs, stock = rows[labs["case"]], rows[stock["case"]]
    gpu_labs, gpu_stock = labs["step_s"] - labs["optimizer_step_s"], stock["step_s"] - stock["optimizer_step_s"]
    here, there = (models.shape(p) for p in (result_file(suffix)["preset"], to_preset))
    params = models.param_counts(there)["total"] / models.param_counts(here)["total"]
    flops = models.flops_per_token(there, 4096) / models.flops_per_token(here, 4096)
    cpu_there, gpu_there = labs["optimizer_step_s"] * params, gpu_labs * flops
    needed = gpu_stock / (stock["step_s"] / 1.5 - labs["optimizer_step_s"])     # for labs / stock = 1.5
    return dict(labs=labs["case"], stock=stock["case"], gpu_part_speedup=gpu_stock / gpu_labs,
                gpu_part_speedup_for_1_5x=needed,
                ratio_if_gpu_part_were_free=stock["step_s"] / labs["optimizer_step_s"],
                cpu_share_here=labs["step_share"], params_ratio=params, flops_ratio=flops,
                cpu_share_projected=cpu_there / (cpu_there + gpu_there), projected_preset=to_preset)


def offload_ratio(suffix: str) -> tuple[float, dict, dict]:
    """labs' fastest offload case over stock's, both from one invocation: (ratio, labs row, stock row)."""
    labs, stock = best(suffix, "labs", offload=True), best(suffix, "stock", offload=True)
    return labs["tokens_per_s_per_gpu"] / stock["tokens_per_s_per_gpu"], labs, stock


def offload_targets(suffix: str = RUNS["offload"], stock_suffix: str = RUNS["offload_stock"]) -> list[dict]:
    """Issue 12's offload targets (1 x H200, Qwen2.5-3B shape, equal tokens per step): hidden from run m (the only
    invocation with labs without offload beside), labs / stock from runs m and n, each within its own invocation;
    the lower ratio decides, since stock's best setup differs between them."""
    rows = by_case(suffix)
    labs_offload = best(suffix, "labs", offload=True)
    hidden = labs_offload["tokens_per_s_per_gpu"] / rows[OFFLOAD_REFERENCE]["tokens_per_s_per_gpu"]
    in_p = by_case(RUNS["ratio"])           # run p: ZeRO-3 half offload, and without
    hidden_p = in_p[PARTIAL_OFFLOAD]["tokens_per_s_per_gpu"] / in_p[PARTIAL_REFERENCE]["tokens_per_s_per_gpu"]
    (in_m, _, stock_m), (in_n, labs_n, stock_n) = offload_ratio(suffix), offload_ratio(stock_suffix)
    return [
        dict(target="offload hides the CPU step: labs with offload >= 90% of labs without, same tokens per step "
                    "(8 x 1 with offload, 4 x 2 without; 3B, 1 GPU)",
             measured=f"{hidden:.0%} ({labs_offload['case']} vs {OFFLOAD_REFERENCE}); run p: {hidden_p:.0%} "
                      f"({PARTIAL_OFFLOAD} vs {PARTIAL_REFERENCE})", met=max(hidden, hidden_p) >= 0.9),
        dict(target="labs' offload >= 1.5x stock's offload, same tokens per step (3B, 1 GPU; stock: best of the four "
                    "setups run over two invocations, two without checkpointing: not a full search)",
             measured=f"{in_n:.2f}x in run n ({labs_n['case']} vs {stock_n['case']}), {in_m:.2f}x in run m "
                      f"(vs {stock_m['case']})", met=min(in_m, in_n) >= 1.5),
    ]


def round5_rows() -> list[dict]:
    """Runs p (partial offload), q (NVMe) and r (CPU Adam's threads) as offload_rows, each with its run and, for r,
    the thread count the result file records."""
    rows = [dict(r, run=letter) for letter, run in (("p", "ratio"), ("q", "nvme")) for r in offload_rows(RUNS[run])]
    for threads, suffix in THREADS.items():
        assert result_file(suffix)["environment"]["OMP_NUM_THREADS"] == str(threads)
        rows += [dict(r, run=f"r, {threads} threads", threads=threads) for r in offload_rows(suffix)]
    return rows


def disk_bandwidth(log=ROUND5 / "aio_setup.log") -> dict[str, float]:
    """GB/s of the GPU host's disk with direct I/O, from `dd`'s lines in the setup log: write first, then read."""
    found = [(float(b), float(s)) for b, s in re.findall(r"^(\d+) bytes .* copied, ([\d.]+) s", log.read_text(), re.M)]
    (write_bytes, write_s), (read_bytes, read_s) = found
    return dict(write=write_bytes / write_s / 1e9, read=read_bytes / read_s / 1e9)


def nvme_swap_gib(path=ROUND5 / "nvme_swap_size.txt") -> float:
    """`du -sh` of the swap folder after run q (du's G is GiB)."""
    size = path.read_text().split()[0]
    assert size.endswith("G"), size
    return float(size[:-1])


def granular_rows(folder=GRANULAR) -> list[dict]:
    """The 1-GPU granular-fetch runs (2026-12-01), each against its twin with DeepSpeed's per-module hooks: the largest
    relative gap in gradient norm and absolute gap in loss over their steps."""
    runs = {}
    for path in sorted(p for p in folder.iterdir() if p.is_dir()):
        config = json.loads((path / "ds_config.json").read_text())
        summary = json.loads((path / "summary.json").read_text())
        runs[path.name] = dict(run=path.name, loss=summary["loss"], kernels=summary["kernels"],
                               granular=bool(config["zero_optimization"].get("stage3_module_granularity_threshold")),
                               metrics=read_jsonl(path / "metrics.jsonl"))
    hooks = {(r["loss"], r["kernels"]): r for r in runs.values() if not r["granular"]}
    stock = hooks[("hf", "stock")]
    rows = []
    for run in (r for r in runs.values() if r is not stock):
        # a granular run against the per-module run of its loss path (the stock one where none was run); the Liger
        # per-module run against the stock one: the gap that kernels alone make, for scale
        twin = stock if not run["granular"] else hooks.get((run["loss"], run["kernels"]), stock)
        pairs = list(zip(run["metrics"], twin["metrics"]))
        rows.append(dict(run, twin=twin["run"],
                         grad_norm_gap=max(abs(a["grad_norm"] / b["grad_norm"] - 1) for a, b in pairs),
                         loss_gap=max(abs(a["loss"] - b["loss"]) for a, b in pairs)))
    return rows


def cpu_granular_gaps(folder=RESULTS / "cpu" / "granular_2ranks") -> dict[str, float]:
    """The 2-rank CPU runs (gloo, tiny): per loss path, the largest per-step loss gap between the granular fetch and
    DeepSpeed's per-module hooks."""
    losses = {p.name: [m["loss"] for m in read_jsonl(p / "metrics.jsonl")] for p in folder.iterdir() if p.is_dir()}
    return {path: max(abs(a - b) for a, b in zip(losses[f"{path}_granular"], losses[f"{path}_hooks"]))
            for path in sorted({name.rsplit("_", 1)[0] for name in losses})}


def make_train_runs(folder=MAKE_TRAIN / "2026-12-01_1xh200") -> dict[str, list[dict]]:
    """{run: per-step metrics} of the 1-GPU make-train runs, one lever each (default, 5-step warm-up, lr 3e-5)."""
    return {path.name: read_jsonl(path / "metrics.jsonl") for path in sorted(folder.iterdir()) if path.is_dir()}


def targets() -> list[dict]:
    """The GPU round's targets, each with the numbers that decide it: 2 x H200, Qwen2.5-7B shape, sequence 4096,
    except the offload targets (runs m and n, and ZenFlow's rounds 12-19: 1 x H200, Qwen2.5-3B shape; round 27c: the
    same on a real H100 80GB; the rounds of offload_verdict.rounds_text(): the 7B on one real H100). The 80 GB row
    ran on H200s under the plain cap: whether its cases fit a real 80 GB card was not run
    (labs.course.cap_checks.over_card)."""
    sweep_ratio = (best(RUNS["sweep"], "labs")["tokens_per_s_per_gpu"]
                   / best(RUNS["sweep"], "stock")["tokens_per_s_per_gpu"])
    labs_best = best(RUNS["sweep"], "labs")
    cap_labs, cap_stock = best(RUNS["cap"], "labs"), best(RUNS["cap"], "stock")      # one invocation
    cap_ratio = cap_labs["tokens_per_s_per_gpu"] / cap_stock["tokens_per_s_per_gpu"]
    picks = planner_check(RUNS["sweep"]) + planner_check(RUNS["cap"])
    return [
        dict(target="labs' best >= 1.5x stock's best, same invocation, same tokens per step (bf16)",
             measured=f"{sweep_ratio:.2f}x ({labs_best['case']} vs {best(RUNS['sweep'], 'stock')['case']})",
             met=sweep_ratio >= 1.5),
        dict(target=">= 55% MFU (full attention convention; causal beside)",
             measured=f"{labs_best['mfu']:.1%} (causal {labs_best['mfu_causal']:.1%})", met=labs_best["mfu"] >= 0.55),
        dict(target="under an 80 GB cap: labs >= 1.6x stock's best",
             measured=f"{cap_ratio:.2f}x ({cap_labs['case']} vs {cap_stock['case']}; capped H200, fit on a real 80 GB "
                      "card not verified)", met=cap_ratio >= 1.6),
        dict(target="planner's pick within 5% of the best measured (each side, both budgets)",
             measured=", ".join(f"{p['side']} {p['pick_over_best']:.2f}" for p in picks),
             met=all(p["pick_over_best"] >= 0.95 for p in picks)),
    ] + offload_targets() + [offload_verdict.target(), zenflow_report.round12_target(),
                             zenflow_report.round14_target(),
                             zenflow_report.round15_target(), zenflow_report.round17_target(),
                             zenflow_columns_report.round18_target(), zenflow_moments_report.round19_target(),
                             zenflow_long.target()]
