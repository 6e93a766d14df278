"""Chapter 10's readings of the recorded ZenFlow runs on one H200 (results/gpu/zenflow_1xh200, the Qwen2.5-3B shape,
8 sequences of 4,096 tokens per optimizer step, 20 steps at a constant lr of 1e-5, same data and seed): losses and
speed per run, what the host's OOM killer reported before labs.zenflow_host, and the host memory sampled since.

    zenflow_report.zenflow_runs()                      # round 4: plain offload, ZenFlow before and after the layout fix
    zenflow_report.zenflow_runs(zenflow_report.ROUND10)  # round 10: one host, the overlap fixed, its three yardsticks
    zenflow_report.host_memory("zf_overlap20")         # least available host memory, each process then
    zenflow_report.step_timers("zf_fast20")            # round 12: DeepSpeed's timers per step, from the job's log
    zenflow_report.finetune_runs()                     # round 14: fine-tuning weights labs trained, at intervals 2, 4, 8
    zenflow_report.finetune_runs(ROUND15, ROUND15_RUNS)  # round 15: the same fine-tunes over 64 steps, on another host
    zenflow_report.refresh_memory("ft_zf_sel4_64")     # round 17: the host when ZenFlow chooses its columns again
"""
from __future__ import annotations

import copy
import json
import re

from labs import RESULTS, memory
from labs.course import host_samples
from labs.metrics import read_jsonl
from labs.runfolder import Run

FOLDER = RESULTS / "gpu" / "zenflow_1xh200"
ROUND4 = ("off20", "zf_sync20", "zf_fix20")
# Round 10 (2026-12-03, one host, tools/gpu_round10.jobs): ZenFlow with its overlapped CPU step and labs.zenflow_host,
# ZenFlow without the overlap, plain offload, and labs without offload at 4 x 2 sequences (the same tokens per step).
ROUND10 = ("zf_overlap20", "zf_sync20b", "off20b", "ref20")
# Round 12 (2026-12-03, one host, tools/gpu_round12.jobs): the overlapped run again with labs' copy-back
# (labs.offload_copy.copy_in_chunks), labs without offload, and stock's best offload setup of run n (stock HF model and
# loss, ZeRO-2 offload, 4 x 2, no checkpointing); then update_interval 8 (24 steps: whole 8-step cycles) and, 60 steps
# each, ZenFlow and no offload, to follow the loss further.
ROUND12 = ("zf_fast20", "ref20r", "stock_off20")
ROUND12_LONG = ("zf_fast60", "ref60")
ROUND12_UI8 = "zf_fast_ui8"
# The target's loss tolerance: the loss at the same step within this many nats per token of labs without offload,
# which runs the same update rule as stock's offload (their losses agree to 5e-4) with none of ZenFlow's shortcuts.
LOSS_TOLERANCE = 0.05
# Round 14 (2026-12-03, eighth session, one host, tools/gpu_round14*.jobs): ZenFlow fine-tuning. `pre` trained the 3B
# shape for 120 steps on CPython's standard library (zero2.json's warm-up and cosine, peak lr 1e-4) and was exported to
# a Hugging Face folder; from it, on transformers' sources with round 12's settings (constant lr 1e-5, 32,768 tokens per
# step): labs without offload (24 steps) and ZenFlow overlapped at update_interval 2 and 4 (20 steps) and 8 (24 steps).
FINETUNE = RESULTS / "gpu" / "zenflow_finetune_1xh200"
ROUND14 = ("ft_ref", "ft_zf_ui2", "ft_zf", "ft_zf_ui8")
# Round 15 (2026-12-03, ninth session, another host, tools/gpu_round15*.jobs): round 14 again from `pre` on, each
# fine-tune for 64 steps, so that every interval lands full updates (interval 8: five by step 64) and the loss is
# compared late.
ROUND15 = FINETUNE / "round15"
ROUND15_RUNS = ("ft_ref64", "ft_zf_ui2_64", "ft_zf64", "ft_zf_ui8_64")
# Round 16 (2026-12-03, tenth session, tools/gpu_round16*.jobs): round 15's ZenFlow fine-tunes choosing the top-k
# columns again at every full update (select_strategy "step"); all failed, so only their job logs are kept.
ROUND16 = FINETUNE / "round16"


