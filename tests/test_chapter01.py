"""Chapter 01's helpers: the calculator draws what a plain call draws, exercises check answers, GPU results
are compared with the prediction for the same run."""

import matplotlib
import pytest

matplotlib.use("Agg")

from labs import exercises, memory_plots, widgets  # noqa: E402
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


def test_gpu_results_are_compared_with_the_prediction_for_that_run():
    """Chapter 01's GPU table: one row per valid case in results/gpu, measured peak over labs.memory's prediction."""
    from labs import results

    rows = memory_plots.gpu_comparisons()
    assert len(rows) == len(results.rows(results.load_all())) >= 10
    assert all(0.9 <= row["ratio"] <= 1.1 for row in rows), [(r["name"], r["ratio"]) for r in rows]
    assert all(row["device"].endswith("NVIDIA H200") for row in rows)