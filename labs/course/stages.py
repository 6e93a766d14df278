"""The ZeRO-stages chapter's experiments: one real launch per stage on the same seed and data, and what to
read off the runs: the losses, the bytes each rank holds, the bytes each rank moves per step, and what
DeepSpeed's buffer knobs cost.

    runs = stages.run_stages(RUNS / "02_zero_stages", steps=8)      # {0: Run, 1: Run, 2: Run, 3: Run}
    stages.loss_differences(runs)                                    # {1: ..., 2: ..., 3: ...}: largest |loss gap| to 0
    stages.updated_steps(runs[0])                                    # [4, 5, ...]: losses after a real update
    Table(stages.comm_rows(runs), ["stage", "volume_psi", "paper_psi"])
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

from labs import CONFIGS, launch, memory, models, resolve
from labs import config as config_lib
from labs.instruments import comm
from labs.resolve import STAGE_FILES

# What the chapters' experiments measure besides training: bytes held, bytes moved, ZeRO's buffers.
ALL_INSTRUMENTS = ("state_bytes", "comm", "zero_buffers")


def run_stages(out, steps=20, precision="fp32", stages=(0, 1, 2, 3), **launch_options) -> dict:
    """One launch per ZeRO stage from ds_configs/ (the lesson files), same preset, seed and data; returns
    {stage: Run}. `precision` overrides the files' bf16 (fp32 by default: then the stages must agree to rounding;
    None keeps the files' bf16, as chapter 1 measures what a bf16 run holds)."""
    return {stage: _launch(Path(out) / f"zero{stage}", CONFIGS / STAGE_FILES[stage], steps, precision,
                           f"ZeRO-{stage} ({STAGE_FILES[stage]})", launch_options) for stage in stages}


def run_configs(out, files: dict, steps=8, precision=None, **launch_options) -> dict:
    """files: {name: file in ds_configs/}; one launch each, as the files say unless `precision` is given."""
    return {name: _launch(Path(out) / name, CONFIGS / file, steps, precision, f"{name} ({file})", launch_options)
            for name, file in files.items()}


def run_variants(out, variants: dict, steps=3, precision="fp32", schedule_steps=None, **launch_options) -> dict:
    """variants: {name: (base file in ds_configs/, {dotted key: value})}. Each variant's config is written
    to <out>/configs/<name>.json (so it can be read and rerun) and launched; returns {name: Run}.
    `schedule_steps`: the learning-rate schedule of a run of that many steps (variant_config), so that a shorter
    variant steps with the same rate as a longer run, step for step, and their losses can be compared."""
    runs = {}
    for name, (base, changes) in variants.items():
        path = config_lib.write(variant_config(base, changes, schedule_steps), Path(out) / "configs" / f"{name}.json")
        runs[name] = _launch(Path(out) / name, path, steps, precision, f"{name}", launch_options)
    return runs


def variant_config(base: str, changes: dict, schedule_steps=None) -> dict:
    """A ds_configs/ file with dotted keys changed. With `schedule_steps`, the scheduler's step counts that labs
    fills for a run of that many steps replace its "auto" ones (total_num_steps, and warmup_num_steps by labs.resolve's
    own rule), whatever number of steps the variant itself runs; a count the file or the changes type is kept."""
    config = config_lib.variant(config_lib.load(CONFIGS / base), changes)
    params = (config.get("scheduler") or {}).get("params")
    if schedule_steps and params is not None:
        params.update({key: value for key, value in resolve.scheduler_steps(schedule_steps).items()
                       if params.get(key) == "auto"})
    return config


def _launch(out, config, steps, precision, label, options):
    options = {"preset": "tiny", "instruments": ALL_INSTRUMENTS, **options}
    print(f"{label}: {steps} steps of '{options['preset']}' ...", end=" ", flush=True)
    start = time.perf_counter()
    run = launch.run(config=config, steps=steps, out=out, precision=precision, stream=False, **options)
    print(f"done on {run.spec['nproc']} ranks in {time.perf_counter() - start:.0f} s", flush=True)
    return run


