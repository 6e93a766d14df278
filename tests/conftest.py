import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run_labs(*args, cwd=None, timeout=600):
    """`python -m labs ...` as a user would type it; returns the CompletedProcess."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "labs", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd or ROOT, env=env, timeout=timeout)


@pytest.fixture(scope="session")
def zero3_run(tmp_path_factory):
    """The foundation's end-to-end run: tiny preset, ZeRO-3, 2 CPU ranks, 30 steps (shared by tests)."""
    out = tmp_path_factory.mktemp("e2e") / "zero3"
    result = run_labs("train", "--preset", "tiny", "--config", ROOT / "ds_configs/zero3.json", "--steps", 30,
                      "--out", out, "--quiet")
    assert result.returncode == 0, result.stderr[-4000:]
    return out, result
