"""What do ZenFlow's two sets of CPU Adam moments and its step count cost in loss? On the tiny preset from its random
initial weights, one CPU rank, 48 steps at lr 1e-3 (large enough for the loss to fall in 48 steps), for seeds 0, 1
and 2 (each seed its own initial weights and data order, shared by every run of that seed; update_interval 4, the
columns chosen once): the per-step loss without offload; with ZenFlow sequential (overlap_step false) with
DeepSpeed's step count and with labs' count; overlapped, with both levers in all four combinations (two sets or one,
DeepSpeed's count or labs'); overlapped with labs' CPU Adam but DeepSpeed's wait (labs.zenflow_host's wait for the
update of the round before, undone); and sequential with labs' count at update_interval 1 (a CPU update every step),
to size what the interval itself costs. The runs differ only in what a sitecustomize leaves of labs' fixes.
Writes results/cpu/zenflow_moments/result.json.

    python tools/zenflow_moments_loss.py          # about 10 minutes on 2 cores
"""
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from cpu_record import LABS, ROOT, header, zenflow_config

OUT = ROOT / "results" / "cpu" / "zenflow_moments"
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
elif what == "count":                 # DeepSpeed's two sets, labs' count
    _install = zm.install
    def install():
        from deepspeed.runtime.zenflow import zenflow_utils
        two_sets = zenflow_utils.zenflow_optimizer_process
        _install()
        zenflow_utils.zenflow_optimizer_process = two_sets
    zm.install = install
elif what == "deepspeeds_wait":       # labs' CPU Adam, DeepSpeed's skip of the second round's wait
    import labs.zenflow_host as zh
    _host_install = zh.install
    def host_install():
        _host_install()
        from deepspeed.runtime.zenflow.zenflow_stage_1_and_2 import ZenFlowZeroOptimizerParallel
        setattr(ZenFlowZeroOptimizerParallel, zh._WAITS, 1)     # as if a warm-up update had been waited for
    zh.install = host_install
"""
# name: (overlap_step or None for no offload, what labs.zenflow_moments keeps, update_interval)
RUNS = {"no_offload": (None, "labs", 4), "sequential_deepspeed": (False, "deepspeed", 4),
        "sequential_labs": (False, "labs", 4), "sequential_labs_interval_1": (False, "labs", 1),
        "overlap_deepspeed": (True, "deepspeed", 4), "overlap_count": (True, "count", 4),
        "overlap_one_set": (True, "one_set", 4), "overlap_labs": (True, "labs", 4),
        "overlap_labs_deepspeeds_wait": (True, "deepspeeds_wait", 4)}


def main():
    work = Path(tempfile.mkdtemp(prefix="zf_moments_"))
    (work / "site").mkdir()
    (work / "site" / "sitecustomize.py").write_text(SITE)
    found, commands = {name: {} for name in RUNS}, {}
    for seed in SEEDS:
        for name, (overlap, what, interval) in RUNS.items():
            cfg = zenflow_config(work / f"{name}.json", None if overlap is None else dict(overlap_step=overlap,
                                                                                          update_interval=interval))
            out = work / f"{name}_seed{seed}"
            train = LABS + ["train", "--preset", "tiny", "--config", cfg, "--nproc", "1", "--steps", str(STEPS),
                            "--lr", LR, "--seed", str(seed), "--out", str(out), "--quiet"]
            env = dict(os.environ, PYTHONPATH=str(work / "site"), ZF_MOMENTS=what)
            subprocess.run(train, check=True, env=env, cwd=ROOT)
            found[name][str(seed)] = [json.loads(line)["loss"] for line in
                                      (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
            commands[f"{name}_seed{seed}"] = " ".join(train[2:]) + (
                "" if overlap is None else f" (overlap_step {str(overlap).lower()}, update_interval {interval}; "
                                           f"CPU Adam: {what})")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "result.json").write_text(json.dumps(header(__doc__) | {
        "commands": commands, "losses": found}, indent=1) + "\n")
    shutil.rmtree(work, ignore_errors=True)           # this script's own temporary runs
    for name, seeds in found.items():
        print(f"{name:>22}  mean loss of steps {STEPS - 15}-{STEPS}, per seed:",
              "  ".join(f"{sum(losses[-16:]) / 16:.4f}" for losses in seeds.values()))


if __name__ == "__main__":
    main()
