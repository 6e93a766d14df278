"""The launcher owns its ranks: Ctrl-C, SIGTERM, SIGKILL of labs and the death of a rank stop every process of the
run within seconds, keep no partial folder (SIGKILL cannot clean up; the next run at that path does), and say
which rank died and how. Real 2-rank launches of the tiny preset, stopped a few steps in."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, descendants, interruptible, labs_env, parent_pid, processes_naming, still_running

from labs import launch, prefork, supervisor

STOP_WITHIN_S = 15


def _rank_pid(processes, rank: int) -> int:
    """A rank names itself (labs.supervisor.name_process): forked, it has its launcher's command line and
    environment block, so neither tells the ranks apart."""
    for pid in processes:
        try:
            if open(f"/proc/{pid}/comm").read().strip() == f"labs rank {rank}":
                return pid
        except OSError:
            continue
    raise AssertionError(f"rank {rank} not found")


def _start(out, server):
    """`labs train` for many steps; returns the process, its working folder and every process started for it, once
    its ranks are training (the first step logged). server "parent's": it forks its launcher from this test
    process's warm server, as a notebook cell's `labs train` or a test's does; "own": it starts its own, as from a
    terminal. Either way its processes descend from this one and are new: the launcher and the ranks, and with
    "own" its server."""
    env = labs_env(server)
    before = set(descendants(os.getpid()))
    command = interruptible([sys.executable, "-m", "labs", "train", "--steps", "500", "--out", out, "--quiet"])
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 240
        while time.time() < deadline:
            logs = list(out.parent.glob(f".{out.name}.partial-*/metrics.jsonl"))
            if logs and logs[0].read_text().strip():
                below = [pid for pid in descendants(os.getpid()) if pid not in before]
                assert _rank_pid(below, 0) and _rank_pid(below, 1)
                launcher = parent_pid(_rank_pid(below, 0))
                if server == "own":
                    assert parent_pid(launcher) in below, (launcher, below)
                else:
                    assert parent_pid(launcher) in {s.pid for s in prefork._servers.values()}, (launcher, below)
                return process, logs[0].parent, below
            assert process.poll() is None, process.communicate()
            time.sleep(0.5)
        raise AssertionError("the run did not start training within 240 s")
    except BaseException:
        process.kill()              # its run stops with it (the case under test in test_sigkill_of_labs...)
        raise


def _stopped(process, below) -> tuple[int, str, float]:
    start = time.time()
    try:
        _, err = process.communicate(timeout=STOP_WITHIN_S + 30)
    except subprocess.TimeoutExpired:
        process.kill()
        raise
    while still_running(below) and time.time() - start < STOP_WITHIN_S:
        time.sleep(0.2)
    assert not still_running(below), f"left: {[open(f'/proc/{p}/comm').read() for p in still_running(below)]}"
    return process.returncode, err, time.time() - start


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_interrupt_stops_every_process_and_keeps_nothing(tmp_path, sig, code):
    out = tmp_path / "run"
    process, work, below = _start(out, "parent's")
    if sig == signal.SIGINT:        # while it runs, a second run on the same --out is refused at once
        second = subprocess.run([sys.executable, "-m", "labs", "train", "--steps", "2", "--out", str(out)], cwd=ROOT,
                                env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True,
                                timeout=120)
        assert second.returncode == 2 and "is being written by another labs process" in second.stderr, second.stderr
    process.send_signal(sig)
    returncode, err, seconds = _stopped(process, below)
    assert returncode == code and seconds < STOP_WITHIN_S, (returncode, err, seconds)
    assert "every process of the run was stopped" in err.strip().splitlines()[-1]
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "a partial folder, lock or run folder was left"


def test_a_dead_rank_stops_the_run_and_is_named(tmp_path):
    out = tmp_path / "run"
    process, work, below = _start(out, "parent's")
    os.kill(_rank_pid(below, 0), signal.SIGKILL)
    returncode, err, seconds = _stopped(process, below)
    first = err.strip().splitlines()[0]
    assert returncode == 1 and first.startswith("labs: rank 0 was killed by signal 9 (SIGKILL)"), err
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.parametrize("server", ["own", "parent's"])
def test_sigkill_of_labs_takes_the_ranks_with_it(tmp_path, server):
    """Its own server exits with it (its stdin closes) and the launcher takes its parent-death signal; a parent's
    server sees it exit (labs.prefork_server) and sends the launcher the same."""
    out = tmp_path / "run"
    process, work, below = _start(out, server)
    process.kill()
    returncode, _, seconds = _stopped(process, below)
    assert returncode == -signal.SIGKILL and seconds < STOP_WITHIN_S
    assert work.exists()          # nobody was left to clean up: the next run at this --out removes it (see
    #                               test_reliability.py::test_publish_replaces_an_earlier_run_and_clears_stale_partials)


def test_a_rank_that_raised_while_the_oom_killer_struck_is_told_so(tmp_path, monkeypatch):
    """A rank whose helper process (ZenFlow's optimizer process) the kernel's OOM killer ended raises without an OOM
    in its own traceback: the failure line names the rank's error and adds that the machine's oom_kill count rose
    meanwhile, and says nothing of memory when it did not."""
    from labs import supervisor
    (tmp_path / "launch.log").write_text("")
    (tmp_path / "rank0.err").write_text("Traceback (most recent call last):\n  ...\n"
                                         "RuntimeError: ZenFlow optimizer process exited during a step\n")
    monkeypatch.setattr(supervisor, "oom_kills", lambda: 3)
    line = supervisor.failure_message(tmp_path, 1, 2).splitlines()[0]
    assert line.startswith("rank 0 failed: RuntimeError: ZenFlow optimizer process exited during a step; meanwhile "
                           "the kernel's OOM killer ended 1 process(es) here (oom_kill 2 -> 3)"), line
    assert line.endswith("(launcher exit code 1)")
    for before in (3, None):
        assert "OOM" not in supervisor.failure_message(tmp_path, 1, before).splitlines()[0]


def test_oom_kills_reads_a_count_where_the_kernel_gives_one():
    from labs import supervisor
    count = supervisor.oom_kills()
    if os.path.exists("/proc/vmstat") and "oom_kill " in open("/proc/vmstat").read():
        assert isinstance(count, int) and count >= 0


def test_forked_ranks_report_a_killed_rank_that_the_agent_did_not(tmp_path, capsys):
    """A forked group reports one failure: when rank 0's broken collective is found before rank 1's SIGKILL,
    labs.fork_launcher prints rank 1's exit in torchrun's words, and labs names rank 1 and its signal."""
    import gc
    from types import SimpleNamespace

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    collecting = gc.isenabled()
    from labs import fork_launcher, supervisor      # imports labs.rank, which turns the collector off (see there)
    if collecting:
        gc.enable()

    group = SimpleNamespace(processes=[SimpleNamespace(exitcode=1, pid=101), SimpleNamespace(exitcode=-9, pid=102),
                                       SimpleNamespace(exitcode=-15, pid=103)])
    fork_launcher._started.append(group)
    try:
        failed = ChildFailedError("forked", {4: ProcessFailure(local_rank=0, pid=101, exitcode=1, error_file="")})
        fork_launcher.report_other_failures(failed)
    finally:
        fork_launcher._started.remove(group)
    printed = capsys.readouterr().err
    assert "rank      : 5 (local_rank: 1)" in printed and "pid: 103" not in printed    # SIGTERM: the agent's own
    (tmp_path / "launch.log").write_text("rank : 4 (local_rank: 0)\n  exitcode : 1 (pid: 101)\n" + printed)
    assert supervisor.failure_message(tmp_path, 1, None).startswith("rank 5 was killed by signal 9 (SIGKILL)")


def test_cpu_ranks_start_through_the_fork_launcher_whose_agent_it_can_watch(tmp_path):
    """CPU ranks: labs.fork_launcher; GPU ranks: torchrun itself. The launcher reads every forked rank's exit code
    from the process group torch's agent starts through torch.multiprocessing.start_processes (fork_launcher._keep):
    if torch starts them some other way, report_other_failures would go quiet, so this fails first."""
    import inspect

    import torch.distributed.elastic.multiprocessing.api as elastic_api
    import torch.multiprocessing

    from labs import launch

    assert launch.launcher_command(2, tmp_path, cpu=True)[1:3] == ["-m", "labs.fork_launcher"]
    assert launch.launcher_command(2, tmp_path)[1:3] == ["-m", "torch.distributed.run"]
    assert elastic_api.mp is torch.multiprocessing
    assert "mp.start_processes(" in inspect.getsource(elastic_api.MultiprocessContext._start)


def test_a_stock_torchrun_leaves_no_tree_in_the_callers_tmpdir(tmp_path, monkeypatch):
    """torchrun left alone makes a torchelastic_* tree in TMPDIR at every launch and never removes it (chapter 8's
    routes and the launcher probes left them in /tmp). Under supervisor.own_tmpdir the launch gets a folder of its own
    inside the caller's TMPDIR, removed afterwards, also when the block raises: the caller's TMPDIR ends empty."""
    from labs.course import offload

    callers = tmp_path / "tmp"
    callers.mkdir()
    monkeypatch.setenv("TMPDIR", str(callers))       # what the launcher would inherit without own_tmpdir
    assert offload.launcher_threads(["torchrun, 1 process"]) == {"torchrun, 1 process": [None]}
    assert list(callers.iterdir()) == []
    with pytest.raises(KeyboardInterrupt), supervisor.own_tmpdir({"TMPDIR": str(callers), "A": "1"}) as env:
        assert Path(env["TMPDIR"]).parent == callers and env["A"] == "1"
        raise KeyboardInterrupt
    assert list(callers.iterdir()) == []


def test_a_stopped_stock_launch_takes_ranks_that_ignore_sigterm_with_it(tmp_path, monkeypatch):
    """subprocess.run(..., timeout=) sends SIGKILL to the launcher alone, and torchrun starts each rank in a session
    of its own: the ranks ran on. supervisor.stop, which run_captured calls on a timeout or an interrupt (chapter 3's
    launcher probes, chapter 6's hang probes, the tutorials' accelerate check) and labs' own runs on an interrupt,
    ends them too, even ranks that ignore torchrun's SIGTERM, within about two grace periods."""
    monkeypatch.setattr(supervisor, "GRACE_S", 1)
    seconds = f"{600 + os.getpid() % 1000}.5"          # a sleep no other process of this machine runs
    rank_command = f'trap "" TERM; touch "{tmp_path}/rank$RANK"; exec sleep {seconds}'
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--no-python",
               "sh", "-c", rank_command]
    # as run_captured starts it: its own TMPDIR, parent-death signal, a session of its own, output in pipes
    with supervisor.own_tmpdir(dict(os.environ)) as env:
        process = subprocess.Popen([sys.executable, "-m", "labs.supervisor", *command], env=env,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        deadline = time.monotonic() + 120
        while len(list(tmp_path.iterdir())) < 2:
            assert process.poll() is None and time.monotonic() < deadline, process.communicate()
            time.sleep(0.1)
        start = time.monotonic()
        supervisor.stop(process)
        assert time.monotonic() - start < 10 and process.poll() is not None
    left = processes_naming(f"sleep {seconds}")
    assert not left, f"ranks outlived their launcher: {left}"


def test_a_stock_launch_through_the_supervisor_stops_when_its_starter_is_killed(tmp_path):
    """A notebook kernel killed mid-cell (a restart) cannot stop what it started. A stock launch started through
    supervisor.launcher (chapter 6's stuck ranks, run_captured's launches) takes SIGTERM then, from the parent-death
    signal, and torchrun stops its ranks; started directly, torchrun and its ranks ran on unowned."""
    seconds = f"{700 + os.getpid() % 1000}.25"          # a sleep no other process of this machine runs
    rank_command = f'touch "{tmp_path}/rank$RANK"; exec sleep {seconds}'
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--no-python",
               "sh", "-c", rank_command]
    starter = ("import subprocess, sys; from labs import supervisor; "
               f"subprocess.Popen(supervisor.launcher({command!r}), start_new_session=True).wait()")
    with supervisor.own_tmpdir(dict(os.environ)) as env:
        process = subprocess.Popen([sys.executable, "-c", starter], cwd=ROOT, env=env)
        deadline = time.monotonic() + 120
        while len(list(tmp_path.iterdir())) < 2:
            assert process.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        process.kill()
        process.wait()
        deadline = time.monotonic() + STOP_WITHIN_S
        while processes_naming(f"sleep {seconds}") and time.monotonic() < deadline:
            time.sleep(0.2)
    left = processes_naming(f"sleep {seconds}")
    assert not left, f"the launch outlived the process that started it: {left}"


