"""The launcher and its ranks, owned by the labs process that started them.

- torchrun runs in a session of its own, told to take SIGTERM when labs dies (even by SIGKILL); each rank is told
  to die with torchrun (labs.rank). So no rank outlives the run.
- SIGINT (Ctrl-C) and SIGTERM to labs stop torchrun, which stops its ranks; after a grace period the rest is killed.
- When a rank dies, torchrun stops the others; `failure_message` then names the rank that failed first and how:
  its Python traceback, the signal that killed it, or the kernel's OOM killer.

    python -m labs.supervisor TORCHRUN_ARGS...     # what labs runs: sets the parent-death signal, then execs
    with supervisor.own_tmpdir(env) as env: ...     # a stock torchrun or accelerate launch leaves no /tmp tree
    supervisor.run_captured(command, env, timeout)  # a stock launch to its end; a timeout or Ctrl-C ends all of it
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from labs.errors import RunStopped

GRACE_S = 10          # torchrun's time to stop its ranks before everything left is killed
PR_SET_PDEATHSIG = 1  # linux/prctl.h
PR_SET_NAME = 15


def _prctl(option: int, value):
    """prctl(2) on Linux; elsewhere a no-op."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(option, value)


def die_with_parent(sig: int):
    """Ask the kernel to send `sig` to this process when its parent dies (Linux; elsewhere a no-op)."""
    _prctl(PR_SET_PDEATHSIG, int(sig))


def name_process(name: str):
    """Set this process's name as top, ps -o comm and /proc/PID/comm show it (at most 15 bytes; Linux, else a no-op):
    a forked rank's command line is its launcher's, so the name is what tells them apart."""
    _prctl(PR_SET_NAME, name.encode()[:15])


def run(command: list[str], env: dict, log_path: Path, echo: bool, start=None) -> int:
    """Run the launcher `command`, copying its output (rank 0's progress included) to our stdout and a log;
    returns its exit code. Interrupted, it stops the whole run before the exception goes on. `start(command, env)`,
    if given, starts the launcher instead of a new interpreter (labs.prefork) and returns a Popen look-alike."""
    with open(log_path, "wb") as log, _signals_raise():
        process = (start or _start)(command, env)
        try:
            while chunk := process.stdout.read1(4096):
                log.write(chunk)
                if echo:
                    sys.stdout.write(chunk.decode("utf-8", "replace"))
                    sys.stdout.flush()
            return process.wait()
        except BaseException:
            stop(process)
            raise


def launcher(command: list[str]) -> list[str]:
    """`command` run through this module: the launcher takes SIGTERM when the process that started it dies, even by
    SIGKILL (a kernel restarted mid-cell), so it stops its ranks instead of running on unowned."""
    return [sys.executable, "-m", "labs.supervisor", *command]


def _start(command: list[str], env: dict) -> subprocess.Popen:
    return subprocess.Popen(launcher(command), env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)


def stop(process: subprocess.Popen):
    """SIGTERM to the launcher's session, on which torchrun stops its ranks; after the grace period, or at once on a
    second Ctrl-C, SIGKILL to the session and to every process that was below the launcher when it was stopped.
    labs' ranks die with their launcher anyway (their parent-death signal); a stock launcher's ranks have none, and
    torchrun starts each in a session of its own, so they would outlive a launcher killed before it stopped them. A
    launcher whose output this process captures (run_captured) has its pipes drained meanwhile: one blocked on a
    full pipe would not exit. Nothing to a launcher that already exited: its pid may be another's."""
    if process.poll() is not None:
        return
    below = _processes_below(process.pid)
    _signal_session(process, signal.SIGTERM)
    try:
        _wait_draining(process, GRACE_S)
    except subprocess.TimeoutExpired:
        pass
    finally:
        _signal_session(process, signal.SIGKILL)
        for pid, started in below.items():
            _kill_if_same(pid, started)
        with contextlib.suppress(subprocess.TimeoutExpired):
            _wait_draining(process, GRACE_S)     # not for ever: a process started after `below` may hold a pipe


def _wait_draining(process, seconds):
    """process.wait(seconds), reading meanwhile whatever the launcher still writes into pipes this process holds."""
    pipes = [f for f in (getattr(process, "stdout", None), getattr(process, "stderr", None)) if f and not f.closed]
    if pipes and isinstance(process, subprocess.Popen):
        process.communicate(timeout=seconds)
    else:
        process.wait(seconds)


@contextlib.contextmanager
def _signals_raise():
    """SIGTERM and SIGHUP raise RunStopped (SIGINT already raises KeyboardInterrupt), where handlers can be set."""
    def handler(signum, frame):
        raise RunStopped(signum)

    with signals_handled((signal.SIGTERM, signal.SIGHUP), handler):
        yield


