"""ZenFlow (ZeRO-2 + CPU optimizer offload with a top-k selective update) trains in labs, and a run whose loss turns
non-finite fails instead of reporting a result (tools/repro_zenflow_nan.py: DeepSpeed 0.19.8 with update_interval
"auto" divides the loss by 0)."""
import json
import math

import pytest

from conftest import ROOT, run_labs
from labs import config, launch, resolve, train
from labs.errors import LabsError, RankFailed

ZENFLOW = ROOT / "ds_configs/bench/labs_zero2_offload_zenflow.json"


def _zenflow_config(tmp_path, **zenflow) -> str:
    raw = config.load(ZENFLOW)
    raw["optimizer"]["params"]["lr"] = "auto"          # the run's --lr: large enough that 10 steps lower the loss
    raw["zero_optimization"]["zenflow"].update(zenflow)
    return str(config.write(raw, tmp_path / "zenflow.json"))


def test_zenflow_trains_with_a_falling_finite_loss(tmp_path):
    out = tmp_path / "zf"
    result = run_labs("train", "--preset", "tiny", "--config", _zenflow_config(tmp_path), "--nproc", 1,
                      "--steps", 6, "--lr", 1e-2, "--out", out, "--quiet", timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 6 and all(math.isfinite(loss) for loss in losses), losses
    assert sum(losses[-2:]) / 2 < losses[0] - 0.3, losses      # the CPU step runs from step 4 (update_interval 4)


def test_update_interval_auto_is_refused_before_any_rank_starts(tmp_path):
    result = run_labs("train", "--preset", "tiny", "--config", _zenflow_config(tmp_path, update_interval="auto"),
                      "--nproc", 1, "--steps", 2, "--out", tmp_path / "zf")
    assert result.returncode == 2
    assert result.stderr.startswith("labs: error: config key 'zero_optimization.zenflow.update_interval'")
    assert len(result.stderr.strip().splitlines()) == 1 and not (tmp_path / "zf").exists()


def test_check_finite_names_the_step_and_rank():
    train.check_finite(3, [2.5, 2.4])
    with pytest.raises(train.NonFiniteLoss, match=r"^step 7: the loss is nan on rank 1"):
        train.check_finite(7, [2.5, float("nan")])


def test_a_run_whose_loss_turns_nan_fails_naming_the_step(tmp_path, monkeypatch):
    # DeepSpeed's own NaN: update_interval "auto", let through labs' refusal (resolve runs in this process; the
    # ranks read the resolved ds_config.json). Step 1's loss is finite, the weights after it are not.
    monkeypatch.setattr(resolve, "_zenflow", lambda config: None)
    with pytest.raises(RankFailed) as failure:
        launch.run(preset="tiny", config=_zenflow_config(tmp_path, update_interval="auto"), nproc=1, steps=2,
                   lr=1e-3, out=tmp_path / "nan", stream=False)
    first = str(failure.value).splitlines()[0]
    assert "NonFiniteLoss: step 2: the loss is nan on rank 0: training diverged" in first, first
    assert not (tmp_path / "nan").exists()
