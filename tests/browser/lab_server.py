"""A JupyterLab server the test owns: started on 127.0.0.1 with a token, in its own session, every process it
starts (kernels included, which jupyter_client puts in sessions of their own) tagged through one environment
variable, so that after the shutdown the test can name any process that is left, by pid."""
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

MARK = "LABS_BROWSER_TEST_RUN"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tagged_processes(mark: str) -> list[tuple[int, str]]:
    """(pid, command line) of every live process whose environment carries `MARK=mark`."""
    needle = f"{MARK}={mark}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                status = (entry / "status").read_text()
                if "\nState:\tZ" in status:      # a zombie has exited; its parent has not reaped it yet
                    continue
                found.append((int(entry.name), (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()))
        except OSError:                          # gone meanwhile, or not ours to read
            continue
    return found


def write_settings(settings_dir: Path):
    """User settings for this server only: every cell kept in the page (no windowing), no news toast."""
    for plugin, values in {"@jupyterlab/notebook-extension/tracker": {"windowingMode": "none"},
                           "@jupyterlab/apputils-extension/notification": {"fetchNews": "false",
                                                                           "checkForUpdates": False}}.items():
        path = settings_dir / f"{plugin}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))


class Lab:
    def __init__(self, root: Path, state: Path):
        self.root, self.state = root, state
        self.port, self.token, self.mark = free_port(), secrets.token_hex(16), secrets.token_hex(8)
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = state / "jupyterlab.log"
        self.process = None

    def start(self, timeout=120):
        dirs = {name: self.state / name for name in ("config", "runtime", "settings", "workspaces", "ipython")}
        for path in dirs.values():
            path.mkdir(parents=True, exist_ok=True)
        write_settings(dirs["settings"])
        (dirs["config"] / "jupyter_lab_config.json").write_text(json.dumps({"LabApp": {
            "news_url": None, "check_for_updates_class": "jupyterlab.NeverCheckForUpdate"}}))
        # This server's own configuration, settings and state, so that neither the user's nor ours leak across.
        env = dict(os.environ, **{MARK: self.mark}, JUPYTER_CONFIG_DIR=str(dirs["config"]),
                   JUPYTER_RUNTIME_DIR=str(dirs["runtime"]), JUPYTERLAB_SETTINGS_DIR=str(dirs["settings"]),
                   JUPYTERLAB_WORKSPACES_DIR=str(dirs["workspaces"]), IPYTHONDIR=str(dirs["ipython"]))
        # The flags of `make lab`, plus a port and a token of our own.
        command = [str(Path(sys.executable).parent / "jupyter"), "lab", "--no-browser", "--ServerApp.ip=127.0.0.1",
                   f"--ServerApp.port={self.port}", "--ServerApp.port_retries=0",
                   f"--IdentityProvider.token={self.token}", f"--ServerApp.root_dir={self.root}"]
        if os.getuid() == 0:
            command.append("--allow-root")
        log = open(self.log_path, "w")
        self.process = subprocess.Popen(command, cwd=self.root, env=env, stdout=log, stderr=subprocess.STDOUT,
                                        start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"JupyterLab exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                self.api("GET", "/api/status")
                return self
            except (urllib.error.URLError, ConnectionError):
                time.sleep(0.5)
        raise RuntimeError(f"JupyterLab did not answer on {self.base} within {timeout} s:\n{self.log_tail()}")

    def api(self, method: str, path: str):
        request = urllib.request.Request(self.base + path, method=method,
                                         headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(request, timeout=10) as response:
            body = response.read()
        return json.loads(body) if body else None

    def url(self, path: str) -> str:
        return f"{self.base}/{path}?token={self.token}"

    def log_tail(self, chars=3000) -> str:
        return self.log_path.read_text()[-chars:] if self.log_path.exists() else ""

    def stop(self, timeout=30) -> list[tuple[int, str]]:
        """Shut the server down through its API (it stops its kernels first); returns the processes that were
        still alive afterwards (then killed, by pid), which should be none."""
        if self.process is None:
            return []
        if self.process.poll() is None:
            try:
                self.api("POST", "/api/shutdown")
            except (urllib.error.URLError, ConnectionError):
                pass
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        deadline = time.monotonic() + 10     # kernels exit a moment after the server has answered
        while (left := tagged_processes(self.mark)) and time.monotonic() < deadline:
            time.sleep(0.2)
        for pid, _ in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        return left
