"""Chapter 9's readings of round 7 (results/gpu, runs x-z): best against best on one H200, each side's fastest of the
planner's three candidates at the same 8 x 4,096 tokens per optimizer step, computed from the files.

    one_gpu_report.best_vs_best()        # per sweep: each side's best, the ratio, the repeat's ratio
    one_gpu_report.out_of_memory("y")    # a case that failed: what it asked for, against labs.memory then and now
    one_gpu_report.real_card()           # run y on a real H100 (y3, y4) against the capped H200
    one_gpu_report.cap_after_card_cap()  # run y5: labs.card_cap's cap on an H200 against the real H100
    one_gpu_report.cap_on_real_card()    # runs y6, y6b: the same cap on a real H100, with and without it
    one_gpu_report.eighty_gb()           # labs / stock on one 80 GB card: y5's corrected cap, the real H100 runs
"""
from __future__ import annotations

import re

from labs import memory
from labs.bench import results, sweep
from labs.course import gpu_report

SWEEPS = dict(x="x_sweep_3b_1xh200", y="y_sweep_cap80_3b_1xh200", z="z_sweep_7b_1xh200")
REPEATS = dict(x="x2_repeat_3b_1xh200", z="z2_repeat_7b_1xh200")     # each side's best again, a later invocation
# y's best of each side again and the ZeRO-2 case the corrected memory model put among stock's three: measured while
# DeepSpeed's ops compiled on the same host (the file's annotation), so its peaks count and its speeds do not
CAP_AFTER_FIX = "y2_repeat_cap80_3b_1xh200"
SETUPS = dict(x=("qwen2.5-3b", None), y=("qwen2.5-3b", "H100"), z=("qwen2.5-7b", None))   # preset, --gpu-memory
# Round 21: run y on a real H100 80GB (no cap: the card's own memory), then each side's best again, stock first
REAL_CARD = dict(sweep="y3_sweep_3b_1xh100", repeat="y4_repeat_3b_1xh100")
# Round 23: the three cases of y3 that decided the cap's question, on an H200 under labs.card_cap's H100 cap
CARD_CAP = "y5_cap_fixed_3b_1xh200"
# Round 24: y5's three cases on a real H100 under the same cap, then the two that fit without it, the same call
ON_CARD = dict(capped="y6_cap_on_card_3b_1xh100", uncapped="y6b_no_cap_on_card_3b_1xh100")


def best_vs_best() -> list[dict]:
    """One row per sweep: labs' and stock's fastest valid case, their ratio, labs' MFU (both conventions), and the
    same two cases' ratio in the repeat invocation where there is one."""
    rows = []
    for run, suffix in SWEEPS.items():
        labs, stock = gpu_report.best(suffix, "labs"), gpu_report.best(suffix, "stock")
        # like for like: both sides train the same tokens per optimizer step
        assert labs["tokens_per_step"] == stock["tokens_per_step"], (labs["case"], stock["case"])
        preset, cap = SETUPS[run]
        row = dict(run=run, preset=preset, budget=budget_label(cap), tokens_per_step=labs["tokens_per_step"],
                   labs=labs["case"], labs_tokens_per_s=labs["tokens_per_s_per_gpu"], stock=stock["case"],
                   stock_tokens_per_s=stock["tokens_per_s_per_gpu"],
                   ratio=labs["tokens_per_s_per_gpu"] / stock["tokens_per_s_per_gpu"], mfu=labs["mfu"],
                   mfu_causal=labs["mfu_causal"], repeat_ratio=None)
        if run in REPEATS:
            again = {r["case"]: r["tokens_per_s_per_gpu"] for r in gpu_report.case_rows(REPEATS[run])
                     if r["status"] == "ok"}
            row["repeat_ratio"] = again[labs["case"]] / again[stock["case"]]
        rows.append(row)
    return rows


def budget_label(cap: str | None) -> str:
    return f"{cap} cap ({memory.parse_bytes(cap) / 2**20:,.0f} MiB)" if cap else "whole card"


