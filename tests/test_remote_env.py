"""labs.remote_env: the ranks DeepSpeed's runner starts over pdsh get labs' settings and the user's TORCH_*, GLOO_* and
DEEPSPEED_* variables, the user's own .deepspeed_env lines still win, and no credential is passed. Checked against the
runner itself: it runs with stand-in `ssh` and `pdsh` on PATH that record the command pdsh was given (the shell line
each host runs), and no host is reached."""
import os
import stat
import subprocess
import sys

from labs import prefork, remote_env


def test_forwarded_keeps_what_changes_a_rank_and_nothing_of_the_host():
    env = {"OMP_NUM_THREADS": "8", "LABS_OFFLOAD_COPY": "overlap", "TORCH_DISTRIBUTED_DEBUG": "DETAIL",
           "DEEPSPEED_TIMEOUT": "60", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "PATH": "/usr/bin",
           "GLOO_SOCKET_IFNAME": "eth0", "HOME": "/root", "CUDA_VISIBLE_DEVICES": "0,1", prefork.SERVER_ENV: "x:y",
           "DS_ENV_FILE": "/f", "HF_TOKEN": "hf_x", "TORCH_HUB_API_KEY": "k", "LABS_NOTE": 'say "hi"'}
    kept, dropped = remote_env.forwarded(env)
    assert list(kept) == ["DEEPSPEED_TIMEOUT", "GLOO_SOCKET_IFNAME", "LABS_OFFLOAD_COPY", "OMP_NUM_THREADS",
                          "PYTORCH_CUDA_ALLOC_CONF", "TORCH_DISTRIBUTED_DEBUG"]
    assert dropped == ["LABS_NOTE"]


def test_the_runner_exports_the_runs_file_and_the_users_own(tmp_path):
    bin_dir, home, work = tmp_path / "bin", tmp_path / "home", tmp_path / "work"
    for folder in (bin_dir, home, work):
        folder.mkdir()
    (bin_dir / "ssh").write_text("#!/bin/sh\nexit 0\n")                       # the runner's ssh check passes
    (bin_dir / "pdsh").write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {tmp_path}/pdsh_args\n')
    for tool in ("ssh", "pdsh"):
        (bin_dir / tool).chmod(0o755)
    (home / "my_env").write_text("NCCL_SOCKET_IFNAME=eth0\nOMP_NUM_THREADS=2\n")   # the user's, by DS_ENV_FILE
    (tmp_path / "hostfile").write_text("node0 slots=1\nnode1 slots=1\n")
    env = dict(os.environ, OMP_NUM_THREADS="8", TORCH_DISTRIBUTED_DEBUG="DETAIL", HOME=str(home), HF_TOKEN="hf_x",
               PATH=f"{bin_dir}:{os.environ['PATH']}", DS_ACCELERATOR="cpu", DS_ENV_FILE="my_env")
    path, _ = remote_env.write(env, work, home=home)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    env["DS_ENV_FILE"] = str(path)
    subprocess.run([sys.executable, "-m", "deepspeed.launcher.runner", f"--hostfile={tmp_path / 'hostfile'}",
                    "--master_addr=node0", "--no_local_rank", "--module", "labs.rank", str(work)],
                   env=env, cwd=work, capture_output=True, text=True, timeout=120)
    shell_line = (tmp_path / "pdsh_args").read_text()
    assert "export TORCH_DISTRIBUTED_DEBUG=DETAIL;" in shell_line
    assert "export OMP_NUM_THREADS=2;" in shell_line and "OMP_NUM_THREADS=8" not in shell_line   # the user's wins
    assert "export NCCL_SOCKET_IFNAME=eth0;" in shell_line and "hf_x" not in shell_line
