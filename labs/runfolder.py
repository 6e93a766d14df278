"""A run folder: everything about one training run in one place, and how it comes into being safely.

    run = Run("runs/demo")
    run.spec, run.ds_config, run.metrics, run.summary, run.losses

A finished folder holds run.json (the resolved inputs), ds_config.json (the resolved DeepSpeed config),
command.txt, environment.json, launch.log, metrics.jsonl (one line per optimizer step), summary.json, and the
marker `.labs-run` that says labs wrote it; with --save-every, checkpoints/ (labs.checkpoint). A run that failed
after saving a complete checkpoint is kept for --resume, marked by interrupted.json instead of summary.json
(labs.resume). The rules that keep a user's files safe:
- `--out` may name nothing yet, or a run folder labs wrote (it is replaced when the new run succeeds). Anything
  else (a file, a folder of other things) is refused before any rank starts.
- While a run works, it holds a lock beside the target (`.NAME.lock`): a second run with the same `--out` is told
  so at once. Its ranks write into a folder of its own (`.NAME.partial-PID`), renamed into place only when every
  rank has finished, so a crashed run never looks like a finished one.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from labs import metrics
from labs.errors import LabsError

MARKER = ".labs-run"
# What a labs run folder holds (folders written before the marker existed are recognised by these names alone).
KNOWN = {MARKER, "run.json", "ds_config.json", "command.txt", "environment.json", "launch.log", "metrics.jsonl",
         "summary.json", "checkpoints", "configs", "interrupted.json", "resumed.json", "probe_logits.pt"}


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
    def environment(self) -> dict:
        """What launch recorded of the ranks' environment (environment.json; {} in folders written before it)."""
        path = self.path / "environment.json"
        return json.loads(path.read_text()) if path.is_file() else {}

    @property
    def losses(self) -> list[float]:
        return [m["loss"] for m in self.metrics]

    @property
    def interrupted(self) -> dict | None:
        """Why and where a run that failed after saving a checkpoint stopped (labs.resume), else None."""
        path = self.path / "interrupted.json"
        return json.loads(path.read_text()) if path.is_file() else None


def is_run_folder(path: Path) -> bool:
    """Did labs write this folder? Its marker, or (older runs) only the names a run folder holds, with run.json."""
    if not path.is_dir():
        return False
    names = {p.name for p in path.iterdir()}
    return MARKER in names or ("run.json" in names and "command.txt" in names and
                               not {n for n in names if not n.startswith("rank")} - KNOWN)


def check_out(out: Path) -> None:
    """May a run write `out`? Nothing is written; a problem is one LabsError line."""
    out = Path(out)
    try:
        _check_out(out)
    except PermissionError as e:        # a folder on the way that this user may not enter: exists() raises
        raise LabsError(f"--out '{out}': cannot look there ({e.strerror}: '{e.filename}'); choose another --out") \
            from None


def _check_out(out: Path) -> None:
    if out.exists() or out.is_symlink():
        if not out.is_dir() or out.is_symlink():
            raise LabsError(f"--out '{out}' is an existing file; labs writes a run folder there only where nothing "
                            "is, or an earlier labs run folder: choose another --out")
        if not is_run_folder(out):
            raise LabsError(f"--out '{out}' is a folder labs did not write (no {MARKER} marker); labs replaces only "
                            "its own run folders: choose another --out, or empty it yourself")
    parent = nearest_existing(out.parent)   # it must let us create what is missing
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise LabsError(f"--out '{out}': cannot create it, '{parent}' is not a writable folder")
    if out.exists() and not os.access(out.parent, os.W_OK | os.X_OK):
        raise LabsError(f"--out '{out}': '{out.parent}' is not writable, so the old run cannot be replaced")


