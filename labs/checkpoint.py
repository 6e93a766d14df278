"""Training checkpoints of a run: written by every rank every N steps, published only once complete, found again
to resume or export.

    RUN_DIR/checkpoints/
        step00000004/             a complete checkpoint: DeepSpeed's own files (each rank's ZeRO partition of the
                                  fp32 master weights and Adam moments, the module and scheduler states), each
                                  rank's RNG state, and labs_checkpoint.json (the manifest: step, shapes, file sizes)
        latest                    DeepSpeed's pointer to the newest complete one: engine.load_checkpoint(dir) and
                                  zero_to_fp32.py read it
        .step00000006.partial/    a save in progress, or one a crash interrupted: never loaded, removed later

A save is published in three moves: every rank writes into the `.partial` folder; a barrier (every rank has
written); rank 0 writes the manifest, flushes the files to disk, renames the folder into place and points `latest`
at it. A crash before the rename leaves only a `.partial` folder; a crash after it leaves a complete checkpoint.
DeepSpeed's own `save_checkpoint` writes `latest` from rank 0 before the other ranks are known to have finished,
so labs writes `latest` itself.

    checkpoint.save_if_due(engine, step, spec, run_dir)     # every rank, after each optimizer step
    done = checkpoint.restore(engine, spec, run_dir)         # every rank, before the first step of a resumed run
    checkpoint.complete(run_dir), checkpoint.manifest(path)  # the host: what a run folder holds
"""
from __future__ import annotations

import json
import os
import random
import shutil
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist

from labs.errors import LabsError

FOLDER = "checkpoints"
MANIFEST = "labs_checkpoint.json"
RESUMED = "resumed.json"             # a resumed run's record of its load
SIXTEEN_BIT = "model_16bit.pt"       # with stage3_gather_16bit_weights_on_model_save: the whole model, 2 bytes each
# Test hook: "RANK:save:STEP" makes that rank SIGKILL itself after writing its part of the step-STEP checkpoint
# (before the barrier); "RANK:step:STEP" after finishing step STEP. The fault tests use it; nothing else sets it.
FAULT_ENV = "LABS_TEST_KILL"
# What the manifest records about the run that wrote a checkpoint: what a resumed run must agree with.
RUN_KEYS = ("preset", "dims", "seq_len", "seed", "data", "precision", "engine")


def tag(step: int) -> str:
    return f"step{step:08d}"


def folder(run_dir) -> Path:
    return Path(run_dir) / FOLDER


def manifest(path) -> dict:
    return json.loads((Path(path) / MANIFEST).read_text())


def is_complete(path: Path) -> bool:
    """A published checkpoint whose files all exist at the sizes its manifest recorded."""
    try:
        files = manifest(path)["files"]
    except (OSError, ValueError, KeyError):
        return False
    return all((path / name).is_file() and (path / name).stat().st_size == size for name, size in files.items())


def complete(run_dir) -> list[Path]:
    """The run's complete checkpoints, oldest first."""
    root = folder(run_dir)
    found = [p for p in root.glob("step*") if p.is_dir() and p.name[4:].isdigit()] if root.is_dir() else []
    return sorted((p for p in found if is_complete(p)), key=lambda p: int(p.name[4:]))


def find(where) -> Path:
    """The checkpoint a user means: a checkpoint folder itself, or a run folder's newest complete checkpoint.
    One LabsError line when there is none."""
    where = Path(where)
    if (where / MANIFEST).is_file():
        if not is_complete(where):
            raise LabsError(f"checkpoint '{where}' is incomplete: a file its manifest lists is missing or has "
                            "another size; use an earlier checkpoint of that run")
        return where
    if not where.is_dir():
        raise LabsError(f"'{where}' does not exist; name a run folder that labs wrote with --save-every")
    found = complete(where)
    if not found:
        partial = sorted(folder(where).glob(".step*.partial")) if folder(where).is_dir() else []
        why = f" (only an unfinished save, {partial[-1].name})" if partial else ""
        raise LabsError(f"'{where}' holds no complete checkpoint{why}; a run writes them when started with "
                        "--save-every N")
    return found[-1]


def ds_config(path: Path) -> dict:
    """The DeepSpeed config that wrote checkpoint `path`, as DeepSpeed recorded it in its model-states file (the run
    folder's ds_config.json is its latest run's, and a resumed run may have changed it). Memory-mapped: no weights
    are read."""
    files = sorted(Path(path).glob("*model_states.pt"))
    if not files:
        return {}
    return torch.load(files[0], map_location="cpu", mmap=True, weights_only=False).get("ds_config") or {}


# ---------------------------------------------------------------------------------------------- rank side
def is_due(step: int, save_every: int | None, steps: int) -> bool:
    """A run saves every `save_every` steps and at its last step."""
    return bool(save_every) and (step % save_every == 0 or step == steps)


def save_if_due(engine, step: int, spec: dict, run_dir: Path) -> None:
    """Every rank calls this after each optimizer step."""
    _fault("step", step)
    if is_due(step, spec.get("save_every"), spec["steps"]):
        save(engine, step, spec, run_dir)


