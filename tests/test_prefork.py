"""labs.prefork: launchers forked from one warm server per labs process, each looking to labs like a new interpreter
(its output, exit code or signal, environment, working folder, process group and file descriptors), the server shared
by runs whose environments differ only in per-run variables and by that process's children, and every launcher
stopped when its server dies or its labs process exits. The real runs through it are every CPU run of the course;
test_run_control.py stops them with Ctrl-C, SIGTERM, SIGKILL and a dead rank, and finds no process of theirs left,
the server included."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import descendants, parent_pid

from labs import env as env_lib
from labs import prefork
from labs.course.multinode import free_port

LOGS: list[str] = []        # set by launcher_logs


@pytest.fixture(scope="module", autouse=True)
def launcher_logs(tmp_path_factory):
    """torchrun's log tree for every launcher these tests start (labs' own runs pass --log-dir into the run folder;
    without one, torchrun leaves a /tmp/torchelastic_* tree at each launch)."""
    global LOGS
    LOGS = [f"--log-dir={tmp_path_factory.mktemp('torchelastic')}"]


def _environment(**extra) -> dict:
    env, _ = env_lib.repaired_environment(2, cpu_offload=False)
    env["PYTHONPATH"] = env_lib.importable_path(env)
    env.update(env_lib.CPU_ONLY, **extra)
    return env


def _launch(args, env):
    process = prefork.start([sys.executable, *prefork.LAUNCHER, *LOGS, *args], env)
    return process, process.stdout.read().decode(), process.wait(timeout=120)


def _waiting_command() -> list[str]:
    """Node 0 of two, waiting for a node 1 that never comes: a launcher that stays until it is stopped."""
    return [sys.executable, *prefork.LAUNCHER, *LOGS, "--nnodes=2", "--node-rank=0", "--nproc-per-node=1",
            "--rdzv-backend=static", f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--rdzv-conf=timeout=120",
            "-m", "labs.rank", "unused"]


def _waiting_launcher(env):
    return prefork.start(_waiting_command(), env)


def test_a_launcher_gets_the_runs_output_pipe_exit_code_and_environment():
    # torchrun's own parser, in the forked launcher: an unknown option is exit code 2 and its message on stderr
    _, output, code = _launch(["--no-such-option", "-m", "labs.rank", "unused"], _environment())
    assert code == 2 and "fork_launcher.py: error: unrecognized arguments: --no-such-option" in output, output
    server = prefork._servers[prefork._key(_environment())]
    # torchrun warns when OMP_NUM_THREADS is unset for several ranks. The server runs with OMP_NUM_THREADS=1, so the
    # warning shows that the launcher reads the run's environment (the same server serves it: a per-run variable)
    without = {k: v for k, v in _environment().items() if k != "OMP_NUM_THREADS"}
    _, output, code = _launch(["--standalone", "--nproc_per_node=2", "-m", "labs.rank", "unused"], without)
    assert prefork._servers[prefork._key(without)] is server
    assert code == 1 and "Setting OMP_NUM_THREADS environment variable for each process to be 1" in output, output
    _, output, _ = _launch(["--standalone", "--nproc_per_node=2", "-m", "labs.rank", "unused"], _environment())
    assert "Setting OMP_NUM_THREADS" not in output


def test_one_idle_server_at_a_time_serves_runs_that_differ_only_in_per_run_variables():
    env = _environment()
    _launch(["--no-such-option"], env)
    server = prefork._servers[prefork._key(env)]
    _launch(["--no-such-option"], dict(env, OMP_NUM_THREADS="7", LOCAL_SIZE="3", PYTEST_CURRENT_TEST="another",
                                       LABS_TEST_KILL="rank0:save"))
    assert list(prefork._servers.values()) == [server]
    other = dict(env, PYTHONWARNINGS="ignore")        # read when an interpreter starts: a server of its own
    _launch(["--no-such-option"], other)
    assert list(prefork._servers) == [prefork._key(other)]
    assert server.process.wait(timeout=30) == 0       # the idle one was retired


def _links(pid: int) -> dict[int, str]:
    return {int(fd): os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}


def test_a_launcher_has_its_own_group_folder_and_descriptors_and_a_kill_reads_as_popen_would(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    first = _waiting_launcher(_environment())
    process = _waiting_launcher(_environment())         # forked while the first one runs, from the same server
    server = prefork._servers[prefork._key(_environment())].process.pid
    with pytest.raises(subprocess.TimeoutExpired):
        process.wait(timeout=0.5)
    assert process.poll() is None
    assert os.readlink(f"/proc/{process.pid}/cwd") == str(tmp_path)
    assert os.getpgid(process.pid) == process.pid != os.getpgid(0)
    fds = _links(process.pid)
    assert fds[0] == os.devnull and fds[1] == fds[2] == f"pipe:[{os.fstat(process.stdout.fileno()).st_ino}]"
    # nothing of the server's (its stdin from labs, its log, its socket to labs, the first run's status pipe) and
    # nothing of the first run's output pipe
    theirs = {link for fd, link in _links(server).items() if fd > 0} | {
        f"pipe:[{os.fstat(first.stdout.fileno()).st_ino}]", _links(server)[0]}
    assert not theirs & set(fds.values()), (fds, theirs)
    for launch in (first, process):
        os.killpg(launch.pid, signal.SIGKILL)
        assert launch.wait(timeout=60) == -signal.SIGKILL
        assert launch.poll() == -signal.SIGKILL


def test_when_the_server_dies_its_launchers_stop_and_labs_is_told(capfd):
    env = _environment(LABS_PREFORK_TEST="server death")
    process = _waiting_launcher(env)
    server = prefork._servers[prefork._key(env)]
    server.process.kill()
    assert process.wait(timeout=60) == -signal.SIGTERM     # what the launcher took: its parent-death signal
    deadline = time.time() + 10
    while os.path.exists(f"/proc/{process.pid}") and time.time() < deadline:
        time.sleep(0.1)
    assert not os.path.exists(f"/proc/{process.pid}")
    assert f"the warm server (pid {server.process.pid}) ended during the run" in capfd.readouterr().err
    _launch(["--no-such-option"], env)                     # the next run gets a new server
    assert prefork._servers[prefork._key(env)] is not server


def _gone(pid: int, within_s: float) -> bool:
    deadline = time.time() + within_s
    while prefork._exists(pid) and time.time() < deadline:
        time.sleep(0.1)
    return not prefork._exists(pid)


def test_an_interrupt_while_a_launcher_starts_stops_it(monkeypatch):
    """Ctrl-C after the server was asked but before labs heard the launcher's pid: labs learns it and stops it."""
    pids, read_pid = [], prefork.Launch.read_pid

    def interrupted(launch):
        if not pids:
            pids.append(None)
            raise KeyboardInterrupt
        read_pid(launch)
        pids.append(launch.pid)
    monkeypatch.setattr(prefork.Launch, "read_pid", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _waiting_launcher(_environment())
    assert pids[1] is not None and _gone(pids[1], 15)
    assert all(server.running == 0 for server in prefork._servers.values())


def test_a_server_with_a_running_launcher_is_not_retired():
    busy = _waiting_launcher(_environment())
    server = prefork._servers[prefork._key(_environment())]
    _launch(["--no-such-option"], _environment(PYTHONWARNINGS="ignore"))      # another server
    assert server.process.poll() is None and busy.poll() is None
    os.killpg(busy.pid, signal.SIGKILL)
    assert busy.wait(timeout=60) == -signal.SIGKILL


def _child(tmp_path, env, user=None) -> subprocess.Popen:
    """Another labs process, started by this one (as a test's or a notebook's `labs train` is): it asks for a waiting
    launcher with `env` and prints what it got, then sleeps. `user`: it becomes that user before it asks (root only)."""
    request = tmp_path / "request.json"
    request.write_text(json.dumps({"command": _waiting_command(), "env": env}))
    code = ("import json, os, sys, time\n"
            "from labs import prefork\n"
            "asked = json.load(open(sys.argv[1]))\n"
            "if len(sys.argv) > 2: os.setgid(int(sys.argv[2])); os.setuid(int(sys.argv[2]))\n"
            "try:\n"
            "    launch = prefork.start(asked['command'], asked['env'])\n"
            "    print(launch.pid, launch.server.pid, type(launch.server).__name__, flush=True)\n"
            "except RuntimeError as error:\n"
            "    print('refused', str(error).splitlines()[0], flush=True)\n"
            "time.sleep(600)\n")
    return subprocess.Popen([sys.executable, "-c", code, str(request), *([str(user)] if user is not None else [])],
                            stdout=subprocess.PIPE, text=True)


def test_a_child_forks_from_its_parents_server_and_its_launcher_stops_when_the_child_dies(tmp_path):
    """Killed outright, the child leaves nobody to stop its launcher but the server, which sees it exit."""
    env = _environment()
    prefork.warm(env)
    server = prefork._servers[prefork._key(env)]
    assert f"{server.name}:{prefork._digest(prefork._key(env))}" in os.environ[prefork.SERVER_ENV].split()
    child = _child(tmp_path, env)
    try:
        launcher, server_pid, kind = child.stdout.readline().split()
        assert (int(server_pid), kind) == (server.pid, "ParentServer")
        assert parent_pid(int(launcher)) == server.pid
    finally:
        child.kill()
        child.wait()
    assert _gone(int(launcher), 15), "the launcher outlived the labs process that asked for it"
    assert server.alive()


@pytest.mark.skipif(os.getuid() != 0, reason="becoming another user takes root")
def test_another_users_process_gets_no_launcher_from_the_server(tmp_path):
    env = _environment()
    prefork.warm(env)
    server = prefork._servers[prefork._key(env)]
    before = set(descendants(server.pid))
    child = _child(tmp_path, env, user=65534)       # nobody, once it has imported labs
    try:
        said = child.stdout.readline()              # whatever it got instead (it cannot start a server of its own
        forked = set(descendants(server.pid)) - before      # here: as nobody it cannot read this Python's library)
    finally:
        child.kill()
        child.wait()
    assert not forked and f" {server.pid} " not in said, (said, forked)
    assert server.alive()


def test_a_childs_launcher_runs_on_when_its_parent_retires_the_server(tmp_path):
    """The parent's `_server` retires an idle server: idle for the parent, not for its children. Retired, the server
    takes no more requests and exits once the child's launcher has ended (here: SIGTERM when the child is killed)."""
    env = _environment()
    prefork.warm(env)
    server = prefork._servers.pop(prefork._key(env))
    child = _child(tmp_path, env)
    try:
        launcher = int(child.stdout.readline().split()[0])
        server.retire()                             # as the parent does when it needs a server for another environment
        with pytest.raises(subprocess.TimeoutExpired):
            server.process.wait(timeout=3)
        assert prefork._exists(launcher)
    finally:
        child.kill()
        child.wait()
    assert _gone(launcher, 15) and server.process.wait(timeout=15) == 0
