"""Chapter 10's last section, measured: Qwen2.5-7B on one GPU with an H100 80GB's memory, ZeRO-3 with 70% of the
optimizer offloaded, the one labs.bench.offload_plan setup that fits an 80 GB card and the 126 GiB host the runs had.
Round 26 (results/gpu/one_card_7b_1xh200): an H200 capped at an H100's memory (--gpu-memory H100), at three splits of
the same 8 sequences per optimizer step; rounds 24 and 28 (results/gpu/one_card_7b_1xh100): real H100 80GB cards, no
cap, 8 x 1 on two hosts and 4 x 2 on the second. From random weights, 6 steps each, the host sampled each second
(tools/host_memory.sh).

    one_card_7b.rows()       # per run: layers checkpointed, tokens/s, GPU and host memory measured against labs.memory
    one_card_7b.cpu_adam()   # round 28's host: CPU Adam alone, and its share of the 7B's optimizer step there
    one_card_7b.step_parts() # round 29: the step's parts timed one by one; round 30: the copy cast on the GPU, A/B
    one_card_7b.table(), one_card_7b.lines()   # chapter 10's cell zf-sizing-measured: the runs, and what they show
"""
from __future__ import annotations

import json
import re

from labs import memory
from labs.bench import offload_plan
from labs.course import gpu_report, host_samples, offload_copy_report, one_gpu_report
from labs.course.one_card_runs import (H100, H200, card_bytes, cpu_model, median_timers, offloaded, offloaded_params,
                                       round28_run, round_parts, sub_group_size)
from labs.table import Table

# (card, round, run folder): 8 x 1, 4 x 2 and 2 x 4 on the capped H200; 8 x 1 on an H100 in round 24, then 4 x 2 and
# 8 x 1 on another H100 host in round 28 (two device calls on one host)
RUNS = (("H200 capped at an H100", 26, H200 / "z3off70_7b"), ("H200 capped at an H100", 26, H200 / "z3off70_7b_4x2"),
        ("H200 capped at an H100", 26, H200 / "z3off70_7b_2x4"), ("H100", 24, H100 / "round24" / "z3off70_7b"),
        ("H100", 28, H100 / "round28" / "z3off70_7b_4x2"), ("H100", 28, H100 / "round28" / "z3off70_7b"))
FLUSHES = re.compile(r"(\d+) pytorch allocator cache flushes since last step")


def rows() -> list[dict]:
    """Per run: the card, the split, layers checkpointed (and the fewest that fit the run's GPU memory by
    labs.bench.offload_plan: its --gpu-memory, else the card's memory as nvidia-smi reported it), offloaded
    share, tokens/s per GPU (median of steps 3-6) and MFU (both conventions), the GPU peak
    (torch.cuda.max_memory_allocated) and PyTorch's reserved peak against labs.memory's prediction, the training
    rank's host memory at the host's tightest second (private plus shared, which holds the pinned buffers) against
    labs.memory's host figure, the host's total and least available memory (GiB), the median share of a step (3-6) in
    DeepSpeed's optimizer step timer (the CPU Adam step and the copies around it), the median seconds (steps 3-6) of
    DeepSpeed's forward, backward and optimizer step timers, and the allocator cache flushes
    DeepSpeed reported (a sign that the GPU peak pressed on the cap)."""
    found = []
    for card, round_, run_dir in RUNS:
        summary = json.loads((run_dir / "summary.json").read_text())
        ds_config = json.loads((run_dir / "ds_config.json").read_text())
        predicted = memory.from_run(run_dir)
        cap = json.loads((run_dir / "run.json").read_text())["gpu_memory_bytes"] or card_bytes(run_dir.parent)
        fewest = offload_plan.fewest_checkpointed(summary["preset"], ds_config, cap, summary["micro_batch"],
                                                  summary["gradient_accumulation"])
        host = host_samples.read(run_dir)
        seconds = median_timers(run_dir)
        found.append(dict(card=card, round=round_, run=run_dir.name,
                          batch=f"{summary['micro_batch']} x {summary['gradient_accumulation']}",
                          checkpointed=summary["activation_checkpointing"], fewest_checkpointed=fewest["checkpointed"],
                          offloaded=offloaded(ds_config),
                          offloaded_params=offloaded_params(offloaded(ds_config), sub_group_size(ds_config)),
                          tokens_per_s_per_gpu=summary["tokens_per_s_per_gpu"], mfu=summary["mfu"],
                          mfu_causal=summary["mfu_causal"], tokens_per_step=summary["tokens_per_step"],
                          gpu_gib=max(summary["peak_memory_bytes"]) / 2**30,
                          reserved_gib=max(summary["peak_reserved_bytes"]) / 2**30,
                          predicted_gpu_gib=predicted.total_per_gpu_bytes / 2**30,
                          host_gib=host["rank_at_tightest_gib"],
                          predicted_host_gib=predicted.host_per_node_bytes / 2**30,
                          host_total_gib=host["total_gib"], least_available_gib=host["least_available_gib"],
                          step_share=seconds["share"], fwd_s=seconds["fwd"], bwd_s=seconds["bwd"],
                          optimizer_step_s=seconds["step"],
                          cache_flushes=sum(int(n) for n in FLUSHES.findall((run_dir / "launch.log").read_text()))))
    return found


