"""Do the columns ZenFlow updates on the GPU train at a fine-tuning learning rate? On the tiny preset, one CPU rank,
32 steps at lr 1e-5, update_interval 4: the share of the weight matrices' elements that moved in the weights the
forward uses (the engine's bf16 parameters at the end, dumped by a sitecustomize for this measurement), split into
the columns ZenFlow chose at step 1 and the rest, and each part's distance to labs without offload's weights, for
DeepSpeed's bf16 columns and labs.zenflow_columns' fp32 masters, choosing once and every 4 steps. The initial
weights come from a run of 1 step at lr 1e-30. Every run skips labs.zenflow_moments (later than the record: it
changes the CPU's update), so the tool measures what the record measured. Writes
results/cpu/zenflow_columns/result.json.

    python tools/zenflow_columns_freeze.py          # about 7 minutes on 2 cores
"""
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
from cpu_record import LABS, ROOT, header, skipping, zenflow_config

OUT = ROOT / "results" / "cpu" / "zenflow_columns"
SITE = skipping("zenflow_moments") + """import os
import torch
import labs.instruments.state as s
import labs.zenflow_columns as zc
if os.environ.get("ZF_DEEPSPEED_COLUMNS"):
    zc.install = lambda: None
_finished = s.StateBytes.finished
def finished(self, engine):
    found = {}
    for name, p in engine.module.named_parameters():
        found[name] = p.detach().float().cpu().clone()
        if getattr(p, "selected_indices", None) is not None:
            found[name + "::chosen"] = p.selected_indices.long().cpu().clone()
    torch.save(found, os.environ["ZF_DUMP"])
    return _finished(self, engine)
s.StateBytes.finished = finished
"""


def shares(run: dict, initial: dict, reference: dict) -> dict:
    """Moved share and relative distance to the reference, for the columns chosen at step 1 and for the rest."""
    found = {}
    for part in ("chosen", "rest"):
        moved = total = far = span = 0.0
        for name, w0 in initial.items():
            if "::" in name or w0.dim() != 2:
                continue
            mask = torch.zeros_like(w0, dtype=torch.bool)
            mask[:, initial[name + "::chosen"]] = True
            mask = mask if part == "chosen" else ~mask
            moved += (run[name] != w0)[mask].sum().item()
            total += mask.sum().item()
            far += ((run[name] - reference[name])[mask] ** 2).sum().item()
            span += ((reference[name] - w0)[mask] ** 2).sum().item()
        found[part] = dict(moved_share=moved / total, distance_to_no_offload=(far / span) ** 0.5, elements=int(total))
    return found


def main():
    work = Path(tempfile.mkdtemp(prefix="zf_columns_"))
    (work / "site").mkdir()
    (work / "site" / "sitecustomize.py").write_text(SITE)
    once, again = zenflow_config(work / "once.json", {}), zenflow_config(work / "again.json", dict(
        select_strategy="step", select_interval=4))
    deepspeeds = {"ZF_DEEPSPEED_COLUMNS": "1"}
    runs = {"initial": (once, 1, "1e-30", {}), "no_offload": (zenflow_config(work / "none.json", None), 32, "1e-5", {}),
            "deepspeed_chosen_once": (once, 32, "1e-5", deepspeeds), "labs_chosen_once": (once, 32, "1e-5", {}),
            "deepspeed_chosen_every_4": (again, 32, "1e-5", deepspeeds), "labs_chosen_every_4": (again, 32, "1e-5", {})}
    commands, dumps = {}, {}
    for name, (cfg, steps, lr, extra) in runs.items():
        train = LABS + ["train", "--preset", "tiny", "--config", cfg, "--nproc", "1", "--steps", str(steps), "--lr", lr,
                        "--out", str(work / name), "--quiet"]
        env = dict(os.environ, PYTHONPATH=str(work / "site"), ZF_DUMP=str(work / f"{name}.pt"), **extra)
        subprocess.run(train, check=True, env=env, cwd=ROOT)
        dumps[name] = torch.load(work / f"{name}.pt")
        commands[name] = " ".join(train[2:]) + (" (DeepSpeed's bf16 columns: labs.zenflow_columns not installed)"
                                                if extra else "")
    initial, reference = dumps["initial"], dumps["no_offload"]
    found = {name: shares(dumps[name], initial, reference) for name in list(runs)[1:]}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "result.json").write_text(json.dumps(header(__doc__) | {
        "commands": commands, "runs": found}, indent=1) + "\n")
    shutil.rmtree(work, ignore_errors=True)           # this script's own temporary runs
    print(json.dumps(found, indent=1))


if __name__ == "__main__":
    main()
