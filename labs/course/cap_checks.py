"""Chapter 9's checks of what the recorded runs say about fitting an 80 GB card, computed from results/gpu: which cases
of the runs under the plain `--gpu-memory` cap reserved more than a real H100 leaves PyTorch, and every case that ran
out of GPU memory against labs.memory's prediction today.

    cap_checks.card_limit_gib()    # what a real H100 left PyTorch (run y3's out-of-memory message)
    cap_checks.over_card()         # plain-cap cases that reserved more than that, and whether a real card ran them
    cap_checks.failures()          # every out-of-memory case, its figures against labs.memory now
    cap_checks.failure_counts()    # those counted: failures (a run's case) and configurations, and which still fit

A case is one run's configuration; the same configuration (case, preset, GPUs) can appear in several runs, so each
count says which it counts.
"""
from __future__ import annotations

from labs import memory
from labs.bench import results, sweep
from labs.course import gpu_report, one_gpu_report

# The runs recorded under the plain cap (torch.cuda.set_per_process_memory_fraction at an H100's 81,559 MiB, the CUDA
# context outside it), before labs.card_cap: runs h, i, l, y and y2
PLAIN_CAP = (gpu_report.RUNS["cap"], gpu_report.RUNS["cap_more"], gpu_report.RUNS["fp8_cap"],
             one_gpu_report.SWEEPS["y"], one_gpu_report.CAP_AFTER_FIX)
# The runs on a real H100 80GB: y3 and y4 without a cap, y6 under labs.card_cap, y6b without
REAL_CARD = (*one_gpu_report.REAL_CARD.values(), *one_gpu_report.ON_CARD.values())
PLAIN_CAP_RUNS = {suffix.split("_")[0] for suffix in PLAIN_CAP}


def configuration(row: dict) -> tuple[str, str, int]:
    """What a row of over_card() or failures() ran, whichever run it was: (case, preset, GPUs)."""
    return row["case"], row["preset"], row["gpus"]


def configurations(rows: list[dict]) -> int:
    return len({configuration(r) for r in rows})


def card_limit_gib() -> float:
    """GiB a real H100 80GB left PyTorch in run y3: the card's total as torch sees it, less what the process held
    outside PyTorch (its out-of-memory message states both)."""
    failed = one_gpu_report.real_card()["failed"][0]
    return failed["capacity"] - failed["outside_pytorch"]


def _world(result: dict) -> int:
    return max(case["summary"]["world_size"] for case in result["cases"].values() if case["status"] == "ok")


def _on_real_card() -> dict[tuple, set[str]]:
    """{(preset, GPUs, case): the statuses it had on a real H100 in any run}."""
    found: dict[tuple, set[str]] = {}
    for suffix in REAL_CARD:
        result = gpu_report.result_file(suffix)
        for name, case in result["cases"].items():
            found.setdefault((result["preset"], _world(result), name), set()).add(case["status"])
    return found


def over_card(limit_gib: float | None = None) -> list[dict]:
    """Each case of the plain-cap runs that ran and reserved more than a real H100 leaves PyTorch (card_limit_gib):
    its run, preset, GPUs, reserved and allocated peaks, and what a real card did with it ("ok", "failed", or
    "not run")."""
    limit = card_limit_gib() if limit_gib is None else limit_gib
    real, found = _on_real_card(), []
    for suffix in PLAIN_CAP:
        result = gpu_report.result_file(suffix)
        for name, case in result["cases"].items():
            if case["status"] != "ok":
                continue
            reserved = max(case["summary"]["peak_reserved_bytes"]) / memory.GiB
            if reserved <= limit:
                continue
            outcome = real.get((result["preset"], _world(result), name))
            found.append(dict(run=suffix.split("_")[0], case=name,
                              preset=result["preset"], gpus=_world(result), reserved_gib=reserved,
                              allocated_gib=max(case["summary"]["peak_memory_bytes"]) / memory.GiB,
                              real_card=("ok" if outcome == {"ok"} else "failed" if outcome == {"failed"}
                                         else "not run" if outcome is None else "/".join(sorted(outcome)))))
    return found


def failures() -> list[dict]:
    """Every case of results/gpu/*.json that ran out of GPU memory: what PyTorch held, asked for and kept reserved but
    unused (its message), the memory labs.memory counts as usable where it ran (the cap the run recorded, else the
    card as torch saw it), labs.memory's peak for the case today, and whether it says the case fits; `held_over` is
    true where what PyTorch held and asked for exceeds that prediction (the model misses memory), false where the
    prediction covers it and the allocator's reserved-but-unused memory made the difference."""
    found = []
    for stem, result in results.load_all().items():
        for name, case in result["cases"].items():
            if case["status"] == "ok" or "OutOfMemory" not in case.get("error", ""):
                continue
            said = one_gpu_report.oom_figures(case["error"])
            budget = (memory.parse_bytes(result["gpu_memory"]) if result.get("gpu_memory")
                      else said["capacity"] * memory.GiB)
            gpus = int(case["options"].get("nproc") or _world(result))
            estimate = sweep.predicted_estimate(name, result["preset"], gpus)
            predicted = estimate.total_per_gpu_bytes / memory.GiB
            usable = memory.usable_bytes(budget) / memory.GiB
            needed = said["allocated"] + said["requested"]
            found.append(dict(run=results.run_label(stem), case=name, preset=result["preset"], gpus=gpus,
                              cap=result.get("gpu_memory"), device=result["host"]["gpus"][0],
                              allocated_gib=said["allocated"], requested_gib=said["requested"], needed_gib=needed,
                              reserved_unused_gib=said["reserved_unused"], usable_gib=usable,
                              predicted_gib=predicted, fits_now=estimate.fits(budget), held_over=needed > predicted))
    return found


def where(failure: dict) -> str:
    """The card a case of failures() ran on and the cap it ran under: none, the plain cap (runs h, i, l, y, y2) or
    labs.card_cap's (the runs after them)."""
    device = failure["device"]
    place = "a real H100" if "H100" in device else "an H200" if "H200" in device else device
    if not failure["cap"]:
        return place
    cap = "the plain" if failure["run"] in PLAIN_CAP_RUNS else "labs.card_cap's"
    return f"{place} under {cap} {failure['cap']} cap"


def places(found: list[dict]) -> str:
    """Where the failures of one configuration ran, each place with its runs: "a real H100 (runs y3, y4), ..."."""
    runs: dict[str, list[str]] = {}
    for f in found:
        runs.setdefault(where(f), []).append(f["run"])
    parts = [f"{place} (run{'s' if len(r) > 1 else ''} {', '.join(r)})" for place, r in runs.items()]
    return parts[0] if len(parts) == 1 else f"{', '.join(parts[:-1])} and {parts[-1]}"


def failure_counts(found: list[dict] | None = None) -> dict:
    """failures() counted: how many failures (one run's case each) and configurations ran out of memory, how many of
    each labs.memory today puts over the memory usable where they ran, and the configurations it predicts to fit,
    each with its failures ({configuration: [failure, ...]}, in the order of the runs)."""
    found = failures() if found is None else found
    fit = [f for f in found if f["fits_now"]]
    over = [f for f in found if not f["fits_now"]]
    fitting: dict[tuple, list[dict]] = {}
    for f in fit:
        fitting.setdefault(configuration(f), []).append(f)
    return dict(failures=len(found), configurations=configurations(found), over_failures=len(over),
                over_configurations=configurations(over), fit_failures=len(fit), fit_configurations=fitting,
                runs=list(dict.fromkeys(f["run"] for f in found)))