def cpu_adam() -> dict:
    """Round 28's CPU Adam benchmark (labs.course.offload, median of 5 steps over 10^9 fp32 parameters, every core),
    scaled to the parameters whose optimizer state the 7B run on that host offloaded, against its optimizer step."""
    report = json.loads((H100 / "round28" / "cpu_adam_step.txt").read_text().splitlines()[-1])
    params, offloaded_params, step_s = round28_run()
    adam_s = report["median_s"] * offloaded_params / report["numel"]
    return dict(threads=report["threads"], numel=report["numel"], seconds=report["median_s"], params=params,
                offloaded_params=offloaded_params, adam_s=adam_s, optimizer_step_s=step_s, share=adam_s / step_s)


def step_parts() -> dict:
    """Round 29's parts of ZeRO-3's offloaded step (tools/offload_step_parts.py, 10^9 parameters, every core, the
    master page-locked), each scaled to the parameters the 7B row offloads, and the sum of the three that
    stage3.py's loop runs (unscale-and-clip, CPU Adam, the copy back; DeepSpeed takes offloaded gradients' norms on
    the GPU during backward); CPU Adam alone on that host (labs.course.offload's benchmark); round 30's two runs of
    that row on one host, DeepSpeed's copy of the updated weights and one cast on the GPU from the pageable masters:
    tokens/s and the median forward, backward and optimizer step (steps 3-6) of each; lscpu's CPU model per host."""
    parts = round_parts("29")
    _, offloaded_params, _ = round28_run()
    scaled = {key[:-2]: value * offloaded_params / parts["numel"] for key, value in parts.items() if key.endswith("_s")}
    ab = {name: offload_copy_report.run(H100 / "round30" / name) for name in ("ds_copy", "labs_copy")}
    adam_alone = json.loads((H100 / "round29" / "cpu_adam_step.txt").read_text().splitlines()[-1])["median_s"]
    cpu_models = {n: cpu_model(H100 / f"round{n}" / "cpu.txt") for n in (28, 29, 30)}
    return dict(per_1e9=parts, offloaded_params=offloaded_params, scaled=scaled,
                parts_sum_s=sum(scaled[k] for k in ("grad_mul", "cpu_adam", "copy_to_gpu_bf16")),
                cpu_adam_alone_s=adam_alone, round30=ab, cpu_models=cpu_models,
                labs_over_deepspeed=ab["labs_copy"]["tokens_per_s"] / ab["ds_copy"]["tokens_per_s"])


def table(measured: list[dict] | None = None) -> Table:
    """rows() as chapter 10 shows them."""
    columns = ["card (round)", "batch", "checkpointed layers", "tokens/s", "MFU (causal)", "GPU peak, predicted (GiB)",
               "reserved (GiB)", "host, predicted (GiB)", "host left (GiB)", "fwd + bwd (s)", "optimizer step (s)",
               "cache flushes"]
    return Table([{"card (round)": f"{r['card']} ({r['round']})", "batch": r["batch"],
                   "checkpointed layers": f"{r['checkpointed']} (fewest {r['fewest_checkpointed']})",
                   "tokens/s": f"{r['tokens_per_s_per_gpu']:,.0f}",
                   "MFU (causal)": f"{r['mfu']:.1%} ({r['mfu_causal']:.1%})",
                   "GPU peak, predicted (GiB)": f"{r['gpu_gib']:.2f}, {r['predicted_gpu_gib']:.2f}",
                   "reserved (GiB)": f"{r['reserved_gib']:.1f}",
                   "host, predicted (GiB)": f"{r['host_gib']:.1f}, {r['predicted_host_gib']:.1f}",
                   "host left (GiB)": f"{r['least_available_gib']:.1f}",
                   "fwd + bwd (s)": f"{r['fwd_s'] + r['bwd_s']:.2f}",
                   "optimizer step (s)": f"{r['optimizer_step_s']:.2f} ({r['step_share']:.0%})",
                   "cache flushes": r["cache_flushes"]} for r in measured or rows()], columns)


