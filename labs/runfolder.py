"""A run folder: everything about one training run in one place, and how it comes into being.

    run = Run("runs/demo")
    run.spec, run.ds_config, run.metrics, run.summary, run.losses

What a finished folder holds: run.json (the resolved inputs), ds_config.json (the resolved DeepSpeed config),
command.txt, environment.json, launch.log, metrics.jsonl (one line per optimizer step) and summary.json.
labs.launch writes it as a hidden `.NAME.partial` folder beside the target and renames it into place only when
every rank has finished, so a crashed run never looks like a finished one.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from labs import metrics


@dataclass
class Run:
    """A finished run folder: its inputs, per-step metrics and summary."""
    path: Path

    def __post_init__(self):
        self.path = Path(self.path)

    @property
    def metrics(self) -> list[dict]:
        return metrics.read_jsonl(self.path / "metrics.jsonl")

    @property
    def summary(self) -> dict:
        return json.loads((self.path / "summary.json").read_text())

    @property
    def spec(self) -> dict:
        return json.loads((self.path / "run.json").read_text())

    @property
    def ds_config(self) -> dict:
        return json.loads((self.path / "ds_config.json").read_text())

    @property
    def losses(self) -> list[float]:
        return [m["loss"] for m in self.metrics]


def partial_folder(out: Path) -> Path:
    """A fresh working folder beside `out`, where the ranks write until the run is done."""
    work = (out.parent / f".{out.name}.partial").resolve()
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    return work


def publish(work: Path, out: Path):
    """Swap the finished folder into place; an older run at the same path goes only now."""
    old = out.parent / f".{out.name}.old"
    shutil.rmtree(old, ignore_errors=True)
    if out.exists():
        out.rename(old)
    work.rename(out)
    shutil.rmtree(old, ignore_errors=True)


def discard(work: Path):
    """Remove a working folder this run made (after a failure)."""
    shutil.rmtree(work, ignore_errors=True)
