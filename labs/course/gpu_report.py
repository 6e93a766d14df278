"""Chapter 9's readings of the recorded GPU runs (results/gpu, labs.bench): sweeps, levers, the planner's picks and
the targets, each computed from the files, never typed in.

    gpu_report.sweep_table("f_sweep_2xh200")        # every case of a sweep, with what the planner predicted
    gpu_report.planner_check("f_sweep_2xh200")       # per side: the planner's pick against the best measured
    gpu_report.targets()                             # the issue's targets, met or not, with their numbers
"""
from __future__ import annotations

from labs.bench import results
from labs.table import Table

RUNS = dict(sweep="f_sweep_2xh200", levers="g_levers_2xh200", cap="h_cap80_2xh200", cap_more="i_cap80_more_2xh200",
            fp8="j_fp8_compile_2xh200", fp8_vs_stock="k_fp8_vs_stock_2xh200", fp8_cap="l_fp8_cap80_2xh200")


def _result(suffix: str) -> dict:
    matches = [r for name, r in results.load_all().items() if name.endswith(suffix)]
    if len(matches) != 1:
        raise KeyError(f"results/gpu/*{suffix}.json: {len(matches)} files")
    return matches[0]


def case_rows(suffix: str) -> list[dict]:
    """Every case of one recorded invocation, failed ones included (an OOM is a finding)."""
    result = _result(suffix)
    predicted = {p["case"]: p for p in result.get("sweep", {}).get("plan", [])}
    rows = []
    for name, case in result["cases"].items():
        side = name.split("-")[0]
        row = dict(case=name, side=side, status=case["status"], predicted=predicted.get(name, {}))
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


def best(suffix: str, side: str) -> dict:
    ok = [r for r in case_rows(suffix) if r["side"] == side and r["status"] == "ok"]
    return max(ok, key=lambda r: r["tokens_per_s_per_gpu"])


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


def lever_rows(suffix: str, base: str) -> list[dict]:
    """Each case of a lever run against the base case of the same invocation (one lever each)."""
    rows = {r["case"]: r for r in case_rows(suffix) if r["status"] == "ok"}
    return [dict(r, lever=name.removeprefix(base).strip("-") or "(base)",
                 vs_base=r["tokens_per_s_per_gpu"] / rows[base]["tokens_per_s_per_gpu"])
            for name, r in rows.items()]


def targets() -> list[dict]:
    """The GPU round's targets (2 x H200, Qwen2.5-7B shape, sequence 4096), each with the numbers that decide it."""
    sweep_ratio = best(RUNS["sweep"], "labs")["tokens_per_s_per_gpu"] / best(RUNS["sweep"], "stock")["tokens_per_s_per_gpu"]
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
             measured=f"{cap_ratio:.2f}x ({cap_labs['case']} vs {cap_stock['case']})", met=cap_ratio >= 1.6),
        dict(target="planner's pick within 5% of the best measured (each side, both budgets)",
             measured=", ".join(f"{p['side']} {p['pick_over_best']:.2f}" for p in picks),
             met=all(p["pick_over_best"] >= 0.95 for p in picks)),
    ]