def ranks_line(nproc: int) -> str:
    """Where the chapters' launches run, in one line: on a GPU host, what differs from the outputs stored in the
    notebooks (which come from 2 CPU ranks)."""
    if not torch.cuda.is_available():
        return f"{nproc} CPU ranks (gloo, DeepSpeed's cpu accelerator): the setting of the outputs stored here"
    return (f"{nproc} of this host's {torch.cuda.device_count()} GPUs (NCCL; {nproc} needed): the bytes held and "
            "moved follow the same rules, but the resolved configs lose torch_adam (DeepSpeed's fused Adam steps "
            "instead), offloaded tensors show up on cuda and cpu, and losses, timings and NVMe checks are this host's")


# ---------------------------------------------------------------------------------------------- the math
def loss_differences(runs: dict, reference=None) -> dict:
    """Largest absolute difference of the per-step loss from the reference run's, for every other run."""
    reference = next(iter(runs)) if reference is None else reference
    base = runs[reference].losses
    return {name: max(abs(a - b) for a, b in zip(run.losses, base)) for name, run in runs.items()
            if name != reference}


def updated_steps(run) -> list[int]:
    """The steps whose logged loss follows at least one update with a nonzero learning rate. A step logs the loss of
    its forward pass, before its own update; labs' warm-up gives the first steps a rate of 0 (DeepSpeed's
    WarmupCosineLR: 0 before its first step, then warmup_min_ratio 0 at its first), so their updates change nothing
    and the losses up to the first real update all come from the starting weights."""
    first = next((r["step"] for r in run.metrics if r["lr"] > 0), None)
    return [] if first is None else [r["step"] for r in run.metrics if r["step"] > first]


# ---------------------------------------------------------------------------------------------- held bytes
def state_rows(runs: dict) -> list[dict]:
    """Per stage, rank and category: bytes the rank's engine held (the state_bytes instrument, after the last
    backward) next to labs.memory's prediction for the same run."""
    rows = []
    for run in runs.values():
        predicted = memory.from_run(run).resident_per_rank
        for measured, expected in zip(run.summary["state_bytes"], predicted):
            for category in ("params", "grads", "optimizer"):
                got, want = measured[f"{category}_bytes"], expected[f"{category}_bytes"]
                rows.append(dict(stage=run.summary["zero_stage"], rank=measured["rank"], category=category,
                                 measured_bytes=got, predicted_bytes=want, ratio=got / want if want else None))
    return rows


def mismatches(runs: dict, rows: list[dict], tolerance=0.01) -> list[str]:
    """Every rank's categories against the prediction: how many rows are equal to the byte, the largest gap, and for
    each category off by more than `tolerance`, the tensors the probe found there (its largest ones), so the gap can
    be read off by name."""
    lines, off = [], 0
    for row in rows:
        if row["ratio"] is None or abs(row["ratio"] - 1) <= tolerance:
            continue
        off += 1
        run = next(r for r in runs.values() if r.summary["zero_stage"] == row["stage"])
        state = run.summary["state_bytes"][row["rank"]]
        lines.append(f"ZeRO-{row['stage']} rank {row['rank']} {row['category']}: measured {row['measured_bytes']:,} "
                     f"bytes, predicted {row['predicted_bytes']:,}; the largest tensors found there:")
        lines += [f"    {t['what']}: {t['bytes']:,} bytes ({t['dtype']})" for t in state["largest"]
                  if t["category"] == row["category"]]
    exact = sum(r["measured_bytes"] == r["predicted_bytes"] for r in rows)
    worst = max(rows, key=lambda r: abs(r["measured_bytes"] - r["predicted_bytes"]))
    gap = worst["measured_bytes"] - worst["predicted_bytes"]
    within = ("every row" if not off else f"{len(rows) - off} rows") + f" within {tolerance:.0%} of the prediction"
    return [f"{len(rows)} rows (every stage, rank and category): {exact} equal to the byte, {within}; the largest "
            f"gap {gap:+,} bytes (ZeRO-{worst['stage']} rank {worst['rank']} {worst['category']})"] + lines


