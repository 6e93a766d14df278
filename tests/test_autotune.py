"""`labs autotune`: DeepSpeed's autotuner over labs' training loop (labs.bench.autotune), on one CPU rank."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT, interruptible, processes_naming, run_labs
from labs.bench import autotune
from labs.course import autotune_report
from labs.errors import LabsError


@pytest.mark.parametrize("flags, names", [
    (["--micro-batches", "1,3", "--batch-per-gpu", "4"], "--micro-batches 1,3: each must divide --batch-per-gpu 4"),
    (["--micro-batches", "1,2", "--batch-per-gpu", "4"], "the largest equal to it"),
    (["--stages", "0,4"], "--stages 0,4: each must be one of 1, 2, 3"),
    (["--micro-batches", "one"], "--micro-batches 'one': give whole numbers"),
    (["--config", "fsdp2.json", "--micro-batches", "1,2", "--batch-per-gpu", "2"], "tunes DeepSpeed ZeRO"),
    (["--config", "nope.json"], "nope.json"),
])
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, flags, names):
    out = tmp_path / "tuned"
    result = run_labs("autotune", *flags, "--out", out, timeout=120)
    assert result.returncode == 2 and names in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_every_candidate_trains_the_same_batch():
    """The autotuner runs micro-batch m with accumulation max // m: the list labs gives it keeps the batch fixed."""
    config = autotune.tuner_config({"train_batch_size": 8, "zero_optimization": {"stage": 3, "overlap_comm": True}},
                                   [2, 3], [1, 2, 4], ROOT, 3, 5)
    assert config["train_micro_batch_size_per_gpu"] == [1, 2, 4] and config["gradient_accumulation_steps"] == 1
    assert "train_batch_size" not in config and config["zero_optimization"]["stage"] == [2, 3]
    with pytest.raises(LabsError, match="each must divide"):
        autotune.check([3], [3, 4], 4)


def test_the_autotuner_runs_labs_loop_and_picks_its_fastest(tmp_path):
    out = tmp_path / "tuned"
    result = run_labs("autotune", "--stages", "3", "--micro-batches", "1,2", "--batch-per-gpu", "2", "--nproc", "1",
                      "--gpu-memory", "3GiB", "--out", out, timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads((out / "autotune.json").read_text())
    rows = {r["name"]: r for r in found["experiments"]}
    assert set(rows) == {"z3_gas2_tmbspg1", "z3_gas1_tmbspg2"}
    for row in rows.values():
        assert row["micro_batch"] * row["grad_accum"] == 2          # like for like: the same sequences per step
        assert row["zero_keys"] == ["stage"]                        # fast mode keeps the stage and nothing else
        assert row["tokens_per_s_per_gpu"] > 0 and row["labs_steps"] == 5    # steps 1-5; DeepSpeed exits in the 6th
        assert row["labs_tokens_per_s_per_gpu"] > 0 and "error" not in row
    assert found["pick"] == max(rows.values(), key=lambda r: r["tokens_per_s_per_gpu"])["name"]
    assert found["model_info"]["num_params"] == 9_822_784                # the tiny preset, counted by DeepSpeed
    assert (out / "results" / "ds_config_optimal.json").exists() and f"picked {found['pick']}" in result.stdout
    # the autotuner planned for the cap, not the machine's whole memory (labs.bench.autotune_launcher)
    assert autotune_report.autotuner_estimate(out)["gpu_gib"] == 3.0


def test_ctrl_c_stops_every_process_and_keeps_the_finished_candidates(tmp_path):
    """Hours of trials are not thrown away: a stopped autotuner publishes what finished, marked incomplete."""
    out = tmp_path / "tuned"
    process = subprocess.Popen(interruptible([sys.executable, "-m", "labs", "autotune", "--stages", "3",
                                              "--micro-batches", "1,2,4", "--batch-per-gpu", "4", "--nproc", "1",
                                              "--out", out]), cwd=ROOT,
                               env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while not list(tmp_path.glob(".tuned.partial-*/results/z3_*/metrics.json")):
        assert process.poll() is None and time.time() < deadline, process.communicate()
        time.sleep(0.5)
    work = next(tmp_path.glob(".tuned.partial-*"))
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 130, err[-2000:]
    assert "finished candidates are kept in" in err.strip().splitlines()[-1]
    stop = time.time()
    while processes_naming(str(work)) and time.time() - stop < 15:
        time.sleep(0.2)
    assert not processes_naming(str(work)), "a process of the autotuner outlived it"
    found = json.loads((out / "autotune.json").read_text())
    assert found["complete"] is False and found["pick"] is None
    assert any("tokens_per_s_per_gpu" in r for r in found["experiments"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tuned"]      # no partial folder or lock left behind
