import gc
import os
import subprocess
import sys
from pathlib import Path

import pytest

from labs import launch, prefork

ROOT = Path(__file__).resolve().parent.parent


def pytest_collection_finish(session):
    """Every test module is imported now, and with them torch, DeepSpeed and transformers: move those objects out of
    the garbage collector's reach (as labs.rank does), so its full passes during the tests stop walking them again
    and again. tests/test_memory.py with five other in-process files: 24.7 s before, 20.6 s after (2-core VM)."""
    gc.freeze()


def unquoted(path, figures) -> list[str]:
    """The figures a text file (a README) does not state, its line breaks and indents read as single spaces."""
    text = " ".join(Path(path).read_text().split())
    return [figure for figure in figures if figure not in text]


def l_s_l_s_text(found_round: dict) -> str:
    """How a round folder's README states a round that ran labs' row and stock's best twice each (rounds 41 and 42):
    both speeds and optimizer steps per side, and labs' slower run over stock's faster."""
    runs = {r["run"]: r for r in found_round["labs"] + found_round["stock"]}
    speeds = lambda a, b: f"{runs[a]['tokens_per_s']:,.0f} and {runs[b]['tokens_per_s']:,.0f}"
    steps = lambda a, b: f"{runs[a]['optimizer_step_s']:.2f} and {runs[b]['optimizer_step_s']:.2f} s"
    return (f"labs {speeds('labs_copy', 'labs_copy_again')} tokens/s (optimizer step "
            f"{steps('labs_copy', 'labs_copy_again')}), stock {speeds('stock61_sg2', 'stock61_sg2_again')} "
            f"({steps('stock61_sg2', 'stock61_sg2_again')}): labs' slower run over stock's faster, "
            f"{found_round['ratio']:.2f}x")


def interruptible(command: list[str]) -> list[str]:
    """`command`, started with SIGINT's default action restored, for a process a test sends SIGINT (Ctrl-C). A shell
    that ignores SIGINT (a non-interactive shell's background job: `cmd &`) passes SIG_IGN on to every child, and
    Python then installs no KeyboardInterrupt handler, so the SIGINT would do nothing. A small exec, not
    preexec_fn: that is unsafe in a test process with threads."""
    restore = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
               "os.execv(sys.argv[1], sys.argv[1:])")
    return [sys.executable, "-c", restore, *map(str, command)]


def run_labs(*args, cwd=None, timeout=600):
    """`python -m labs ...` as a user would type it; returns the CompletedProcess. Its CPU runs fork their launchers
    from this test process's warm server (labs.prefork), as a notebook's runs do from the kernel's."""
    env = labs_env("parent's")
    return subprocess.run([sys.executable, "-m", "labs", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd or ROOT, env=env, timeout=timeout)


@pytest.fixture(scope="session", autouse=True)
def checkout_left_as_it_was():
    """Tests write only under pytest's temporary folders, never into the course checkout (runs/, results/ ...)."""
    def snapshot():
        return {p for folder in ("runs", "results", "ds_configs", "notebooks") for p in (ROOT / folder).rglob("*")}

    before = snapshot()
    yield
    added = sorted(str(p.relative_to(ROOT)) for p in snapshot() - before)
    assert not added, f"tests wrote into the checkout: {added[:10]}"


@pytest.fixture(scope="session")
def zero3_run(tmp_path_factory):
    """The foundation's end-to-end run: tiny preset, ZeRO-3, 2 CPU ranks, 30 steps (shared by tests)."""
    out = tmp_path_factory.mktemp("e2e") / "zero3"
    result = run_labs("train", "--preset", "tiny", "--config", ROOT / "ds_configs/zero3.json", "--steps", 30,
                      "--out", out, "--quiet")
    assert result.returncode == 0, result.stderr[-4000:]
    return out, result


def labs_env(server: str, **extra) -> dict:
    """The environment for a `labs` process a test starts. server "parent's": its CPU runs fork their launchers from
    this test process's warm server (started here if need be), as a notebook's `labs train` does from the kernel's;
    "own": it starts a server of its own, as from a terminal, so all its processes descend from it."""
    if server == "parent's":
        launch.warm_for_children()          # names the server in os.environ: read after it
    env = dict(os.environ, PYTHONPATH=str(ROOT), **extra)
    if server == "own":
        env.pop(prefork.SERVER_ENV, None)
    return env


def parent_pid(pid: int) -> int:
    return int(open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()[1])   # after the name, which may hold ")"


def descendants(pid: int) -> list[int]:
    """The processes below `pid`, now (a CPU run's launcher and ranks show their warm server's command line, and a
    forked rank its launcher's environment: descent tells them apart; labs.supervisor.name_process names a rank)."""
    parents = {}
    for child in filter(str.isdigit, os.listdir("/proc")):
        try:
            parents[int(child)] = parent_pid(int(child))
        except (OSError, ValueError, IndexError):
            continue
    found, todo = [], [pid]
    while todo:
        above = todo.pop()
        below = [child for child, parent in parents.items() if parent == above]
        found += below
        todo += below
    return found


def still_running(pids) -> list[int]:
    """Those of `pids` that still run (zombies excluded: labs.prefork._exists)."""
    return [pid for pid in pids if prefork._exists(pid)]


def processes_naming(text: str) -> dict[int, str]:
    """Every process (but this one) whose command line contains `text`: pid -> command line."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline and int(pid) != os.getpid():
            found[int(pid)] = cmdline
    return found