def repeat_spread(run: str) -> dict[str, float]:
    """Each case measured in both the sweep and its repeat: repeat / sweep tokens per second."""
    first = {r["case"]: r["tokens_per_s_per_gpu"] for r in gpu_report.case_rows(SWEEPS[run]) if r["status"] == "ok"}
    return {r["case"]: r["tokens_per_s_per_gpu"] / first[r["case"]] for r in gpu_report.case_rows(REPEATS[run])
            if r["status"] == "ok" and r["case"] in first}


# The figures of PyTorch's out-of-memory message, by what each says; "cap" appears only under a memory fraction.
# PyTorch writes each size with c10's format_size: "N bytes" up to 1 KiB, else two decimals in KiB, MiB or GiB
_SIZE = r"([\d.]+) (\w+)"
UNITS = dict(bytes=1, KiB=2**10, MiB=2**20, GiB=2**30)
OOM_FIGURES = dict(capacity=rf"total capacity of {_SIZE}", in_use=rf"process has {_SIZE} memory in use",
                   allocated=rf"{_SIZE} is allocated by PyTorch", requested=rf"Tried to allocate {_SIZE}",
                   reserved_unused=rf"{_SIZE} is reserved by PyTorch but unallocated", cap=rf"{_SIZE} allowed")


def _gib(number: str, unit: str) -> float:
    if unit not in UNITS:       # a unit format_size does not write: fail rather than drop the figure
        raise ValueError(f"out-of-memory message: unknown unit {unit!r} in {number} {unit}")
    return float(number) * UNITS[unit] / memory.GiB


def oom_figures(error: str) -> dict[str, float]:
    """Each figure of OOM_FIGURES that an out-of-memory message states, in GiB, and where it states the process's
    memory in use, PyTorch's allocated and its reserved-but-unused, what the process held outside PyTorch (the CUDA
    context)."""
    said = {key: _gib(*found.groups()) for key, pattern in OOM_FIGURES.items() if (found := re.search(pattern, error))}
    if {"in_use", "allocated", "reserved_unused"} <= said.keys():
        said["outside_pytorch"] = said["in_use"] - said["allocated"] - said["reserved_unused"]
    return said


def out_of_memory(run: str) -> list[dict]:
    """Every case of a sweep that ran out of GPU memory: what PyTorch held and asked for when it failed, the budget
    labs.memory counts as usable, the peak the planner predicted when it chose the case (stored with the run), and the
    peak today's labs.memory predicts."""
    preset = SETUPS[run][0]
    result = gpu_report.result_file(SWEEPS[run])
    planned = {p["case"]: p for p in result["sweep"]["plan"]}
    budget = memory.parse_bytes(result["sweep"]["gpu_memory"])        # the cap the sweep ran under, as it recorded
    found = []
    for name, case in result["cases"].items():
        if case["status"] == "ok" or "OutOfMemory" not in case.get("error", ""):
            continue
        said = oom_figures(case["error"])
        found.append(dict(case=name, allocated_gib=said["allocated"], requested_gib=said["requested"],
                          needed_gib=said["allocated"] + said["requested"], reserved_unused_gib=said["reserved_unused"],
                          cap_gib=said["cap"],
                          usable_gib=memory.usable_bytes(budget) / memory.GiB,
                          planned_gib=planned[name]["predicted_peak_gib"],
                          predicted_now_gib=sweep.predicted_peak_bytes(name, preset, 1) / memory.GiB))
    return found


def accumulation_gap(case: str) -> list[dict]:
    """Each recorded run of a ZeRO-1/2 case with accumulation: its measured peak, labs.memory's, and labs.memory's
    without the gradients kept between micro-batches (the model before it counted them)."""
    found = []
    for row in results.rows(results.load_all()):
        if row["case"] != case or row["grad_accum"] == 1:
            continue
        phases = results.estimate_for(row).phases
        without = max(p["total"] - (p["grads"] if name == "loss_backward" else 0) for name, p in phases.items())
        found.append(dict(case=case, run=results.run_label(row["run"]), gpus=row["gpus"], measured_gib=row["peak_gib"],
                          predicted_gib=max(p["total"] for p in phases.values()) / memory.GiB,
                          without_buffer_gib=without / memory.GiB))
    return found