def save(engine, step: int, spec: dict, run_dir: Path) -> Path:
    """Write the step-`step` checkpoint from every rank and publish it when all have written (module docstring)."""
    root, rank = folder(run_dir), dist.get_rank()
    partial, final = root / f".{tag(step)}.partial", root / tag(step)
    start = time.perf_counter()
    if rank == 0:
        root.mkdir(exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)         # an earlier attempt at this step that crashed
    dist.barrier()
    engine.save_checkpoint(str(root), tag=partial.name, client_state={"labs_step": step}, save_latest=False)
    torch.save(_rng_state(), partial / f"rng_rank{rank}.pt")
    if engine.zero_optimization_partition_weights() and engine.zero_gather_16bit_weights_on_model_save():
        # The config asks ZeRO-3 to gather the whole 16-bit model on save: every rank sends, rank 0 writes.
        engine.save_16bit_model(str(partial), SIXTEEN_BIT)
    _fault("save", step)
    dist.barrier()                                         # every rank's files are written
    if rank == 0:
        _publish(partial, final, step, spec, engine, time.perf_counter() - start)
    dist.barrier()                                         # no rank goes on before the checkpoint exists
    return final


def _publish(partial: Path, final: Path, step: int, spec: dict, engine, seconds: float):
    files = {str(p.relative_to(partial)): p.stat().st_size for p in sorted(partial.rglob("*")) if p.is_file()}
    flushing = time.perf_counter()
    for name in files:                                     # on disk before the checkpoint is declared complete
        _fsync(partial / name)
    # save_seconds is the ranks' write (which may land in the page cache), fsync_seconds the flush to the disk after it
    fsync_seconds = time.perf_counter() - flushing
    record = dict(step=step, tag=final.name, world_size=dist.get_world_size(),
                  zero_stage=engine.zero_optimization_stage(), train_batch_size=engine.train_batch_size(),
                  micro_batch=engine.train_micro_batch_size_per_gpu(),
                  gradient_accumulation=engine.gradient_accumulation_steps(),
                  **{key: spec.get(key) for key in RUN_KEYS}, save_seconds=seconds, fsync_seconds=fsync_seconds,
                  bytes=sum(files.values()),
                  files=files, written=time.strftime("%Y-%m-%dT%H:%M:%S%z"), hf_config=_hf_config(engine))
    _write_atomic(partial / MANIFEST, json.dumps(record, indent=1) + "\n")
    shutil.rmtree(final, ignore_errors=True)               # a stale copy of this step (a run resumed before it)
    partial.rename(final)
    _write_atomic(final.parent / "latest", final.name)
    _fsync(final.parent)


def _hf_config(engine) -> dict | None:
    """The model's own transformers config, so that an export needs neither the run's inputs nor its model folder."""
    hf = getattr(engine.module, "hf", None)
    return json.loads(hf.config.to_json_string(use_diff=False)) if hf is not None else None


def restore(engine, spec: dict, run_dir: Path) -> int:
    """Every rank, right after the engine is built: load the checkpoint a resumed run starts from (its own, or the
    universal one labs converted it to) with optimizer and scheduler states, then this rank's RNG state.
    Returns the number of optimizer steps already done (0 for a new run). Rank 0 records how long the load took
    in RUN_DIR/resumed.json."""
    resume = spec.get("resume")
    if not resume:
        return 0
    load = Path(run_dir) / resume["load"]
    start = time.perf_counter()
    path, client = engine.load_checkpoint(str(load.parent), tag=load.name, load_optimizer_states=True,
                                          load_lr_scheduler_states=True)
    if path is None or (client or {}).get("labs_step") != resume["step"]:
        raise RuntimeError(f"checkpoint {load} did not load (DeepSpeed returned {path}, step "
                           f"{(client or {}).get('labs_step')}, expected {resume['step']})")
    rng = Path(run_dir) / resume["checkpoint"] / f"rng_rank{dist.get_rank()}.pt"
    if rng.is_file():                                      # a rank that did not exist before starts from its seed
        _set_rng_state(torch.load(rng, weights_only=False))
    dist.barrier()
    if dist.get_rank() == 0:
        (Path(run_dir) / RESUMED).write_text(json.dumps(dict(
            step=resume["step"], load_seconds=time.perf_counter() - start, universal=resume["universal"],
            bytes=sum(p.stat().st_size for p in load.rglob("*") if p.is_file())), indent=1) + "\n")
    return resume["step"]


def _rng_state() -> dict:
    state = dict(python=random.getstate(), torch=torch.get_rng_state())
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict):
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _fault(where: str, step: int):
    wanted = os.environ.get(FAULT_ENV, "")
    if wanted and wanted == f"{dist.get_rank()}:{where}:{step}":
        os.kill(os.getpid(), signal.SIGKILL)


# ---------------------------------------------------------------------------------------------- files
def _write_atomic(path: Path, text: str):
    temporary = path.with_name(f".{path.name}.tmp")
    with open(temporary, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)


def _fsync(path: Path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def link_tree(source: Path, target: Path):
    """Copy a checkpoint folder by hard links (instant, no extra disk) where the filesystem allows, else by copy."""
    target.mkdir(parents=True, exist_ok=True)
    for path in source.rglob("*"):
        destination = target / path.relative_to(source)
        if path.is_dir():
            destination.mkdir(exist_ok=True)
            continue
        try:
            os.link(path, destination)
        except OSError:
            shutil.copy2(path, destination)