def zenflow_runs(names=ROUND4, folder=FOLDER, cycle=4) -> dict[str, dict]:
    """Per run: losses, seconds since the end of step 1 (a warm-up: allocator, first kernels, ZenFlow's optimizer
    process) at the end of each step, tokens/s, and how far the loss fell from step 1 to the mean of the last 5 steps.
    ZenFlow's steps alternate (the CPU update every `cycle`-th step is slow), so speed is the mean over whole cycles
    after the first (steps 5 to the last: 5-20 in round 4), not a median; the same steps for every run, so runs compare like for like."""
    runs = {}
    for name in names:
        metrics = read_jsonl(folder / name / "metrics.jsonl")
        losses, seconds = [m["loss"] for m in metrics], [m["step_time_s"] for m in metrics]
        timed = seconds[cycle:]
        assert len(timed) % cycle == 0, f"{name}: {len(timed)} steps after the first cycle is not whole cycles"
        summary = json.loads((folder / name / "summary.json").read_text())
        runs[name] = dict(losses=losses, elapsed_s=[sum(seconds[1:k + 1]) for k in range(len(seconds))],
                          step_s=seconds, tokens_per_s_per_gpu=len(timed) * summary["tokens_per_step"] / sum(timed),
                          fall=losses[0] - sum(losses[-5:]) / 5, tokens_per_step=summary["tokens_per_step"],
                          params=summary["params"], micro_batch=summary["micro_batch"],
                          grad_accum=summary["gradient_accumulation"],
                          peak_gpu_gib=max(summary["peak_memory_bytes"]) / 2**30)      # one entry per rank
    return runs


def peak_records(names=("zf_alloc", "off_alloc"), folder=FOLDER) -> dict[str, dict]:
    """Round 15's allocator records (the peak_allocations instrument, 3 steps of round 12's ZenFlow and plain offload
    cases): per run the measured peak (torch.cuda.max_memory_allocated), labs.memory's prediction for the code that ran
    (DeepSpeed's bf16 columns: labs.zenflow_columns came later), and the groups of blocks alive at the peak, largest
    first (bytes, blocks, the innermost frame's file:line and function)."""
    records = {}
    for name in names:
        record = json.loads((folder / name / "peak_allocations_rank0.json").read_text())
        groups = [dict(bytes=g["bytes"], blocks=g["blocks"], where=g["label"].split(" < ")[0].split("/site/")[-1])
                  for g in record["groups"]]
        records[name] = dict(measured=record["max_memory_allocated_bytes"], groups=groups,
                             predicted=memory.from_run(folder / name, zenflow_columns="deepspeed").total_per_gpu_bytes)
    return records


def update_interval(name: str, folder=FINETUNE) -> int | None:
    """A run's ZenFlow update_interval, from its resolved config (None: no ZenFlow)."""
    zenflow = json.loads((folder / name / "ds_config.json").read_text())["zero_optimization"].get("zenflow")
    return zenflow["update_interval"] if zenflow else None


def choosing(name: str, folder=FINETUNE) -> str:
    """", choosing every N steps" for a ZenFlow run that chooses its top-k columns again (select_strategy "step"),
    else "" (DeepSpeed's "auto": once, at step 1, under labs)."""
    zenflow = json.loads((folder / name / "ds_config.json").read_text())["zero_optimization"]["zenflow"]
    return f", choosing every {zenflow['select_interval']} steps" if zenflow["select_strategy"] == "step" else ""


def finetune_runs(folder=FINETUNE, names=ROUND14) -> dict[str, dict]:
    """zenflow_runs for a round's fine-tuning runs (the first is labs without offload) and the run that trained their
    weights (`pre`), each over whole cycles of its own update_interval (no offload and `pre` over steps 5 on, as
    interval 4)."""
    runs = {}
    for name in names + ("pre",):
        runs.update(zenflow_runs((name,), folder, update_interval(name, folder) or 4))
    return runs


def landed_updates(name: str, folder=FINETUNE) -> list[int]:
    """The steps at whose end a full CPU update was copied into the GPU's weights (optimizer_transmit_time), so that
    the next step's loss is the first to feel it. DeepSpeed's first update boundary only starts the optimizer process,
    so each update lands one interval after the boundary that submitted it."""
    return [k for k, t in enumerate(step_timers(name, folder), start=1) if "optimizer_transmit_time" in t]


