"""What do ZenFlow's two sets of CPU Adam moments and its step count cost in loss? On the tiny preset, one CPU rank,
48 steps at lr 1e-3, for seeds 0, 1 and 2 (each seed its own initial weights and data order, shared by every run
of that seed; update_interval 4, the columns chosen once): the
per-step loss without offload, and with ZenFlow, sequential (overlap_step false) and overlapped, each with
DeepSpeed's CPU Adam and with labs.zenflow_moments, and overlapped with one set of moments but DeepSpeed's count
(one lever at a time). The runs differ only in what a sitecustomize leaves of labs.zenflow_moments.
Writes results/cpu/zenflow_moments/result.json.

    python tools/zenflow_moments_loss.py          # about 8 minutes on 2 cores
"""
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from labs import config  # noqa: E402

OUT = ROOT / "results" / "cpu" / "zenflow_moments"
LABS = [sys.executable, "-m", "labs"]
STEPS, LR, SEEDS = 48, "1e-3", (0, 1, 2)
SITE = f"""import os, sys
sys.path.insert(0, {str(ROOT)!r})
import labs.zenflow_moments as zm
what = os.environ.get("ZF_MOMENTS", "labs")
if what == "deepspeed":
    zm.install = lambda: None
elif what == "one_set":               # one set of moments, DeepSpeed's step count
    zm.CountedSubmit.zenflow_adam_submit = lambda self, ctrl, state, step, *hp: self._op.zenflow_adam_submit(
        ctrl, state, step, *hp)
"""
# name: (overlap_step or None for no offload, what labs.zenflow_moments keeps)
RUNS = {"no_offload": (None, "labs"), "sequential_deepspeed": (False, "deepspeed"), "sequential_labs": (False, "labs"),
        "overlap_deepspeed": (True, "deepspeed"), "overlap_one_set": (True, "one_set"), "overlap_labs": (True, "labs")}


def write_config(path: Path, overlap: bool | None) -> str:
    raw = config.load(ROOT / "ds_configs/bench/labs_zero2_offload_zenflow.json")
    raw["optimizer"]["params"]["lr"] = "auto"
    if overlap is None:                                   # labs without offload: the same config less both
        del raw["zero_optimization"]["zenflow"], raw["zero_optimization"]["offload_optimizer"]
    else:
        raw["zero_optimization"]["zenflow"].update(update_interval=4, overlap_step=overlap)
    return str(config.write(raw, path))


def main():
    work = Path(tempfile.mkdtemp(prefix="zf_moments_"))
    (work / "site").mkdir()
    (work / "site" / "sitecustomize.py").write_text(SITE)
    found, commands = {name: {} for name in RUNS}, {}
    for seed in SEEDS:
        for name, (overlap, what) in RUNS.items():
            cfg, out = write_config(work / f"{name}.json", overlap), work / f"{name}_seed{seed}"
            train = LABS + ["train", "--preset", "tiny", "--config", cfg, "--nproc", "1", "--steps", str(STEPS),
                            "--lr", LR, "--seed", str(seed), "--out", str(out), "--quiet"]
            env = dict(os.environ, PYTHONPATH=str(work / "site"), ZF_MOMENTS=what)
            subprocess.run(train, check=True, env=env, cwd=ROOT)
            found[name][str(seed)] = [json.loads(line)["loss"] for line in
                                      (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
            commands[f"{name}_seed{seed}"] = " ".join(train[2:]) + (
                "" if overlap is None else f" (overlap_step {str(overlap).lower()}; CPU Adam: {what})")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "result.json").write_text(json.dumps({
        "measured": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": f"{platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores, {platform.platform()}", "labs_commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip(),
        "how": __doc__.strip().split("\n\n")[0], "commands": commands, "losses": found}, indent=1) + "\n")
    shutil.rmtree(work, ignore_errors=True)           # this script's own temporary runs
    for name, seeds in found.items():
        print(f"{name:>22}  mean loss of steps {STEPS - 15}-{STEPS}, per seed:",
              "  ".join(f"{sum(losses[-16:]) / 16:.4f}" for losses in seeds.values()))


if __name__ == "__main__":
    main()
