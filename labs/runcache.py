"""Reuse a finished run when the very same run was already launched in this test session (`make test` only).

`make test` sets LABS_RUN_CACHE to a fresh folder that lives as long as that one command: a run that the unit tests
launched (e.g. chapter 1's four 2-step stage runs, which tests/test_state_bytes.py also measures) is copied for the
notebook that asks for it again instead of being trained twice. Outside `make test` the variable is unset and every
call launches.

A run is the same when everything the ranks read is the same: the resolved spec (without its --out and the path of
its config file), the resolved DeepSpeed config, the environment variables that reach the ranks and change what they
do, the installed versions and the source of labs itself. `labs train` runs that read files other than labs' own
(--model-path, --data), resume, save checkpoints or span nodes are never reused. Chapter 8's routes (labs.course.routes)
are keyed the same way, with the contents of their DeepSpeed and accelerate files as `resolved`; a Trainer job that
saves a checkpoint and resumes from it within itself is reused whole.

    key = runcache.key(spec, resolved, env)       # None: this run is not reusable
    with runcache.held(key):                      # a second launch of the same run waits for the first
        runcache.restore(key, work, spec)         # True: `work` now holds the earlier run, with this run's run.json
                                                  # (spec_file="route.json" for a route)
        runcache.store(key, out)                  # after a run is published
    runcache.note(key, spec, reused, seconds)     # one line per launch in the folder's ledger (launches.jsonl)
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import json
import os
import shutil
import sys
from pathlib import Path

import torch

from labs import prefork

ENV = "LABS_RUN_CACHE"
NOTE = "reused.json"       # in a copied run folder: which earlier folder it came from
LEDGER = "launches.jsonl"  # in the cache folder: every launch of this `make test`, reused or trained
STORED_FROM = ".stored-from"   # in a stored run: the folder it was published to
# What the ranks read from their environment that changes what they compute (labs' own LABS_* fault injection too;
# accelerate's and Hugging Face's settings for chapter 8's routes).
RANK_ENV = ("OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "DS_ACCELERATOR", "TORCH_CUDA_ARCH_LIST")
RANK_ENV_PREFIXES = ("LABS_", "ACCELERATE_", "HF_", "TRANSFORMERS_")
_SOURCE = Path(__file__).resolve().parent


def folder() -> Path | None:
    value = os.environ.get(ENV)
    return Path(value) if value else None


def key(spec: dict, resolved: dict, env: dict) -> str | None:
    """The cache key of a run, or None when there is no cache or the run reads something the key cannot cover."""
    if folder() is None or any(spec.get(k) for k in ("model_path", "data", "resume", "nodes", "save_every")):
        return None
    ranks_env = {k: env.get(k) for k in sorted(env)
                 if k in RANK_ENV or (k.startswith(RANK_ENV_PREFIXES) and k not in (ENV, prefork.SERVER_ENV))}
    inputs = dict(spec={k: v for k, v in spec.items() if k not in ("out", "config", "progress")}, resolved=resolved,
                  env=ranks_env, python=sys.version, torch=torch.__version__, labs=_source_digest(),
                  **{name: _version(name) for name in ("deepspeed", "transformers", "accelerate")})
    return hashlib.sha256(json.dumps(inputs, sort_keys=True, default=str).encode()).hexdigest()[:24]


@contextlib.contextmanager
def held(key: str | None):
    """Hold the key's lock while the run is looked up, trained and stored: `make test` runs the unit tests and the
    notebooks side by side, and a chapter that asks for a run a test is training waits for it, then copies it,
    instead of training it a second time. The lock goes with the process that holds it, however it ends."""
    if key is None:
        yield
        return
    with open(folder() / f".{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def restore(key: str | None, work: Path, spec: dict, spec_file: str = "run.json") -> bool:
    """Fill the working folder with the stored run of this key, if there is one; its spec file (run.json, or a
    chapter 8 route's route.json) becomes this call's spec (the same but for paths). Returns whether it did."""
    stored = folder() / key if key else None
    if stored is None or not (stored / STORED_FROM).is_file():        # stored whole: see store()
        return False
    for path in stored.iterdir():
        if path.name not in (spec_file, ".labs-run", STORED_FROM):
            (shutil.copytree if path.is_dir() else shutil.copy2)(path, work / path.name)
    (work / spec_file).write_text(json.dumps(spec, indent=1) + "\n")
    original = (stored / STORED_FROM).read_text()
    (work / NOTE).write_text(json.dumps({"from": original, "why": f"the same run, launched earlier under {ENV}"})
                             + "\n")
    return True


def store(key: str | None, out: Path):
    """Keep a copy of a published run folder under its key (written aside, then renamed: never half a copy)."""
    if key is None or (folder() / key).exists():
        return
    partial = folder() / f".{key}.{os.getpid()}"
    shutil.copytree(out, partial, ignore=shutil.ignore_patterns(NOTE))
    (partial / STORED_FROM).write_text(str(out))
    try:
        partial.rename(folder() / key)
    except OSError:                     # another process stored the same run meanwhile
        shutil.rmtree(partial, ignore_errors=True)


def note(key: str | None, spec: dict, reused: bool, seconds: float):
    """Add a launch to the ledger (tools/launch_report.py sums it at the end of `make test`): what ran, whether it
    was a copy, how long it took. Appending one short line is atomic enough for processes that launch at once."""
    if folder() is None:
        return
    line = dict(key=key, reused=reused, seconds=round(seconds, 2), out=spec.get("out"),
                **{k: spec.get(k) for k in ("preset", "config", "steps", "nproc", "engine", "instruments", "nodes",
                                            "save_every", "resume", "activation_checkpointing", "precision")})
    with open(folder() / LEDGER, "a") as ledger:
        ledger.write(json.dumps(line, default=str) + "\n")


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _source_digest() -> str:
    digest = hashlib.sha256()
    for path in sorted(_SOURCE.rglob("*.py")):
        digest.update(str(path.relative_to(_SOURCE)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()