WINDOW = range(13, 21)          # round 14's common window: steps 13-20, run by every fine-tuning run on the same batches
WINDOW15 = range(49, 65)        # round 15's: the last 16 steps, whole cycles at every interval, after four of interval 8's
                                # full updates have landed (at steps 24, 32, 40, 48)


def window_mean(losses: list[float], window=WINDOW) -> float:
    return sum(losses[k - 1] for k in window) / len(window)


def kept_between_updates_bytes(name: str, folder=FOLDER) -> int:
    """labs.memory's host bytes for the gradients a ZenFlow run keeps on the host between updates: its estimate less
    the same run's at update_interval 1, which keeps none."""
    run = Run(folder / name)
    every_step = copy.deepcopy(run.ds_config)
    every_step["zero_optimization"]["zenflow"]["update_interval"] = 1
    return memory.from_run(run).host_per_node_bytes - memory.from_run(run, ds_config=every_step).host_per_node_bytes


def zenflow_oom(folder=FOLDER / "zf_mem") -> dict:
    """ZenFlow with overlap_step on a 126 GiB host, before labs.zenflow_host: what the kernel's OOM killer reported
    for each process it ended (resident anonymous and shared memory, GiB) and the least free memory vmstat saw (GiB)."""
    killed = [dict(anon_gib=int(re.search(r"anon-rss:(\d+)kB", line)[1]) / 2**20,
                   shmem_gib=int(re.search(r"shmem-rss:(\d+)kB", line)[1]) / 2**20)
              for line in (folder / "log.txt").read_text().splitlines() if "Out of memory: Killed process" in line]
    free_mib = [int(line.split()[3]) for line in (folder / "vmstat.txt").read_text().splitlines()
                if line.split() and line.split()[0].isdigit()]          # vmstat -S M: column 4 is free MiB
    return dict(killed=killed, least_free_gib=min(free_mib) / 1024)


def host_memory(name: str, folder=FOLDER) -> dict:
    """labs.course.host_samples.read for one run of this folder (the host's `free -g` of its round: round12_free.txt
    for round 12's runs, else round10_free.txt), with the lines labs.zenflow_host printed in the job's output."""
    free = "round12_free.txt" if name in ROUND12 + ROUND12_LONG + (ROUND12_UI8,) else "round10_free.txt"
    found = host_samples.read(folder / name, free_txt=folder / free)
    lines = (folder / name / "job.log").read_text().splitlines()
    return dict(found, labs_lines=[line for line in lines if line.startswith("labs: ZenFlow")])


def selection_ms(name: str, folder=FINETUNE, timer="selective_optimizer_update") -> list[float]:
    """DeepSpeed's `selective_optimizer_update` timer (ms) at each step of a ZenFlow run, read from its launch log (or
    a job log holding the ranks' output): the time ZenFlow spent choosing the top-k columns the GPU updates (a few
    hundredths of a ms when it chose none). `timer="selective_optimizer_sync"`: the refresh of the master weights."""
    log = folder / name
    log = log / "launch.log" if log.is_dir() else log
    return [float(ms) for ms in re.findall(rf"{timer}: ([\d.]+)", log.read_text())]


def failed_run(job_log: str, folder=ROUND16) -> dict:
    """A ZenFlow run that failed, read from its job log (the ranks' whole output, launched without --quiet): the steps
    it completed (DeepSpeed's per-step timers), the steps at which it chose the top-k columns (over 1 ms), the losses
    labs printed, and whether the training process found ZenFlow's optimizer process gone."""
    text = (folder / job_log).read_text()
    picked = selection_ms(job_log, folder)
    return dict(steps=text.count("step_microstep"), chosen_at=[k for k, ms in enumerate(picked, start=1) if ms > 1],
                losses={int(k): float(x) for k, x in re.findall(r"step +(\d+)/\d+ +loss ([\d.]+)", text)},
                optimizer_process_lost="ZenFlow optimizer process exited during a step" in text)