def gradient_moments(preset="qwen2.5-7b", gpus=8, stages=(1, 2), **options) -> list[dict]:
    """labs.memory's moments of one step (labs.memory.peak) for each stage's lesson file: the gradient bytes a GPU
    holds during the last decoder layer's backward, at the end of backward and at the optimizer step, that end's
    total, and the step's peak moment. ZeRO-1 reduces once backward is over (DeepSpeed's engine.backward ends with it,
    before the state_bytes instrument reads), so it holds every full gradient at the end of backward; ZeRO-2 reduces
    bucket by bucket during backward and keeps only its partition."""
    rows = []
    for stage in stages:
        est = memory.estimate(preset, stage=stage, gpus_per_node=gpus, **options)
        moments = est.phases
        rows.append(dict(stage=stage, layer_grads=moments["layer_backward"]["grads"],
                         end_grads=moments["backward_end"]["grads"], step_grads=moments["optimizer_step"]["grads"],
                         end_total=moments["backward_end"]["total"], peak_phase=est.peak_phase,
                         peak_total=moments[est.peak_phase]["total"]))
    return rows


def optimizer_ratios(preset="tiny", gpus=2, precisions=("fp32", "bf16")) -> list[dict]:
    """labs.memory's optimizer bytes per rank (fp32 master included) at ZeRO-0 and ZeRO-1, per precision."""
    rows, params = [], models.param_counts(models.shape(preset))["total"]
    for precision in precisions:
        held = [memory.estimate(preset, stage=stage, gpus_per_node=gpus, precision=precision)
                .resident_per_rank[0]["optimizer_bytes"] for stage in (0, 1)]
        rows.append(dict(precision=precision, zero0_bytes=held[0], zero1_bytes=held[1], ratio=held[1] / held[0],
                         zero0_per_param=held[0] / params, zero1_per_param=held[1] / params))
    return rows


# ---------------------------------------------------------------------------------------------- moved bytes
def comm_rows(runs: dict, skip=1) -> list[dict]:
    """Per run: payload bytes per step of each collective on rank 0 (mean over the steps after `skip`),
    the ZeRO paper's volume, and both in units of Psi x bytes per element."""
    rows = []
    for name, run in runs.items():
        summary = run.summary
        per_step = comm.per_step(run.metrics, skip=skip)
        psi_bytes = summary["params"] * memory.DTYPE_BYTES[summary["precision"]]
        volume = comm.volume_bytes(per_step)
        row = dict(run=name, stage=summary["zero_stage"], psi_bytes=psi_bytes, volume_bytes=volume,
                   volume_psi=volume / psi_bytes,
                   paper_psi=comm.paper_volume_elements(summary["zero_stage"], 1),
                   wire_bytes=comm.wire_bytes(per_step, summary["world_size"]))
        for kind in comm.VOLUME_FACTOR:
            row[f"{kind}_bytes"] = per_step.get(kind, {}).get("bytes", 0)
            row[f"{kind}_calls"] = per_step.get(kind, {}).get("calls", 0)
        rows.append(row)
    return rows


def knob_rows(runs: dict, skip=1) -> list[dict]:
    """Per run: what DeepSpeed's knobs decide, measured on rank 0 (labs.buffers) and by the comm counter."""
    rows = []
    for row, run in zip(comm_rows(runs, skip), runs.values()):
        buffers = run.summary["zero_buffers"][0]
        zero = run.ds_config["zero_optimization"]
        rows.append(dict(row, bucket_bytes=buffers["bucket_bytes"],
                         gathered_peak_elements=buffers["gathered_peak_elements"],
                         persistent_elements=buffers["persistent_elements"],
                         reduce_bucket_size=zero.get("reduce_bucket_size"),
                         overlap_comm=zero.get("overlap_comm", False),
                         contiguous_gradients=zero.get("contiguous_gradients", True)))
    return rows
