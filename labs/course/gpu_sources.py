"""What chapter 9 reads from results/ and what for: each `labs bench` file of results/gpu (where, when, on which GPUs,
with which versions and command) and each folder of recorded runs, named by the labs.course constants that read it,
with the first line of its README (which records how, where and when).

    gpu_sources.lines()      # the listing chapter 9 prints at its top
"""
from __future__ import annotations

from pathlib import Path

from labs import RESULTS
from labs.bench import results
from labs.course import autotune_report, gpu_report, offload_verdict, one_gpu_report, zenflow_long, zenflow_report
from labs.course.one_card_runs import H100, H200

R, ONE = gpu_report.RUNS, one_gpu_report
# What the chapter reads each bench file for, by the name labs.course reads it under (run a-e by name in the cells);
# every file also feeds the predicted-against-measured peaks, and the two-GPU bf16 7B ones the planner's fit
USES = {
    "a_zero3_2xh200": "run a: the levers one at a time at micro-batch 2; ZeRO-1/2/3 and FSDP2 side by side",
    "b_offload_1xh200": "run b: ZeRO-3 with optimizer offload, the CPU step's share (not like for like)",
    "c_zero3_levers_2xh200": "run c: the granular fetch that stopped training",
    "d_zero3_repeat_2xh200": "run d: repeats of run a's cases (the memory and planner fits only)",
    "e_zero3_final_2xh200": "run e: fp16 against bf16",
    R["sweep"]: "run f: best against best on 2 x H200", R["levers"]: "run g: one lever at a time on labs' best",
    R["cap"]: "run h: the same sweep under the plain 80 GB cap", R["cap_more"]: "run i: the cap's other candidates",
    R["fp8"]: "run j: fp8 with torch.compile", R["fp8_vs_stock"]: "run k: fp8 + compile against stock's best",
    R["fp8_cap"]: "run l: fp8 + compile under the 80 GB cap", R["offload"]: "run m: offload at the same batch (3B)",
    R["offload_stock"]: "run n: stock offload at its best", R["offload_overlap"]: "run o: ZenFlow and SuperOffload",
    R["ratio"]: "run p: half the optimizer offloaded", R["nvme"]: "run q: the optimizer state on the disk",
    **{suffix: f"run r: CPU Adam on {n} threads" for n, suffix in gpu_report.THREADS.items()},
    "r8e_zero3_ckfull_7b_1xh200": "round 8: predicted against measured peaks only",
    "r8h_blind_memory_3b_1xh200": "round 8: predicted against measured peaks only (a blind test of labs.memory)",
    "r8i_blind_memory_7b_1xh200": "round 8: predicted against measured peaks only (a blind test of labs.memory)",
    autotune_report.BENCH["neighbours"]: "run t: the autotuner's pick and its neighbours",
    autotune_report.BENCH["repeat"]: "run u: run t's first three cases again",
    autotune_report.BENCH["best"]: "run w: the three picks side by side",
    ONE.SWEEPS["x"]: "run x: best against best, one H200, 3B", ONE.REPEATS["x"]: "run x2: run x's best again",
    ONE.SWEEPS["y"]: "run y: the same under the plain 80 GB cap",
    ONE.CAP_AFTER_FIX: "run y2: run y after the memory fix",
    ONE.SWEEPS["z"]: "run z: best against best, one H200, 7B", ONE.REPEATS["z"]: "run z2: run z's best again",
    ONE.REAL_CARD["sweep"]: "run y3: run y's sweep on a real H100", ONE.REAL_CARD["repeat"]: "run y4: its repeat",
    ONE.CARD_CAP: "run y5: labs.card_cap's corrected cap on an H200",
    ONE.ON_CARD["capped"]: "run y6: that cap on a real H100", ONE.ON_CARD["uncapped"]: "run y6b: the same without it",
}
# The folders of recorded runs the chapter reads, by the constant or default that reads them, and what for
FOLDERS = (
    (autotune_report.LABS_RUN, "run s: the autotuner over labs' loop"),
    (autotune_report.STOCK_RUN, "run v: the autotuner as a stock user runs it"),
    (gpu_report.ROUND5, "runs p-r: the disk's speed and the NVMe swap folder's size"),
    (gpu_report.GRANULAR, "the granular fetch on one GPU, one lever at a time"),
    (gpu_report.MAKE_TRAIN, "`make train` on 2 x H200, and its one-lever runs on one H200"),
    (zenflow_report.FOLDER, "ZenFlow from random weights: run o's case alone, host sampled, and round 12"),
    (zenflow_report.FINETUNE, "ZenFlow fine-tuning (rounds 14-19, the targets table)"),
    (zenflow_long.ROUND27C.parent, "ZenFlow's fine-tune over 96 steps on a real H100 (round 27c, the targets table)"),
    (H200, "labs' own 2 x 4 of the 7B row (the loss check of the 7B offload target)"),
    (H100, f"the 7B on one real H100: rounds {offload_verdict.rounds_text()} (the 7B offload target and recipe)"),
    (RESULTS / "cpu" / "granular_2ranks", "the granular fetch on 2 CPU ranks"),
)


def _title(folder: Path) -> str:
    readme = folder / "README.md"
    return readme.read_text().splitlines()[0].lstrip("# ") if readme.exists() else "(no README)"


def lines() -> list[str]:
    """The bench files (date, GPUs used, what for, command), the versions they share, then the folders."""
    recorded = results.load_all()
    unknown = [stem for stem in recorded if not any(stem.endswith(suffix) for suffix in USES)]
    assert not unknown, f"results/gpu files chapter 9 does not say it reads: {unknown}"
    versions = {", ".join(f"{k} {r['host'][k]}" for k in ("driver", "torch", "deepspeed", "transformers",
                                                          "liger-kernel")) for r in recorded.values()}
    out = [f"{len(recorded)} `labs bench` files in results/gpu, each: date, the GPUs its cases ran on, what this "
           f"chapter reads it for, the command; versions: {' / '.join(sorted(versions))}"]
    for stem, r in recorded.items():
        use = next(text for suffix, text in USES.items() if stem.endswith(suffix))
        out += [f"{stem}: {r['date'][:16]}, {results.gpus_used(r)}; {use}",
                f"    `{r['command'].replace('__main__.py', 'labs')}`"]
    out.append(f"{len(FOLDERS)} folders of recorded runs (each README says how, where and when):")
    for folder, use in FOLDERS:
        out.append(f"{folder.relative_to(RESULTS.parent)}/: {use}; README: {_title(folder)}")
    return out