def host_low(samples: str = "diag_sel4_host.txt", folder=ROUND16) -> dict:
    """Round 16's diagnostic samples, every 5 s (the time, `free -m`'s Mem line, the GPU's memory in use): the least
    host memory available (GiB) and when, how much more was available at the next sample, and what was available at
    the last sample before the GPU was let go (its memory in use below 1 GiB)."""
    lines = (folder / samples).read_text().splitlines()
    samples = [(lines[k], int(lines[k + 1].split()[-1]) / 1024, int(lines[k + 2].split()[0]))
               for k in range(0, len(lines) - 2, 3)]
    low = min(range(len(samples)), key=lambda k: samples[k][1])
    last_busy = max(k for k, (_, _, gpu_mib) in enumerate(samples) if gpu_mib >= 1024)
    return dict(least_available_gib=samples[low][1], at=samples[low][0],
                freed_by_next_sample_gib=samples[low + 1][1] - samples[low][1],
                available_at_last_busy_sample_gib=samples[last_busy][1])


ROUND17 = FINETUNE / "round17"
ROUND17_RUNS = ("ft_ref64", "ft_zf64", "ft_zf_sel4_64", "ft_zf_ui8_sel8_64")
RANK, ZF = "training rank", "ZenFlow's optimizer process"


def refresh_memory(name: str, folder=ROUND17) -> dict:
    """A round 17 run's host, sampled every second (host_samples): the least available memory (GiB), the training
    rank's private memory at that second, at its peak and at its start (while ZenFlow's process runs), the optimizer
    process's at that second, and the available memory at the first second the optimizer process was no longer seen
    while the rank was (None: it outlived the training)."""
    found = host_samples.read(folder / name, free_txt=folder / "host_memory.txt")
    timeline = found["timeline"]
    alive = [k for k, t in enumerate(timeline) if f"{ZF} RssAnon" in t]
    gone = next((t for t in timeline[alive[-1] + 1:] if f"{RANK} RssAnon" in t), None)
    # the rank's peak while the optimizer process ran, and the second after it was last seen (loading the model
    # before it starts takes more)
    while_alive = [t.get(f"{RANK} RssAnon", 0.0) for t in timeline[alive[0]:alive[-1] + 2]]
    return dict(least_available_gib=found["least_available_gib"],
                rank_private_gib=found["at_tightest"][(RANK, "RssAnon")],
                rank_private_peak_gib=max(while_alive),
                rank_private_at_start_gib=timeline[alive[0]][f"{RANK} RssAnon"],
                optimizer_private_gib=found["at_tightest"].get((ZF, "RssAnon"), 0.0),
                available_once_gone_gib=gone["available_gib"] if gone else None)


def round17_target() -> dict:
    """round14_target over round 17's fine-tunes on one host: no offload, ZenFlow choosing its columns once, and
    choosing them again at every full update at intervals 4 and 8, the loss judged over steps 49-64."""
    return round14_target(ROUND17, ROUND17_RUNS, WINDOW15, "round 17, 64 steps")


def step_timers(name: str, folder=FOLDER) -> list[dict[str, float]]:
    """DeepSpeed's wall-clock timers (ms) of each optimizer step, read from the job's log (`wall_clock_breakdown`, one
    micro-batch per step): the *_microstep timers and, on the steps that end an update round, the optimizer_* ones
    (optimizer_receive_params_time: the wait for the optimizer process; optimizer_transmit_time: the copy of its
    result into the GPU's weights), which DeepSpeed prints before that step's microstep line. Runs launched with
    --quiet (round 14) keep the ranks' output in the run folder's launch.log instead."""
    log = folder / name / "job.log"
    log = log if log.exists() else folder / name / "launch.log"
    steps, current = [], {}
    for line in log.read_text().splitlines():
        if "time (ms) |" not in line:
            continue
        for key, value in re.findall(r"(\w+): ([\d.]+)", line.split("time (ms) |", 1)[1]):
            if key.endswith("_microstep") or key.startswith("optimizer_"):
                current[key] = float(value)
        if "step_microstep" in line:
            steps.append(current)
            current = {}
    return steps


def update_steps(name: str, folder=FOLDER, cycle=4) -> list[dict[str, float]]:
    """step_timers of the steps that copy an update back to the GPU, after the first cycle (DeepSpeed skips the copy
    at the first round after warm-up, so at interval 4 over 20 steps: steps 12, 16 and 20)."""
    return [t for t in step_timers(name, folder)[cycle:] if "optimizer_transmit_time" in t]


