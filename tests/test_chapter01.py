"""Chapter 01's helpers: the calculator draws what a plain call draws, exercises check answers, GPU results
are compared with the prediction for the same run."""
import json

import matplotlib
import pytest

matplotlib.use("Agg")

from labs import exercises, memory, memory_plots, widgets  # noqa: E402
from labs.errors import LabsError  # noqa: E402


def test_calculator_default_is_the_plain_chart():
    _, plain = widgets.memory_bar()
    calc = widgets.calculator()
    assert calc.data == plain
    calc.controls["stage"].value = 1                 # a control change redraws with the new setting
    assert calc.data["setting"]["stage"] == 1 and calc.data == widgets.bar_data(stage=1)
    parts = sum(plain["parts_gib"].values())
    assert parts == pytest.approx(plain["total_gib"])


def test_exercises_check_answers(capsys):
    assert exercises.check("01.1", 16) is True
    assert exercises.check("01.2", 28.6) is True
    assert exercises.check("01.2", 7e9 * 16 / 8 / 1e9) is False       # the seeds' "7B" is not Qwen2.5-7B
    assert exercises.check_01_1("sixteen") is False
    out = capsys.readouterr().out
    assert "01.1 correct" in out and "too low" in out and "Hint" in out
    with pytest.raises(LabsError):
        exercises.check("99.9", 1)


def test_gpu_results_are_compared_with_the_prediction_for_that_run(tmp_path):
    """A run folder committed from a GPU host (fake numbers here): measured peak vs labs.memory.from_run."""
    from labs import CONFIGS, config, models

    folder = tmp_path / "h200_zero3"
    folder.mkdir()
    ds = config.resolve(config.load(CONFIGS / "zero3.json"), world_size=2, micro_batch=2, grad_accum=None, steps=5, hidden_size=3584, on_gpu=True)
    spec = dict(dims=models.shape("qwen2.5-7b"), nproc=2, seq_len=4096, loss="hf", activation_checkpointing="none",
                engine="deepspeed")
    (folder / "run.json").write_text(json.dumps(spec))
    (folder / "ds_config.json").write_text(json.dumps(ds))
    predicted = memory.from_run(folder).total_per_gpu_bytes
    (folder / "summary.json").write_text(json.dumps(dict(memory_kind="cuda_max_memory_allocated", device="H200",
                                                         peak_memory_bytes=[int(predicted * 1.02), 5])))
    (rows,) = memory_plots.gpu_comparisons(tmp_path)
    assert rows["name"] == "h200_zero3" and rows["ratio"] == pytest.approx(1.02, rel=1e-6)
    assert predicted == memory.estimate("qwen2.5-7b", stage=3, gpus_per_node=2, micro_batch=2,
                                        ds_config=ds).total_per_gpu_bytes
