"""Resuming a run from its checkpoints, on the host (labs.launch calls these; the ranks load in labs.checkpoint).

- `options`: what a resumed run takes: the run's own inputs (run.json, its resolved batch and learning rate), then
  whatever the caller changed (more --steps, fewer --nproc, another --config or --out).
- `plan`: the checks that keep it the same run (the model's shape, the data order: seed, data, sequence length,
  global batch; the precision; no more ranks than wrote it, no move between ZeRO-1/2 and ZeRO-3) and how its ranks
  load the checkpoint: as written, or, on fewer ranks or another stage of the same family, through DeepSpeed's
  universal checkpoint (converted by `prepare_work`).
- `prepare_work`: the new run folder starts with the old one's checkpoints (hard links) and its metrics up to the
  checkpoint, so a resumed run folder tells the whole story, step 1 on.
- `keep_interrupted`: a run that fails after a complete checkpoint is published as a run folder marked
  interrupted (interrupted.json, no summary.json) instead of being thrown away; the error says how to resume it.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from labs import checkpoint, runfolder, zenflow_layout
from labs import config as config_lib
from labs.errors import LabsError

INTERRUPTED = "interrupted.json"
# run.json keys a resumed run inherits under launch.prepare's names.
INHERITED = {"preset": "preset", "config": "config", "steps": "steps", "seed": "seed", "nproc": "nproc",
             "model_path": "model_path", "seq_len": "seq_len", "data": "data_path", "loss": "loss",
             "activation_checkpointing": "activation_checkpointing", "warmup_steps": "warmup_steps",
             "engine": "engine", "stock": "stock", "kernels": "kernels", "precision": "precision",
             "instruments": "instruments", "gpu_memory_bytes": "gpu_memory", "save_every": "save_every"}
# What must not change, or the resumed run would not continue the same training, and why.
DATA_ORDER = "the resumed run must see the same data in the same order"
SAME = {"seq_len": ("--seq-len", DATA_ORDER), "seed": ("--seed", DATA_ORDER), "data": ("--data", DATA_ORDER),
        "precision": ("the precision (the config's bf16/fp16 section)", "the resumed run must compute in the "
                      "precision its weights and optimizer states were trained in: keep the run's config")}


def run_folder_of(resume, what: str = "--resume") -> Path:
    """The run folder `resume` names (`what`: how the user named it, for the error): the folder itself, or the run
    holding the named checkpoint."""
    path = Path(resume)
    run_dir = path.parent.parent if (path / checkpoint.MANIFEST).is_file() else path
    if not (run_dir / "run.json").is_file() or not runfolder.is_run_folder(run_dir):
        state = "does not exist" if not path.exists() else "is not a labs run folder (no run.json)"
        raise LabsError(f"{what} '{resume}' {state}; name a run folder that labs wrote with --save-every")
    return run_dir


def options(resume, given: dict) -> dict:
    """launch.prepare's keyword arguments for a resumed run: the run's own, updated by those `given` (a value of
    None means "the run's own", except save_every=None: no more checkpoints)."""
    given = {key: value for key, value in given.items() if value is not None or key == "save_every"}
    run_dir = run_folder_of(resume)
    if given.get("engine", "deepspeed") != "deepspeed":
        raise LabsError(f"--resume: labs resumes DeepSpeed runs, not --engine {given['engine']}")
    spec = json.loads((run_dir / "run.json").read_text())
    resolved = json.loads((run_dir / "ds_config.json").read_text())
    inherited = {name: spec[key] for key, name in INHERITED.items() if key in spec}
    if spec.get("device") == "cpu":                   # CPU ranks stay CPU ranks, on a GPU host too
        inherited["device"] = "cpu"
    inherited.update(out=str(run_dir), micro_batch=resolved["train_micro_batch_size_per_gpu"],
                     grad_accum=resolved["gradient_accumulation_steps"])
    lr = (resolved.get("optimizer") or {}).get("params", {}).get("lr")
    if lr is not None:
        inherited["lr"] = lr
    nproc = given.get("nproc", spec["nproc"])
    if nproc != spec["nproc"] and not {"micro_batch", "grad_accum"} & set(given):
        # Other ranks, same global batch: each rank takes a larger (or smaller) share of every micro-step.
        share, left = divmod(resolved["train_batch_size"], nproc * resolved["gradient_accumulation_steps"])
        if left or not share:
            raise LabsError(f"--nproc {nproc}: the run's global batch of {resolved['train_batch_size']} sequences "
                            f"does not split over {nproc} ranks x {resolved['gradient_accumulation_steps']} "
                            "micro-batches; give --micro-batch and --grad-accum (their product x --nproc must be "
                            f"{resolved['train_batch_size']})")
        inherited["micro_batch"] = share
    if "config" in given:                             # the new config says bf16 or fp32 (checked in `plan`)
        inherited.pop("precision", None)
    return {**inherited, **given}


def plan(resume, spec: dict, resolved: dict) -> dict:
    """Check that the resumed run continues the checkpointed one; returns what its ranks need (spec["resume"])."""
    run_dir = run_folder_of(resume)
    path = checkpoint.find(resume)
    saved = checkpoint.manifest(path)
    # Only the keys the checkpoint recorded: a key labs.models.shape gained later (max_position_embeddings) is not
    # in older manifests, and every key that sets a weight's shape is.
    changed = ", ".join(f"{key} {value} -> {spec['dims'].get(key)}" for key, value in saved["dims"].items()
                        if value != spec["dims"].get(key))
    if changed:
        raise LabsError(f"--resume: checkpoint '{path}' holds another model shape ({changed}); resume it with the "
                        f"model it was trained with (preset '{saved['preset']}')")
    for key, (flag, why) in SAME.items():
        if saved[key] != spec[key]:
            raise LabsError(f"--resume: {flag} was {saved[key]!r} when checkpoint '{path.name}' was written, not "
                            f"{spec[key]!r}; {why}")
    if saved["train_batch_size"] != resolved["train_batch_size"]:
        raise LabsError(f"--resume: the global batch was {saved['train_batch_size']} sequences per step, not "
                        f"{resolved['train_batch_size']} (micro-batch x grad-accum x ranks); keep it to continue the "
                        "same data order")
    if spec["steps"] <= saved["step"]:
        raise LabsError(f"--steps {spec['steps']}: checkpoint '{path.name}' is already at step {saved['step']}; "
                        "give a larger --steps to train on")
    if spec["nproc"] > saved["world_size"]:
        # Only fewer ranks (or as many) were tried: a larger world through the universal checkpoint is untested.
        raise LabsError(f"--nproc {spec['nproc']}: checkpoint '{path.name}' was written by {saved['world_size']} "
                        "rank(s), and labs resumes it on as many ranks or fewer; to train on more GPUs, export the "
                        "model (labs export RUN_DIR OUT_DIR) and start a new run from it with --model-path OUT_DIR")
    stage = config_lib.stage(resolved)
    universal = saved["world_size"] != spec["nproc"] or saved["zero_stage"] != stage
    if universal and (0 in (stage, saved["zero_stage"]) or (stage == 3) != (saved["zero_stage"] == 3)):
        # DeepSpeed 0.19.8 writes the universal checkpoint's common optimizer state in one format for ZeRO-1/2 and
        # another for ZeRO-3, and each stage reads only its own: ZeRO-2 -> 3 and 3 -> 2 fail inside every rank.
        raise LabsError(f"--resume: ZeRO-{saved['zero_stage']} on {saved['world_size']} rank(s) -> ZeRO-{stage} on "
                        f"{spec['nproc']}: DeepSpeed's universal checkpoint changes the stage only within ZeRO-1/2 "
                        "(ZeRO-3 stays ZeRO-3); keep the stage family, or export the model (labs export RUN_DIR "
                        "OUT_DIR) and start a new run from it with --model-path OUT_DIR")
    _check_zenflow_layout(path, resolved)
    note = zenflow_moments_note(path)
    if note:
        print(note, file=sys.stderr, flush=True)
    local = Path(checkpoint.FOLDER) / path.name        # the copy in the new run folder, relative to it
    return dict(run=str(run_dir.resolve()), source=str(path.resolve()), step=saved["step"],
                universal=universal, checkpoint=str(local),
                load=str(local.with_name(path.name + ".universal")) if universal else str(local),
                from_layout=f"ZeRO-{saved['zero_stage']} on {saved['world_size']} rank(s)",
                to_layout=f"ZeRO-{stage} on {spec['nproc']} rank(s)")


def _check_zenflow_layout(path: Path, resolved: dict) -> None:
    """ZenFlow under ZeRO-1/2 saves each matrix transposed in the flat fp32 partitions (labs.zenflow_layout), and
    DeepSpeed loads those partitions into whatever layout the resumed run has: across the change the first update
    copies permuted master weights into the model (tiny model: ZenFlow -> plain offload, step 6's loss 11.95 instead of
    11.78, above step 1's). The checkpoint's own config says how it was written."""
    saved, wanted = zenflow_layout.transposed(checkpoint.ds_config(path)), zenflow_layout.transposed(resolved)
    if saved != wanted:
        written, asked = ("with", "without") if saved else ("without", "with")
        raise LabsError(f"--resume: checkpoint '{path.name}' was written {written} ZenFlow and the config asks to go "
                        f"on {asked} it; ZenFlow stores matrices transposed in the optimizer's flat partitions, so the "
                        "weights would be scrambled: keep the run's config (or its zenflow block), or export the model "
                        "(labs export RUN_DIR OUT_DIR) and start a new run from it with --model-path OUT_DIR")


def zenflow_moments_note(path: Path) -> str | None:
    """ZenFlow with overlap_step keeps its CPU Adam moments in its optimizer process, and DeepSpeed 0.19.8 saves the
    training process's optimizer state, which holds none (tests/test_zenflow.py checks a checkpoint): a resumed run
    restarts them from zero, and labs.zenflow_moments counts its updates from 1 again, which matches. Said once, at
    resume; the weights, the fp32 masters and the GPU's columns are restored."""
    zenflow = (checkpoint.ds_config(path).get("zero_optimization") or {}).get("zenflow") or {}
    if not zenflow.get("overlap_step"):
        return None
    return (f"labs: note: checkpoint '{path.name}' was written by ZenFlow with overlap_step, whose CPU Adam moments "
            "live in its optimizer process and are not in the checkpoint (DeepSpeed 0.19.8): they restart from zero "
            "in this run, so its losses will not repeat an unbroken run's")


def prepare_work(spec: dict, work: Path) -> None:
    """Fill the new run's working folder before its ranks start: the source run's checkpoints up to the resumed one
    (hard links: no copy on the same filesystem), `latest`, its metrics of those steps, and the universal
    conversion when the layout changes."""
    resume = spec["resume"]
    source_run, step = Path(resume["run"]), resume["step"]
    for path in checkpoint.complete(source_run):
        if int(path.name[4:]) <= step:
            checkpoint.link_tree(path, checkpoint.folder(work) / path.name)
    if not (work / resume["checkpoint"]).is_dir():            # a checkpoint named directly, outside the run's list
        checkpoint.link_tree(Path(resume["source"]), work / resume["checkpoint"])
    (checkpoint.folder(work) / "latest").write_text(checkpoint.tag(step))
    lines = [line for line in (source_run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    kept = [line for line in lines if json.loads(line)["step"] <= step]
    if [json.loads(line)["step"] for line in kept] != list(range(1, step + 1)):
        raise LabsError(f"--resume: '{source_run / 'metrics.jsonl'}' does not hold steps 1-{step}; the run folder "
                        "was changed after the run")
    (work / "metrics.jsonl").write_text("".join(line + "\n" for line in kept))
    if resume["universal"]:
        to_universal(work / resume["checkpoint"], work / resume["load"])


def to_universal(source: Path, target: Path) -> float:
    """DeepSpeed's converter (`python -m deepspeed.checkpoint.ds_to_universal`): every parameter's fp32 weights and
    Adam moments, whole, one folder per parameter, so any number of ranks at any ZeRO stage can take its share.
    ZeRO-1/2 checkpoints written outside Megatron lack the version record it wants: --inject_missing_state adds it.
    Returns the seconds it took."""
    start = time.perf_counter()
    workers = str(max(1, min(4, (os.cpu_count() or 1) // 2)))
    command = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(source),
               "--output_folder", str(target), "--num_extract_workers", workers, "--num_merge_workers", workers]
    if checkpoint.manifest(source)["zero_stage"] < 3:
        command.append("--inject_missing_state")
    env = dict(os.environ, DS_ACCELERATOR=os.environ.get("DS_ACCELERATOR", "cuda" if torch.cuda.is_available()
                                                            else "cpu"))
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise LabsError(f"DeepSpeed's ds_to_universal could not convert '{source}': "
                        f"{(done.stderr.strip().splitlines() or ['no output'])[-1]}")
    (target.parent / "latest_universal").unlink(missing_ok=True)   # its pointer beside the output: labs names it
    return time.perf_counter() - start


def finish(work: Path) -> None:
    """Before a run folder is published: drop what only the start of a resumed run needed (the universal copy, as
    large as the optimizer states) and any save a crash cut short."""
    root = checkpoint.folder(work)
    for path in [*root.glob("*.universal"), *root.glob(".step*.partial")]:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        elif path.exists():
            path.unlink()


def keep_interrupted(work: Path, out: Path, reason: str) -> str:
    """A failed run that saved a complete checkpoint is published, marked interrupted, at --out (or, when --out
    holds a finished run, beside it as NAME.interrupted). Returns what to tell the user ("" when nothing is kept)."""
    found = checkpoint.complete(work)
    if not found:
        return ""
    out = Path(out)
    target = out if not out.exists() or (out / INTERRUPTED).is_file() else out.with_name(out.name + ".interrupted")
    if target.exists() and not ((target / INTERRUPTED).is_file() and runfolder.is_run_folder(target)):
        return f"its checkpoints were not kept: '{target}' is in the way"
    finish(work)
    step = checkpoint.manifest(found[-1])["step"]
    logged = len([line for line in (work / "metrics.jsonl").read_text().splitlines() if line.strip()]) \
        if (work / "metrics.jsonl").is_file() else 0
    (work / INTERRUPTED).write_text(json.dumps(dict(
        reason=reason.strip().splitlines()[0] if reason.strip() else "stopped", checkpoint=found[-1].name,
        step=step, steps_logged=logged, stopped=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        resume=f"labs train --resume {target}"), indent=1) + "\n")
    runfolder.publish(work, target)
    redone = "" if logged <= step else f" (step {logged} is redone on resume)" if logged == step + 1 else \
        f" (steps {step + 1}-{logged} are redone on resume)"
    return f"run folder '{target}' keeps the checkpoint of step {step}{redone}: continue with " \
           f"`labs train --resume {target}`"
