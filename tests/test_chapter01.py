"""Chapter 01's helpers: the calculator draws what a plain call draws, exercises check answers, GPU results
are compared with the prediction for the same run."""

import re

import matplotlib
import pytest

matplotlib.use("Agg")

from labs import launch, memory  # noqa: E402
from labs.bench import results  # noqa: E402
from labs.course import peak_records, widgets  # noqa: E402
from labs.errors import LabsError  # noqa: E402


def test_calculator_first_drawing_is_the_plain_chart():
    _, plain = widgets.memory_bar()
    calc = widgets.calculator()
    assert calc.first == plain and plain["drawn"]["bars"] and plain["drawn"]["lines"]   # what matplotlib drew
    calc.controls["stage"].value = 1                 # a control change redraws with the new setting
    assert calc.data["setting"]["stage"] == 1 and calc.data["drawn"] != plain["drawn"]
    assert {k: v for k, v in calc.data.items() if k != "drawn"} == widgets.bar_data(stage=1)
    assert calc.first == plain                        # the first drawing is kept while the reader plays
    parts = sum(plain["parts_gib"].values())
    assert parts == pytest.approx(plain["total_gib"])
    assert not plain["fits"] and "cheapest change" in plain["verdict"]    # the static page shows advice


def test_the_calculator_shows_the_peak_and_what_the_fit_weighs():
    """Where the peak is a start-up flatten larger than the whole card, DeepSpeed makes it on the CPU: the bar still
    shows the peak, a dotted line marks the moment the fit weighs, and the verdict is MemoryEstimate.fits's. Within the
    card's total (the 3B in fp32 on an RTX 4090) the flatten counts against usable memory like every moment."""
    card = memory.gpu_bytes("RTX4090")
    setting = dict(stage=2, checkpointing="full", loss="liger", micro_batch=1, seq_len=4096, gpu="RTX4090")
    _, data = widgets.memory_bar(gpus=64, **setting)
    est = memory.estimate("qwen2.5-7b", stage=2, gpus_per_node=64, precision=widgets.DEFAULTS["precision"],
                          activation_checkpointing="full", loss="liger", micro_batch=1, seq_len=4096)
    assert data["peak_phase"] == "init" and data["fit_phase"] == est.fit_phase_on(card) != "init"
    assert data["fits"] is est.fits(card) is True and data["total_gib"] > data["usable_gib"] > data["fit_gib"]
    assert (round(data["fit_gib"], 3), ":") in data["drawn"]["lines"]
    title = data["drawn"]["title"].replace("\n", " ")
    assert f"FITS: {data['fit_gib']:.1f} GiB at {data['fit_phase']} of {data['usable_gib']:.1f} GiB usable" in title
    assert f"peak {data['total_gib']:.1f} GiB at init" in title and "made on the CPU on this card" in title
    _, band = widgets.memory_bar(preset="qwen2.5-3b", gpus=8, precision="fp32", **setting)
    assert band["peak_phase"] == band["fit_phase"] == "init" and not band["fits"]
    assert band["usable_gib"] < band["total_gib"] <= band["gpu_gib"] and len(band["drawn"]["lines"]) == 2
    assert f"DOES NOT FIT: peak {band['total_gib']:.1f} GiB of" in band["drawn"]["title"]
    _, plain = widgets.memory_bar()           # the default: its peak is what the fit weighs, no extra mark
    assert plain["fit_gib"] == plain["total_gib"] and len(plain["drawn"]["lines"]) == 2


def test_calculator_offers_only_the_offloads_deepspeed_accepts():
    calc = widgets.calculator()
    offload = calc.controls["offload"]
    assert list(offload.options) == list(widgets.OFFLOADS)                # stage 3: all of them
    offload.value = "optimizer+params"
    calc.controls["stage"].value = 2
    assert list(offload.options) == ["none", "optimizer"] and calc.data["setting"]["offload"] == "none"
    offload.value = "optimizer"
    calc.controls["stage"].value = 0
    assert list(offload.options) == ["none"] and calc.data["setting"] == {**calc.first["setting"], "stage": 0}
    for stage, level in ((0, "optimizer"), (0, "optimizer+params"), (1, "optimizer+params"), (2, "optimizer+params")):
        with pytest.raises(LabsError, match=re.escape(f"offload '{level}' needs ZeRO stage")):
            widgets.bar_data(stage=stage, offload=level)


def test_gpu_results_are_compared_with_the_prediction_for_that_run():
    """Chapter 01's GPU table: one row per valid case in results/gpu, measured peak over labs.memory's prediction."""
    rows = results.peak_comparisons()
    assert len(rows) == len([r for r in results.rows(results.load_all()) if not r["fp8"]]) >= 10
    assert all(0.9 <= row["ratio"] <= 1.1 for row in rows), [(r["name"], r["ratio"]) for r in rows]
    assert all(row["device"].endswith(("NVIDIA H200", "NVIDIA H100 80GB HBM3")) for row in rows)
    merged = results.peak_comparisons(merge_repeats=True)
    assert sum(len(row["runs"].split(", ")) for row in merged) == len(rows) > len(merged)
    assert max(abs(r["ratio"] - 1) for r in merged) == max(abs(r["ratio"] - 1) for r in rows)


def test_every_allocator_record_lands_on_the_moment_labs_memory_names():
    """Each recorded run's measured peak is within 1% of labs.memory's peak, and for stock FSDP2 on the untied 7B
    (round 9) that moment is the root's reduction: all gradient shards plus the root's fp32 reduce-scatter input."""
    records = {r["run"]: r for r in peak_records.runs()}
    assert all(abs(r["measured_bytes"] / r["predicted_now_bytes"] - 1) < 0.01 for r in records.values()), records
    assert records["stock_fsdp2_ckfull_mb2_7b"]["moment_now"] == "root_reduce"
    parts = {row["part"]: row for row in peak_records.breakdown("stock_fsdp2_ckfull_mb2_7b")}
    for name in ("params", "optimizer", "grads", "buffers"):
        assert parts[name]["now_bytes"] == pytest.approx(parts[name]["measured_bytes"], rel=0.01), name

@pytest.mark.parametrize("preset", ["tiny", "qwen2.5-7b"])
def test_calculator_run_and_widget_agree_on_every_default(preset):
    """One resolver: what `labs train` would run and what `labs memory` / the widget assume when nobody says."""
    spec, resolved = launch.prepare(preset=preset, nproc=2, memory_check=False)   # a 7B plan on a CPU machine
    est = memory.estimate(preset, gpus_per_node=2)
    assert est.inputs["micro_batch"] == resolved["train_micro_batch_size_per_gpu"]
    assert est.inputs["seq_len"] == spec["seq_len"]
    assert est.inputs["precision"] == spec["precision"]
    assert est.inputs["stage"] == resolved["zero_optimization"]["stage"]
    assert est.breakdown["knobs"]["reduce_bucket_size"] == resolved["zero_optimization"]["reduce_bucket_size"]
    if preset == "qwen2.5-7b":
        setting = widgets.bar_data()["setting"]
        assert (setting["micro_batch"], setting["seq_len"], setting["precision"]) == \
            (est.inputs["micro_batch"], est.inputs["seq_len"], est.inputs["precision"])
