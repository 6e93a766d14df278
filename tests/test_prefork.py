"""labs.prefork: launchers forked from one warm server per labs process, each looking to labs like a new interpreter
(its output, exit code or signal, environment, working folder and process group), the server shared by runs whose
environments differ only in the variables a rank reads itself. The real runs through it are every CPU run of the
course; test_run_control.py stops them with Ctrl-C, SIGTERM, SIGKILL and a dead rank."""
import os
import signal
import socket
import subprocess
import sys

import pytest

from labs import env as env_lib
from labs import prefork


def _environment(**extra) -> dict:
    env, _ = env_lib.repaired_environment(2, cpu_offload=False)
    env["PYTHONPATH"] = env_lib.importable_path(env)
    env.update(env_lib.CPU_ONLY, **extra)
    return env


def _launch(args, env):
    process = prefork.start([sys.executable, *prefork.LAUNCHER, *args], env)
    return process, process.stdout.read().decode(), process.wait(timeout=120)


def test_a_launcher_gets_the_runs_output_pipe_exit_code_and_environment():
    # torchrun's own parser, in the forked launcher: an unknown option is exit code 2 and its message on stderr
    _, output, code = _launch(["--no-such-option", "-m", "labs.rank", "unused"], _environment())
    assert code == 2 and "fork_launcher.py: error: unrecognized arguments: --no-such-option" in output, output
    # torchrun reads an option's default from PET_<OPTION>: this run's environment, not the server's
    _, output, code = _launch(["--standalone", "-m", "labs.rank", "unused"], _environment(PET_NPROC_PER_NODE="bogus"))
    assert code == 1 and "ValueError: Unsupported nproc_per_node value: bogus" in output, output


def test_one_server_serves_runs_that_differ_only_in_thread_variables():
    env = _environment()
    _launch(["--no-such-option"], env)
    servers = dict(prefork._servers)
    _launch(["--no-such-option"], dict(env, OMP_NUM_THREADS="7", LOCAL_SIZE="3"))
    assert prefork._servers == servers                     # the same server
    _launch(["--no-such-option"], dict(env, LABS_PREFORK_PROBE="other"))
    assert len(prefork._servers) == len(servers) + 1       # a variable read at start-up: a server of its own


def test_a_launcher_has_its_own_group_and_the_runs_folder_and_a_kill_reads_as_popen_would(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # node 0 of two, waiting for a node 1 that never comes: a launcher that stays until it is killed
    process = prefork.start([sys.executable, *prefork.LAUNCHER, "--nnodes=2", "--node-rank=0", "--nproc-per-node=1",
                             "--rdzv-backend=static", f"--rdzv-endpoint=127.0.0.1:{_free_port()}",
                             "--rdzv-conf=timeout=120", "-m", "labs.rank", "unused"], _environment())
    with pytest.raises(subprocess.TimeoutExpired):
        process.wait(timeout=0.5)
    assert process.poll() is None
    assert os.readlink(f"/proc/{process.pid}/cwd") == str(tmp_path)
    assert os.getpgid(process.pid) == process.pid != os.getpgid(0)
    os.killpg(process.pid, signal.SIGKILL)
    assert process.wait(timeout=60) == -signal.SIGKILL
    assert process.poll() == -signal.SIGKILL


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