def cap_after_fix() -> list[dict]:
    """Run y2's cases: measured peak against today's labs.memory, and tokens/s against run y's where y ran the case."""
    before = {r["case"]: r["tokens_per_s_per_gpu"] for r in gpu_report.case_rows(SWEEPS["y"]) if r["status"] == "ok"}
    return [dict(case=r["case"], peak_gib=r["peak_gib"],
                 predicted_gib=sweep.predicted_peak_bytes(r["case"], "qwen2.5-3b", 1) / memory.GiB,
                 tokens_per_s=r["tokens_per_s_per_gpu"],
                 over_run_y=r["tokens_per_s_per_gpu"] / before[r["case"]] if r["case"] in before else None)
            for r in gpu_report.case_rows(CAP_AFTER_FIX) if r["status"] == "ok"]


def cap_bound() -> dict:
    """Run y2's stock ZeRO-2 (not among run y's candidates) against run y: even slowed by the compile it ran faster
    than run y's stock best under the plain cap (two invocations). It does not fit a real 80 GB card (runs y3, y4, y6
    on real H100s ran out of memory, as did run y5 on an H200 under labs.card_cap's H100 cap), so it bounds nothing
    there: eighty_gb() has the figures for one 80 GB card."""
    y2 = {r["case"]: r for r in cap_after_fix()}["stock-zero2-cknone-mb1-ga8"]
    labs, stock = gpu_report.best(SWEEPS["y"], "labs"), gpu_report.best(SWEEPS["y"], "stock")
    return dict(stock_zero2=y2["tokens_per_s"], stock_best_y=stock["tokens_per_s_per_gpu"],
                labs_best_y=labs["tokens_per_s_per_gpu"], at_most=labs["tokens_per_s_per_gpu"] / y2["tokens_per_s"],
                planner_pick_over_it=stock["tokens_per_s_per_gpu"] / y2["tokens_per_s"])


def real_card() -> dict:
    """Run y on a real H100 (y3, and its repeat y4) against run y on the H200 capped at an H100's memory: per case the
    tokens/s on each (the H100's over the capped H200's) and the peak; each side's best on the H100 and the ratio in
    both invocations; and each case that ran out of memory on the card, with what PyTorch held and asked for."""
    capped = gpu_report.by_case(SWEEPS["y"], ok_only=True)
    again = gpu_report.by_case(REAL_CARD["repeat"], ok_only=True)
    cases, failed = [], []
    for r in gpu_report.case_rows(REAL_CARD["sweep"]):
        if r["status"] != "ok":
            said = oom_figures(gpu_report.result_file(REAL_CARD["sweep"])["cases"][r["case"]]["error"])
            failed.append(dict(case=r["case"], **said))
            continue
        y = capped.get(r["case"])
        speed = r["tokens_per_s_per_gpu"]
        cases.append(dict(case=r["case"], h100=speed, repeat=again.get(r["case"], {}).get("tokens_per_s_per_gpu"),
                          capped_h200=y and y["tokens_per_s_per_gpu"], peak_gib=r["peak_gib"],
                          capped_peak_gib=y and y["peak_gib"], over_capped=y and speed / y["tokens_per_s_per_gpu"]))
    labs, stock = (gpu_report.best(REAL_CARD["sweep"], side) for side in ("labs", "stock"))
    return dict(cases=cases, failed=failed, labs=labs["case"], stock=stock["case"],
                ratio=labs["tokens_per_s_per_gpu"] / stock["tokens_per_s_per_gpu"],
                repeat_ratio=again[labs["case"]]["tokens_per_s_per_gpu"] / again[stock["case"]]["tokens_per_s_per_gpu"],
                planner=gpu_report.planner_check(REAL_CARD["sweep"]))


