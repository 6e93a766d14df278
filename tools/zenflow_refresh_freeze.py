"""Does ZenFlow's refresh of the master weights (a choice of columns after the first: DeepSpeed's
sync_fp32_param_from_gpu, restated by labs.zenflow_host) erase the CPU optimizer's progress? On the tiny preset, one
CPU rank, 32 steps at lr 1e-5, update_interval 4: the share of the weight matrices' bf16 elements that changed from
their initial values, for ZenFlow choosing once, choosing again every 4 steps, and choosing again every 4 steps with
the refresh made a no-op (a sitecustomize, for this measurement only). The initial values come from a run of 1 step
at lr 1e-30, which moves no weight. Writes results/cpu/zenflow_refresh_freeze/result.json.

labs.zenflow_columns (round 18, later than the record) replaces DeepSpeed's bf16 steps for the chosen columns and this
refresh, and labs.zenflow_moments (later still) the CPU Adam's moments and step count. Every run here skips both
installs (a sitecustomize), so the tool measures what the record measured before they existed;
tools/zenflow_columns_freeze.py measures the first both ways, tools/zenflow_moments_loss.py the second.

    python tools/zenflow_refresh_freeze.py          # about 3 minutes on 2 cores
"""
import glob
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from cpu_record import LABS, ROOT, header, skipping, zenflow_config
from safetensors.torch import load_file

OUT = ROOT / "results" / "cpu" / "zenflow_refresh_freeze"
DEEPSPEED_COLUMNS = skipping("zenflow_columns", "zenflow_moments")
NO_REFRESH = DEEPSPEED_COLUMNS + "import labs.zenflow_host as z\nz.sync_fp32_param_from_gpu = lambda self: None\n"


def weights(folder: Path) -> dict:
    found = {}
    for f in glob.glob(str(folder / "*.safetensors")):
        found.update(load_file(f))
    return {name: t for name, t in found.items() if t.dim() == 2}       # the weight matrices


def main():
    work = Path(tempfile.mkdtemp(prefix="zf_freeze_"))
    site, no_refresh = work / "site", work / "no_refresh"
    for folder, text in ((site, DEEPSPEED_COLUMNS), (no_refresh, NO_REFRESH)):
        folder.mkdir()
        (folder / "sitecustomize.py").write_text(text)
    once = zenflow_config(work / "once.json", {})
    again = zenflow_config(work / "again.json", dict(select_strategy="step", select_interval=4))
    plain, bare = {"PYTHONPATH": str(site)}, {"PYTHONPATH": str(no_refresh)}
    runs = {"initial": (once, 1, "1e-30", plain), "chosen_once": (once, 32, "1e-5", plain),
            "chosen_every_4": (again, 32, "1e-5", plain),
            "chosen_every_4_no_refresh": (again, 32, "1e-5", bare)}
    commands, changed = {}, {}
    for name, (cfg, steps, lr, extra) in runs.items():
        train = LABS + ["train", "--preset", "tiny", "--config", cfg, "--nproc", "1", "--steps", str(steps), "--lr", lr,
                        "--save-every", str(steps), "--out", str(work / name), "--quiet"]
        env = dict(os.environ, **extra)
        subprocess.run(train, check=True, env=env, cwd=ROOT)
        subprocess.run(LABS + ["export", str(work / name), str(work / f"{name}_hf")], check=True, cwd=ROOT)
        commands[name] = " ".join(train[2:]) + (" (refresh made a no-op)" if extra is bare else "")
    initial = weights(work / "initial_hf")
    total = sum(t.numel() for t in initial.values())
    for name in list(runs)[1:]:
        trained = weights(work / f"{name}_hf")
        changed[name] = sum((trained[k] != initial[k]).sum().item() for k in initial) / total
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "result.json").write_text(json.dumps(header(__doc__) | {
        "commands": commands, "matrix_elements": total,
        "changed_share": changed}, indent=1) + "\n")
    shutil.rmtree(work, ignore_errors=True)           # this script's own temporary runs
    print(json.dumps(changed, indent=1))


if __name__ == "__main__":
    main()