CONSOLE_SCRIPT = "from labs.__main__ import run; sys.exit(run())"        # what pip's `labs` script runs
PYTHON_M = "import runpy; runpy.run_module('labs', run_name='__main__', alter_sys=True)"      # python -m labs


@pytest.mark.parametrize("entry", [PYTHON_M, CONSOLE_SCRIPT])
def test_ctrl_c_while_labs_starts_is_one_line_and_exit_130(entry):
    """labs imports torch before anything starts (1-3 s): a Ctrl-C then reads like any other, one line and exit code
    130, not a traceback. The Ctrl-C comes as the import of torch begins (an import hook sends it)."""
    hook = ("import os, signal, sys\n"
            "class CtrlC:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name == 'torch':\n"
            "            sys.meta_path.remove(self)\n"
            "            os.kill(os.getpid(), signal.SIGINT)\n"
            "sys.meta_path.insert(0, CtrlC())\n"
            "sys.argv = ['labs', 'env']\n")
    done = subprocess.run(interruptible([sys.executable, "-c", hook + entry]), cwd=ROOT, capture_output=True,
                          text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=60)
    assert (done.returncode, done.stderr, done.stdout) == (130, "labs: interrupted while starting: nothing was "
                                                               "started\n", "")


def test_ctrl_c_in_a_command_that_starts_no_run_says_nothing_was_started():
    """`labs env` interrupted during its probes (they compile test programs) exits 130 with one line that does not
    speak of a run's processes or folder, which it has none of. The Ctrl-C comes as the probes begin."""
    script = ("import os, signal, sys\n"
              "import labs.env\n"
              "probe = labs.env._deepspeed_ops\n"
              "labs.env._deepspeed_ops = lambda: (os.kill(os.getpid(), signal.SIGINT), probe())[1]\n"
              "from labs.cli import main\n"
              "sys.exit(main(['env']))\n")
    done = subprocess.run(interruptible([sys.executable, "-c", script]), cwd=ROOT, capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=60)
    assert (done.returncode, done.stderr, done.stdout) == (130, "labs: interrupted: nothing was started or written\n",
                                                           "")


def test_a_forked_rank_needs_no_host_name_lookup():
    """A rank forked from the multi-threaded agent must not call getaddrinfo on a name (an inherited, locked resolver
    lock hangs it): the rendezvous store's address is made numeric, and on one host gloo uses the loopback interface.
    Across hosts gloo keeps resolving (the loopback would not reach them), and a user's interface is kept."""
    from labs import rank

    one_host = {"MASTER_ADDR": "localhost", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"}
    assert rank.no_name_lookups(one_host) == {"MASTER_ADDR": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo"}
    assert rank.no_name_lookups({**one_host, "GLOO_SOCKET_IFNAME": "eth1"}) == {"MASTER_ADDR": "127.0.0.1"}
    named = {**one_host, "MASTER_ADDR": "trainer-17.example.org"}      # --standalone: this machine's own name
    assert rank.no_name_lookups(named) == {"MASTER_ADDR": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo"}
    emulated = {"MASTER_ADDR": "127.0.0.1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}   # chapter 6's nodes
    assert rank.no_name_lookups(emulated) == {"GLOO_SOCKET_IFNAME": "lo"}
    two_hosts = {"MASTER_ADDR": "node0", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}
    assert rank.no_name_lookups(two_hosts) == {}