def round12_target() -> dict:
    """Issue 12's offload target met by ZenFlow's speed, judged with its loss (round 12, one host, 3B, 32,768 tokens per
    step): hidden = ZenFlow / labs without offload, and ZenFlow / stock's best offload setup, at update_interval 4
    and 8; the loss at the last step of each ZenFlow run against no offload's (ref60) at that step, within
    LOSS_TOLERANCE."""
    runs = dict(zenflow_runs(ROUND12 + ROUND12_LONG), **zenflow_runs((ROUND12_UI8,), cycle=8))
    none, stock = runs["ref20r"]["tokens_per_s_per_gpu"], runs["stock_off20"]["tokens_per_s_per_gpu"]
    reference = runs["ref60"]["losses"]             # no offload, 60 steps (its first 20 are ref20r's, run again)
    gaps = {name: runs[name]["losses"][-1] - reference[len(runs[name]["losses"]) - 1]
            for name in ("zf_fast20", ROUND12_UI8, "zf_fast60")}
    speed = {name: (runs[name]["tokens_per_s_per_gpu"] / none, runs[name]["tokens_per_s_per_gpu"] / stock)
             for name in ("zf_fast20", ROUND12_UI8)}
    fast = all(hidden >= 0.9 and over_stock >= 1.5 for hidden, over_stock in speed.values())
    return dict(target=f"ZenFlow (labs' copy-back, round 12, same host): its CPU step >= 90% hidden and >= 1.5x "
                       f"stock's best offload, same tokens per step, loss within {LOSS_TOLERANCE} of no offload at "
                       "the same step",
                measured=f"update_interval 4: {speed['zf_fast20'][0]:.0%} hidden, {speed['zf_fast20'][1]:.2f}x stock; "
                         f"8: {speed[ROUND12_UI8][0]:.0%}, {speed[ROUND12_UI8][1]:.2f}x; loss above no offload's by "
                         f"{gaps['zf_fast20']:.2f} at step 20 (interval 4), {gaps[ROUND12_UI8]:.2f} at step 24 "
                         f"(interval 8), {gaps['zf_fast60']:.2f} at step 60 (interval 4; from random weights)",
                met=fast and max(gaps.values()) <= LOSS_TOLERANCE, speed=speed, gaps=gaps)


def round14_target(folder=FINETUNE, names=ROUND14, window=WINDOW, label="round 14", labels=None) -> dict:
    """round12_target's target measured where ZenFlow is meant to run, fine-tuning weights that have learned: tokens/s
    relative to labs without offload on the same host (at its best fit, 4 x 2; ZenFlow runs 8 x 1; steps after the
    first cycle), and the loss as its mean over `window` (the same batches in every run; one step's loss swings by
    tenths of a nat from batch to batch) against no offload's over the same steps (stock's offload did not run on this
    host, so no ratio over stock). `labels` (run -> words): "measured" names the runs so, with speed and gap only."""
    runs = finetune_runs(folder, names)
    none = runs[names[0]]
    zenflow = list(names[1:])
    hidden = {name: runs[name]["tokens_per_s_per_gpu"] / none["tokens_per_s_per_gpu"] for name in zenflow}
    gaps = {name: window_mean(runs[name]["losses"], window) - window_mean(none["losses"], window) for name in zenflow}
    landed = {name: [k for k in landed_updates(name, folder) if k < window[-1]] for name in zenflow}
    intervals = {name: update_interval(name, folder) for name in zenflow}
    measured = "; ".join(f"{labels[n]}: {hidden[n]:.1%} of no offload's tokens/s, loss {gaps[n]:+.2f}" if labels else
                         f"update_interval {intervals[n]}{choosing(n, folder)}: {hidden[n]:.1%} of no offload's "
                         f"tokens/s, loss {gaps[n]:+.2f}, {len(landed[n])} full updates felt by step {window[-1]}"
                         for n in zenflow)
    return dict(target=f"ZenFlow fine-tuning ({label}, same host): tokens/s >= 90% of no offload's, loss (mean of "
                       f"steps {window[0]}-{window[-1]}) within {LOSS_TOLERANCE} of no offload's",
                measured=measured,
                met=any(hidden[n] >= 0.9 and gaps[n] <= LOSS_TOLERANCE for n in zenflow),
                hidden=hidden, gaps=gaps, landed=landed, intervals=intervals)


def round15_target() -> dict:
    """round14_target over round 15's 64-step fine-tunes, the loss judged over their last 16 steps."""
    return round14_target(ROUND15, ROUND15_RUNS, WINDOW15, "round 15, 64 steps")
