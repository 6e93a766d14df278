"""What the CPU measuring tools of ZenFlow (tools/zenflow_*.py) share: the config they train with, a sitecustomize that
leaves some of labs' ZenFlow fixes out (so that a tool keeps measuring what its record measured, or measures a fix
against DeepSpeed's own code), and the header of the record they write (when, where, which labs, how)."""
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from labs import config  # noqa: E402

LABS = [sys.executable, "-m", "labs"]


def zenflow_config(path: Path, zenflow: dict | None) -> str:
    """ds_configs/bench/labs_zero2_offload_zenflow.json with its learning rate left to --lr and update_interval 4,
    updated with `zenflow`; None: labs without offload, the same config less the zenflow and offload blocks."""
    raw = config.load(ROOT / "ds_configs/bench/labs_zero2_offload_zenflow.json")
    raw["optimizer"]["params"]["lr"] = "auto"
    if zenflow is None:
        del raw["zero_optimization"]["zenflow"], raw["zero_optimization"]["offload_optimizer"]
    else:
        raw["zero_optimization"]["zenflow"].update({"update_interval": 4} | zenflow)
    return str(config.write(raw, path))


def skipping(*fixes: str) -> str:
    """A sitecustomize's text that makes `labs.<fix>.install` a no-op for each fix named (e.g. "zenflow_columns")."""
    lines = ["import sys", f"sys.path.insert(0, {str(ROOT)!r})"]
    for fix in fixes:
        lines += [f"import labs.{fix}", f"labs.{fix}.install = lambda: None"]
    return "\n".join(lines) + "\n"


def header(doc: str) -> dict:
    """The record's first keys: when and where it was measured, at which labs commit, and how (the tool's docstring's
    first paragraph)."""
    return {"measured": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, {platform.platform()}",
            "labs_commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                          cwd=ROOT).stdout.strip(),
            "how": doc.strip().split("\n\n")[0]}