def cap_after_card_cap() -> list[dict]:
    """Run y5 (an H200 under labs.card_cap's H100 cap) case by case against the real H100 (y3) and the plain cap (y2
    where it ran the case, else y): whether it fit each way, tokens/s under the new cap over the real card's, and,
    for a case that ran out of memory under the new cap, what PyTorch held and asked for."""
    new, card = gpu_report.by_case(CARD_CAP), gpu_report.by_case(REAL_CARD["sweep"])
    plain = {**gpu_report.by_case(SWEEPS["y"]), **gpu_report.by_case(CAP_AFTER_FIX)}
    found = []
    for case, r in new.items():
        ok = r["status"] == "ok"
        said = {} if ok else oom_figures(gpu_report.result_file(CARD_CAP)["cases"][case]["error"])
        found.append(dict(case=case, card_cap=r["status"], real_card=card[case]["status"],
                          plain_cap=plain[case]["status"], tokens_per_s=r["tokens_per_s_per_gpu"] if ok else None,
                          over_real_card=r["tokens_per_s_per_gpu"] / card[case]["tokens_per_s_per_gpu"] if ok else None,
                          peak_gib=r["peak_gib"] if ok else None, **said))
    return found


def cap_on_real_card() -> list[dict]:
    """Runs y6 and y6b on a real H100, where labs.card_cap's cap is what the card leaves the process and so should
    not bind: per case whether it fit under the cap, with no cap (y6b, the next minutes; else run y3, the earlier
    sweep on another H100 host), tokens/s and peaks both ways, and for a case that ran out of memory, the limit the
    cap set against the card's capacity as torch sees it and what the rank held outside PyTorch."""
    capped, after = gpu_report.by_case(ON_CARD["capped"]), gpu_report.by_case(ON_CARD["uncapped"])
    uncapped = {**gpu_report.by_case(REAL_CARD["sweep"]), **after}
    found = []
    for case, r in capped.items():
        other, ok = uncapped[case], r["status"] == "ok"
        said = {} if ok else oom_figures(gpu_report.result_file(ON_CARD["capped"])["cases"][case]["error"])
        found.append(dict(case=case, capped=r["status"], uncapped=other["status"],
                          uncapped_run="y6b" if case in after else "y3",
                          tokens_per_s=r["tokens_per_s_per_gpu"] if ok else None,
                          over_uncapped=r["tokens_per_s_per_gpu"] / other["tokens_per_s_per_gpu"] if ok else None,
                          uncapped_tokens_per_s=other["tokens_per_s_per_gpu"] if ok else None,
                          peak_gib=r["peak_gib"] if ok else None, uncapped_peak_gib=other["peak_gib"] if ok else None,
                          **said))
    return found


def eighty_gb() -> dict:
    """labs' best over stock's best for the 3B on one 80 GB card, as a user should read it: on an H200 under
    labs.card_cap's corrected cap (run y5, one invocation), and on real H100s in four invocations (runs y3 and y4
    without a cap, y6 under card_cap and y6b without, the same two cases); the plain cap of run y let through a stock
    case that a real card does not fit."""
    y5 = {r["case"]: r for r in cap_after_card_cap() if r["card_cap"] == "ok"}
    y6 = {r["case"]: r for r in cap_on_real_card() if r["capped"] == "ok"}
    card = real_card()
    labs, stock = card["labs"], card["stock"]
    assert {labs, stock} <= y5.keys() and {labs, stock} <= y6.keys(), "the same two cases in every run"
    real = dict(y3=card["ratio"], y4=card["repeat_ratio"],
                y6=y6[labs]["tokens_per_s"] / y6[stock]["tokens_per_s"],
                y6b=y6[labs]["uncapped_tokens_per_s"] / y6[stock]["uncapped_tokens_per_s"])
    return dict(labs=labs, stock=stock, corrected_cap=y5[labs]["tokens_per_s"] / y5[stock]["tokens_per_s"],
                real_card=real, real_low=min(real.values()), real_high=max(real.values()))