@contextlib.contextmanager
def signals_handled(signals, handler):
    """`handler` for each of `signals` inside the block, the previous handlers after it; in the main thread only (no
    other thread may set one: elsewhere the block runs as it is)."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, handler) for sig in signals}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


# ---------------------------------------------------------------------------------------------- diagnosis
_FAILURE = re.compile(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*:\s*(-?\d+) \(pid: \d+\)")


def failure_message(work: Path, code: int, oom_kills_before: int | None) -> str:
    """One line naming the rank that failed first and how, then its traceback if it left one."""
    log = (work / "launch.log").read_bytes().decode("utf-8", "replace")
    failures = {int(rank): int(exit_code) for rank, exit_code in _FAILURE.findall(log)}
    errors = {int(p.stem[4:]): p for p in work.glob("rank*.err") if p.stem[4:].isdigit()}
    # A rank killed by a signal (other than the SIGTERM torchrun sends the rest) is a cause; an exception in a
    # rank whose peer vanished is usually a consequence. Among exceptions, the earliest written is the first.
    killed = sorted(r for r, c in failures.items() if c < 0 and -c != signal.SIGTERM)
    oom_now = oom_kills()
    oom_struck = oom_kills_before is not None and oom_now is not None and oom_now > oom_kills_before
    if killed:
        rank, sig = killed[0], -failures[killed[0]]
        how = f"was killed by signal {sig} ({signal.Signals(sig).name})"
        if sig == signal.SIGKILL and oom_struck:
            how += (f": the kernel's OOM killer (this machine's oom_kill count went {oom_kills_before} -> {oom_now});"
                    " the run needs more memory than there is (check `labs memory`)")
        return f"rank {rank} {how} (launcher exit code {code})"
    if errors:
        rank = min(errors, key=lambda r: errors[r].stat().st_mtime)
        trace = errors[rank].read_text()
        last = next((line for line in reversed(trace.strip().splitlines()) if line.strip()), "")
        # A process of the rank's own (ZenFlow's optimizer process, a data worker) that the OOM killer ended leaves
        # no traceback; the rank only finds it gone (round 16's ZenFlow runs, results/gpu/zenflow_finetune_1xh200).
        if oom_struck:
            last += (f"; meanwhile the kernel's OOM killer ended {oom_now - oom_kills_before} process(es) here "
                     f"(oom_kill {oom_kills_before} -> {oom_now}): a helper process of the rank may have run out of "
                     "host memory")
        return f"rank {rank} failed: {last} (launcher exit code {code})\n{trace}"
    if failures:
        rank = min(failures)
        return f"rank {rank} exited with code {failures[rank]} (launcher exit code {code})"
    # The launcher's own error, if it raised one (DeepSpeed's runner: a host not reachable by ssh), on the first line
    raised = re.findall(r"(?m)^((?:\w+\.)*\w+(?:Error|Exception): .+)$", log)     # dotted: torch.distributed.X
    said = f": {raised[-1].strip()}" if raised else ""
    return (f"the launcher exited with code {code} before any rank reported an error{said}; its output ended:\n"
            f"{log[-4000:]}")


def oom_kills() -> int | None:
    """How many processes the kernel's OOM killer has killed in this machine's (cgroup v2) memory domain, else on the
    whole host (/proc/vmstat, which a container without its own memory.events still reads); None where neither is."""
    for path in ("/sys/fs/cgroup/memory.events", "/proc/vmstat"):
        with contextlib.suppress(OSError, ValueError):
            for line in Path(path).read_text().splitlines():
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
    return None


@contextlib.contextmanager
def own_tmpdir(env: dict):
    """`env` with a TMPDIR of its own for a stock launcher and its ranks. Left alone, torchrun makes a
    /tmp/torchelastic_* tree at every launch and never removes it (so does accelerate launch where it hands over to
    torchrun: several processes, or DeepSpeed on one host), as chapter 8's routes and chapters 3 and 6's launcher
    probes did. labs' own launches pass --log-dir into the run folder instead (labs.multinode.TORCHRUN_LOGS). The
    folder is made here, inside the caller's TMPDIR if it names one, and removed when the block ends, with what the
    launch wrote into it and nothing else."""
    folder = tempfile.mkdtemp(prefix="labs-launch-", dir=env.get("TMPDIR"))
    try:
        yield dict(env, TMPDIR=folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def run_captured(command: list[str], env: dict, timeout: float, cwd=None) -> subprocess.CompletedProcess:
    """subprocess.run(command, capture_output=True, text=True, timeout=timeout) for a stock launcher (torchrun,
    DeepSpeed's, accelerate launch) that leaves nothing behind: a TMPDIR of its own (own_tmpdir), a session of its
    own, SIGTERM when this process dies (as `python -m labs.supervisor` gives labs' own launchers), and on a timeout
    or an interrupt `stop`. subprocess.run would send SIGKILL to the launcher alone there, and torchrun's ranks, each
    in a session of its own, ran on (measured: `torchrun --nproc-per-node=2 --no-python sleep ...` past its timeout
    left both sleeps). The TimeoutExpired raised carries the output up to the timeout."""
    with own_tmpdir(env) as launch_env:
        process = subprocess.Popen(launcher(command), env=launch_env, cwd=cwd,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            out, err = process.communicate(timeout=timeout)
        except BaseException:
            stop(process)
            raise
    return subprocess.CompletedProcess(command, process.returncode, out, err)


def _signal_session(process: subprocess.Popen, sig: int):
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)


def stat_fields(pid) -> list[str]:
    """/proc/PID/stat's fields after the process name (which may hold ")"): [0] its state, [1] its parent's pid,
    [19] its start time. Raises OSError where the process is gone (or off Linux)."""
    return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()


def _processes_below(pid: int) -> dict[int, str]:
    """The processes below `pid` now: {pid: its start time, which tells it from a later process given the same pid}
    (Linux's /proc; elsewhere none)."""
    table = {}
    for entry in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat_fields(entry.parent.name)
            table[int(entry.parent.name)] = (int(fields[1]), fields[19])
    found, above = {}, {pid}
    while above:
        above = {child for child, (parent, _) in table.items() if parent in above}
        found.update((child, table[child][1]) for child in above)
    return found


def _kill_if_same(pid: int, started: str):
    """SIGKILL to `pid` if it is still the process that started at `started`."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        if stat_fields(pid)[19] == started:
            os.kill(pid, signal.SIGKILL)

if __name__ == "__main__":
    # The launcher's own process: take SIGTERM when labs dies, then become the launcher (exec keeps that setting).
    die_with_parent(signal.SIGTERM)
    if os.getppid() == 1:
        sys.exit("labs.supervisor: labs exited before the launcher started")
    os.execv(sys.argv[1], sys.argv[1:])