@contextlib.contextmanager
def claim(out: Path):
    """Hold `out` for one run: take its lock (or say who holds it), clear this path's stale partial folders that an
    earlier, killed labs process left (and put back an earlier run that one killed inside `publish` left hidden),
    and yield a fresh working folder. The working folder is removed on any
    failure; `publish` moves it into place on success. Call `check_out` first."""
    out = Path(out).absolute()
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise _unwritable(out, e) from None
    with lock(out.parent / f".{out.name}.lock", out):
        _recover(out)
        work = out.parent / f".{out.name}.partial-{os.getpid()}"
        try:
            work.mkdir()
        except FileExistsError:
            raise LabsError(f"--out '{out}': '{work}' is in the way and labs did not mark it as its own; remove it "
                            "or choose another --out") from None
        except OSError as e:
            raise _unwritable(out, e) from None
        try:
            (work / MARKER).write_text(json.dumps({"written_by": "labs", "pid": os.getpid(),
                                                   "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}) + "\n")
        except OSError as e:        # a full disk, a quota
            shutil.rmtree(work, ignore_errors=True)
            raise _unwritable(out, e) from None
        try:
            yield work
        finally:
            shutil.rmtree(work, ignore_errors=True)        # gone already if published


def nearest_existing(path: Path) -> Path:
    """`path`, or its nearest ancestor that exists: where a file or folder under `path` would first be created."""
    path = Path(path)
    while not path.exists():
        path = path.parent
    return path


def hidden(out: Path, kind: str, suffix: str = r"\d+") -> list[Path]:
    """The folders `.OUT.KIND-SUFFIX` beside `out` (a pid by default): exactly that shape, so another --out whose name
    starts with this one's (OUT.old-5, say) never matches."""
    shape = re.compile(rf"\.{re.escape(out.name)}\.{kind}-{suffix}")
    return sorted(p for p in out.parent.iterdir() if shape.fullmatch(p.name))


def _recover(out: Path):
    """Under the lock nothing of these names belongs to a live process: a killed one left them. A run killed between
    publish's two renames left its finished run (.OUT.partial-PID, with summary.json) and the earlier one
    (.OUT.old-PID): the swap is finished. Any other earlier run goes back where `out` is missing, or goes where a newer
    run took the place; marked partial folders go. Folders labs did not mark stay."""
    for earlier in hidden(out, "old"):
        if not is_run_folder(earlier):
            continue
        finished = out.parent / f".{out.name}.partial-{earlier.name.rsplit('-', 1)[1]}"
        if not out.exists() and (finished / MARKER).is_file() and (finished / "summary.json").is_file():
            finished.rename(out)
        elif not out.exists():
            earlier.rename(out)
            continue
        shutil.rmtree(earlier, ignore_errors=True)
    for stale in hidden(out, "partial"):
        if (stale / MARKER).is_file():
            shutil.rmtree(stale, ignore_errors=True)


def publish(work: Path, out: Path):
    """Swap the finished folder into place (under the lock); an earlier run at the same path goes only now."""
    out = Path(out).absolute()
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    if out.exists():
        check_out(out)                  # still a run folder of ours? (it was, before the run started)
        out.rename(old)
    work.rename(out)
    shutil.rmtree(old, ignore_errors=True)


def _unwritable(out: Path, error: OSError, option="--out") -> LabsError:
    # check_out's access() says yes to root everywhere; /proc, a read-only mount or a full disk still refuse
    return LabsError(f"{option} '{out}': cannot write there: '{out.parent}' refused a new file ({error.strerror}); "
                     f"choose another {_choice(option)}")


def _choice(option: str) -> str:
    """What the user is told to choose instead: the flag (--out), or a 'folder' for a positional argument."""
    return option if option.startswith("--") else "folder"


@contextlib.contextmanager
def lock(path: Path, out: Path, option="--out"):
    """An exclusive flock on `path`, for writing `out`, released when the block ends or the process dies (even by
    SIGKILL). A second labs process that wants `out` meanwhile gets one line naming `option` and the holder."""
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise _unwritable(out, e, option) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 200).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise LabsError(f"{option} '{out}' is being written by another labs process ({holder}); wait for it to "
                            f"finish or choose another {_choice(option)}") from None
        if os.path.exists(path) and os.stat(path).st_ino == os.fstat(fd).st_ino:
            break                      # the lock file we hold is still the one at that path
        os.close(fd)                   # it was removed and replaced between open and lock: try again
    try:
        try:
            os.ftruncate(fd, 0)
            os.write(fd, f"pid {os.getpid()}, since {time.strftime('%H:%M:%S')}".encode())
        except OSError as e:
            raise _unwritable(out, e, option) from None
        yield
    finally:
        os.unlink(path)
        os.close(fd)