def lines(measured: list[dict] | None = None) -> list[str]:
    """What chapter 10 prints under the table: the capped H200's fastest split, the real H100s at 8 x 1, CPU Adam
    alone, a third host, the step's parts, the copy cast on the GPU, and two 80 GB cards without offload (run h)."""
    measured = measured or rows()
    card = one_gpu_report.real_card()["failed"][0]           # chapter 9's run y3: the card as torch sees it
    fastest = max((r for r in measured if r["round"] == 26), key=lambda r: r["tokens_per_s_per_gpu"])
    on_h100 = [r for r in measured if r["card"] == "H100" and r["batch"] == "8 x 1"]
    adam, parts = cpu_adam(), step_parts()
    third, scaled = parts["round30"]["ds_copy"], parts["scaled"]
    round28 = next(r for r in on_h100 if r["round"] == 28)
    two_cards = next(r for r in gpu_report.recipes() if r["gpus"] == 2 and r["budget"].startswith("80"))
    run_h = gpu_report.result_file(gpu_report.RUNS["cap"])["cases"][two_cards["labs"]]["summary"]
    speeds = [r["tokens_per_s_per_gpu"] for r in on_h100]
    return [
        f"all with {fastest['offloaded']:.0%} of the optimizer offloaded (whole sub-groups: "
        f"{fastest['offloaded_params']:.1%} of the parameters); round 26, the 7B on one H200 under "
        f"labs.card_cap's H100 cap (the card's {card['capacity']:.2f} GiB as torch sees it, less what the process "
        f"holds outside PyTorch), host {fastest['host_total_gib']:.0f} GiB by free -g: fastest at {fastest['batch']}, "
        f"{fastest['tokens_per_s_per_gpu']:,.0f} tokens/s at {fastest['tokens_per_step']:,} tokens per optimizer step",
        "real H100s at 8 x 1, no cap: " + "; ".join(
            f"round {r['round']} {r['tokens_per_s_per_gpu']:,.0f} tokens/s, forward + backward "
            f"{r['fwd_s'] + r['bwd_s']:.2f} s, optimizer step {r['optimizer_step_s']:.2f} s" for r in on_h100),
        f"CPU Adam alone on round 28's host, {adam['threads']} threads: {adam['seconds']:.3f} s per {adam['numel']:,} "
        f"parameters, so about {adam['adam_s']:.2f} s for the {adam['offloaded_params'] / 1e9:.2f} B whose optimizer "
        f"state is offloaded: {adam['share']:.0%} of that host's {adam['optimizer_step_s']:.2f} s optimizer step",
        f"a third H100 host (round 30, the same run, DeepSpeed as above): {third['tokens_per_s']:,.0f} tokens/s, "
        f"forward + backward {third['fwd_s'] + third['bwd_s']:.2f} s, optimizer step "
        f"{third['optimizer_step_s']:.2f} s; "
        f"lscpu's CPU model: round 28 {parts['cpu_models'][28]}, round 30 {parts['cpu_models'][30]}; round 30 ran "
        f"{third['tokens_per_s'] / round28['tokens_per_s_per_gpu']:.2f}x round 28's tokens/s",
        f"the offloaded step's parts timed one by one on a fourth H100 host (round 29, CPU model "
        f"{parts['cpu_models'][29]}, the master page-locked), scaled to those {parts['offloaded_params'] / 1e9:.2f} B "
        f"parameters: copy of the updated weights to the GPU's bf16 partition {scaled['copy_to_gpu_bf16']:.2f} s, "
        f"CPU Adam {scaled['cpu_adam']:.2f} s, unscale-and-clip {scaled['grad_mul']:.2f} s: "
        f"{parts['parts_sum_s']:.2f} s together (CPU Adam alone there: {parts['cpu_adam_alone_s']:.3f} s per 10^9); "
        f"the same fp32 bytes copied uncast from page-locked memory: {scaled['copy_to_gpu_fp32']:.2f} s",
        f"the copy cast on the GPU from ZeRO-3's pageable masters instead (round 30, one run each on one host): "
        f"{parts['labs_over_deepspeed']:.2f}x DeepSpeed's tokens/s",
        f"two H200s under the plain 80 GB cap without offload (run {two_cards['run']}: {two_cards['labs']}, "
        f"8 sequences per GPU per step, {2 * fastest['tokens_per_step']:,} tokens per step across the two): "
        f"{two_cards['labs_tokens_per_s'] / fastest['tokens_per_s_per_gpu']:.1f}x that per GPU ("
        f"{two_cards['labs_tokens_per_s'] / max(speeds):.1f}-{two_cards['labs_tokens_per_s'] / min(speeds):.1f}x the "
        f"real H100s' 8 x 1); its peak {max(run_h['peak_memory_bytes']) / 2**30:.1f} GiB allocated, "
        f"{max(run_h['peak_reserved_bytes']) / 2**30:.1f} reserved"]
