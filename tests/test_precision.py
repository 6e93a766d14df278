"""Chapter 4 (mixed precision): number formats and casts, DeepSpeed's own loss scaler driven on a CPU (pure and with
real gradients of the tiny model), what Liger's fused loss stores before the loss scale, the memory costs by
precision, the recorded fp16/bf16 H200 pair, the exercises."""
import math

import matplotlib
import pytest
import torch

from labs.course import fused_loss, loss_scaling, precision, precision_costs
from labs.course import precision_figures as figures
from labs.errors import LabsError

matplotlib.use("Agg")
FP16 = dict(enabled=True, loss_scale=0, initial_scale_power=16, loss_scale_window=1000, hysteresis=2,
            min_loss_scale=1)


# ------------------------------------------------------------------------------------------ formats
def test_formats_match_ieee_and_the_brain_float_layout():
    rows = {row["format"]: row for row in precision.format_rows()}
    assert (rows["fp16"]["exponent_bits"], rows["fp16"]["mantissa_bits"], rows["fp16"]["largest"]) == (5, 10, 65504)
    assert rows["fp16"]["smallest_subnormal"] == 2 ** -24 and rows["fp16"]["smallest_normal"] == 2 ** -14
    assert (rows["bf16"]["exponent_bits"], rows["bf16"]["mantissa_bits"]) == (8, 7)
    assert rows["bf16"]["smallest_normal"] == rows["fp32"]["smallest_normal"] == 2 ** -126
    assert rows["bf16"]["smallest_subnormal"] == 2 ** -133 and rows["fp32"]["smallest_subnormal"] == 2 ** -149
    assert rows["fp8-e4m3"]["largest"] == 448 and rows["fp8-e5m2"]["largest"] == 57344
    assert rows["fp8-e4m3"]["smallest_subnormal"] == 2 ** -9 and rows["fp8-e5m2"]["smallest_subnormal"] == 2 ** -16


def test_casts_round_to_nearest_even_overflow_and_underflow():
    assert precision.cast([65519, 65520, 2 ** -25, 2 ** -24], "fp16") == [65504, math.inf, 0, 2 ** -24]
    assert precision.cast([152064, 1 + 2 ** -8], "bf16") == [151552, 1]
    assert precision.cast([1 + 2 ** -8], "fp16") == [1 + 2 ** -8]
    assert precision.cast([1e6], "fp8-e4m3") == [448] and precision.cast([1e6], "fp8-e5m2") == [math.inf]
    assert precision.spacing(1.0, "bf16") == 2 ** -7 and precision.spacing(1.0, "fp16") == 2 ** -10
    assert precision.spacing(0.02, "bf16") == 2 ** -13


def test_relative_error_is_half_an_epsilon_in_the_normal_range():
    xs, errors = precision.relative_error("bf16", low=-3, high=3, points=500)
    assert max(errors) <= 2 ** -8 and max(errors) > 2 ** -10
    _, fp16_errors = precision.relative_error("fp16", low=-9, high=6, points=100)
    assert fp16_errors[0] == 1.0 and fp16_errors[-1] == math.inf         # 1e-9 underflows, 1e6 overflows


def test_unknown_format_is_a_one_line_labs_error():
    for call in (lambda: precision.dtype("fp12"), lambda: precision.cast([1.0], "int8"),
                 lambda: precision.describe("tf32")):
        with pytest.raises(LabsError, match="unknown number format") as error:
            call()
        assert "\n" not in str(error.value) and "fp16" in str(error.value)


@pytest.mark.parametrize("call, message", [
    (lambda: precision.softmax_denominator(0, "fp16"), "vocab must be a positive whole number, not 0"),
    (lambda: precision.logits_gradient(152064, 8192.5), "targets must be a positive whole number, not 8192.5"),
    (lambda: precision.drift(0.02, 1e-5, -1, "bf16"), "steps must be a positive whole number"),
    (lambda: precision.qwen_weight("qwen-70b"), "unknown preset 'qwen-70b'"),
])
def test_bad_sizes_and_presets_are_labs_errors(call, message):
    with pytest.raises(LabsError, match=message):
        call()


def test_updates_below_half_a_gap_vanish_unless_an_fp32_master_keeps_them():
    ones = torch.ones(1000)
    assert precision.update_lands(ones, 2 ** -10, "bf16") == 0.0      # half of bf16's gap above 1 is 2^-8
    assert precision.update_lands(ones, 2 ** -10, "fp16") == 1.0
    weight = precision.qwen_weight("tiny")
    assert weight.shape == (64, 64) and abs(float(weight.std()) - 0.02) < 0.003
    drift = precision.drift(0.02, 1e-5, 1000, "bf16")["rows"][-1]
    assert drift["alone"] == precision.cast([0.02], "bf16")[0]       # every update rounded away
    assert abs(drift["copy"] - 0.03) < precision.spacing(0.03, "bf16") and abs(drift["master"] - 0.03) < 1e-5


# ------------------------------------------------------------------------------------------ Qwen-scale range
def test_a_vocabulary_beyond_fp16s_range_overflows_the_softmax_but_not_in_bf16():
    fp16, bf16, fp32 = (precision.softmax_denominator(152064, name) for name in ("fp16", "bf16", "fp32"))
    assert fp16["denominator"] == math.inf and fp16["loss"] == math.inf
    assert bf16["denominator"] == 151552 and math.isfinite(bf16["loss"])
    assert abs(fp32["loss"] - math.log(152064)) < 1e-5
    assert precision.softmax_denominator(32000, "fp16")["denominator"] == 32000     # a 32k vocabulary fits


def test_logit_gradients_are_softmax_minus_one_hot_over_targets_and_underflow_in_fp16():
    vocab, targets = 152064, 8190
    grads = precision.logits_gradient(vocab, targets, rows=2)
    assert torch.allclose(grads[0, 1], torch.tensor(1 / (vocab * targets)), rtol=1e-4)
    assert torch.allclose(grads[0, 0], torch.tensor((1 / vocab - 1) / targets), rtol=1e-4)
    assert precision.flushed_to_zero(grads, "fp16") > 0.99
    at_scale = precision.range_shares(grads, "fp16", 2 ** 16)
    assert at_scale["flushed"] == 0.0 and at_scale["subnormal"] > 0.99     # alive, as subnormals
    assert precision.range_shares(grads, "bf16") == dict(flushed=0.0, subnormal=0.0, normal=1.0, overflowed=0.0)


def test_range_shares_are_exclusive_and_count_overflow():
    values = torch.tensor([2.0 ** -26, 2.0 ** -20, 1.0, 1e5, 0.0])     # flushed, subnormal, normal, inf; 0 ignored
    assert precision.range_shares(values, "fp16") == dict(flushed=0.25, subnormal=0.25, normal=0.25, overflowed=0.25)
    assert sum(precision.range_shares(torch.randn(1000) * 1e-5, "fp16", 3.0).values()) == pytest.approx(1.0)


def test_a_fused_loss_that_rounds_before_the_scale_flushes_what_the_scale_would_keep():
    found = fused_loss.gradients_before_the_scale("tiny", targets=8190, rows=2,
                                                  stored=(("fp16", 1.0), ("fp16", 2.0 ** 16), ("bf16", 1.0)))
    at_one, scaled, bf16 = found[("fp16", 1.0)], found[("fp16", 2.0 ** 16)], found[("bf16", 1.0)]
    assert at_one["flushed"] > 0.99 and scaled["flushed"] == 0.0 and bf16["flushed"] == 0.0
    assert at_one["flushed"] + at_one["subnormal"] + at_one["normal"] == pytest.approx(1.0)
    assert at_one["kept_per_token"] < 0.01 * 151935 < scaled["kept_per_token"]
    # the hidden states' gradient: subnormal and coarse at scale 1, precise once the scale comes first
    assert at_one["hidden_subnormal"] > 0.9 and scaled["hidden_subnormal"] < 0.1 and bf16["hidden_subnormal"] == 0.0
    assert scaled["hidden_error"] < bf16["hidden_error"] < at_one["hidden_error"]
    with pytest.raises(LabsError, match="a loss scale must be positive"):
        fused_loss.gradients_before_the_scale("tiny", stored=(("fp16", 0),))
    with pytest.raises(LabsError, match="whole number of rows"):
        fused_loss.gradients_before_the_scale("tiny", targets=2, rows=3)


def test_matmul_time_is_positive_milliseconds_and_leaves_the_thread_count_alone():
    threads = torch.get_num_threads()
    assert 0 < precision.matmul_ms("fp32", size=16, repeats=3) < 1000
    assert torch.get_num_threads() == threads
    with pytest.raises(LabsError, match="repeats must be a positive whole number"):
        precision.matmul_ms("fp16", repeats=0)


def test_spread_logits_match_the_initial_loss_and_spread_their_gradients():
    std = precision.initial_logit_std("qwen2.5-7b")
    assert std == pytest.approx(0.02 * 3584 ** 0.5)
    logits = torch.randn(8, 152064, generator=torch.Generator().manual_seed(1)) * std
    log_denominator = float(torch.logsumexp(logits, dim=-1).mean())      # the loss minus the target's logit (mean 0)
    assert abs(log_denominator - precision.expected_initial_loss(152064, std)) < 0.02
    spread = precision.logits_gradient(152064, 8190, rows=2, std=std)
    shares = precision.range_shares(spread, "fp16", 2 ** 16)
    assert shares["flushed"] < 0.01 and 0.2 < shares["normal"] < 0.8       # wider than the all-zero case


def test_sums_are_added_in_fp32_but_a_16_bit_running_total_stalls():
    assert precision.sum_of_ones(30_000, "fp16") == 30_000
    assert precision.running_total("bf16") == 256 and precision.running_total("fp16") == 2048
    assert precision.running_total("fp32", limit=100) == 100                 # stops at the limit, no stall
    ends = {v: precision.softmax_denominator(v, "fp16")["loss"] for v in (65519, 65520)}
    assert math.isfinite(ends[65519]) and ends[65520] == math.inf


def test_a_layer_in_bf16_is_about_eight_times_less_precise_than_in_fp16():
    errors = precision.qwen_layer_update_errors("tiny", tokens=16)
    assert 0 < errors["fp16"] < errors["bf16"] and 4 < errors["bf16"] / errors["fp16"] < 16


# ------------------------------------------------------------------------------------------ DeepSpeed's scaler
def test_the_scaler_is_deepspeeds_own_built_from_the_config_section():
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler

    scaler = loss_scaling.deepspeed_scaler(dict(FP16, initial_scale_power=12, loss_scale_window=7, hysteresis=3))
    assert type(scaler) is DynamicLossScaler
    assert (scaler.cur_scale, scaler.scale_window, scaler.delayed_shift, scaler.min_scale) == (2 ** 12, 7, 3, 1)
    static = loss_scaling.deepspeed_scaler(dict(FP16, loss_scale=128))
    assert type(static) is LossScaler and static.loss_scale == 128


def test_hysteresis_halving_and_regrowth_follow_deepspeeds_rule():
    scaler = loss_scaling.deepspeed_scaler(dict(FP16, loss_scale_window=4))
    history = loss_scaling.drive(scaler, [False, True, False, True] + [False] * 10)
    scales = [row["scale"] for row in history]
    assert scales[:4] == [2 ** 16] * 4                    # the first overflow (step 2) only uses up hysteresis
    assert history[1]["hysteresis"] == 1 and history[3]["next_scale"] == 2 ** 15
    assert scales[4:9] == [2 ** 15] * 5                   # window + 1 steps at the halved scale
    assert scales[9:13] == [2 ** 16] * 4 and scales[13] == 2 ** 17     # then it doubles every window
    assert history[8]["hysteresis"] == 2                  # growing refills the hysteresis


def test_an_overflow_at_the_minimum_scale_stops_the_run():
    history = loss_scaling.drive(loss_scaling.deepspeed_scaler(dict(FP16, initial_scale_power=3, hysteresis=1)),
                                 [True] * 10)
    assert [row["scale"] for row in history] == [8, 4, 2, 1]
    assert history[-1]["stopped"] and "minimum" in history[-1]["message"]


@pytest.mark.parametrize("section, key", [
    (dict(FP16, enabled=False), "fp16.enabled"),
    ({"loss_scale": 0}, "fp16.enabled"),
    (dict(FP16, loss_scale_window=0), "fp16"),
    (dict(FP16, hysteresis="two"), "fp16.hysteresis"),
    (dict(FP16, loss_scale=-1), "fp16.loss_scale"),
])
def test_bad_fp16_sections_are_one_line_labs_errors(section, key):
    with pytest.raises(LabsError) as error:
        loss_scaling.deepspeed_scaler(section)
    message = str(error.value)
    assert message.startswith(f"config key '{key}") and "\n" not in message


def test_real_gradients_an_injected_overflow_skips_the_step_and_deepspeed_logs_it(capsys):
    out = loss_scaling.train_steps(dict(FP16, loss_scale_window=2), steps=5, spikes=(2,), seq_len=32, progress=True)
    assert capsys.readouterr().out == "..... 5 steps\n"
    records = out["records"]
    assert records[1]["probe_loss"] == records[0]["probe_loss"]             # a skipped step leaves the model as is
    assert records[-1]["probe_loss"] < records[0]["probe_loss"]
    assert [r["overflow"] for r in records] == [False, True, False, False, False]
    assert [r["weights_changed"] for r in records] == [True, False, True, True, True]
    assert [r["scale"] for r in records] == [2 ** 16] * 5 and records[-1]["next_scale"] == 2 ** 17
    assert all(0 < r["largest_scaled_grad"] < 65504 for r in records)
    assert len(out["log"]) == 1 and "OVERFLOW" in out["log"][0] and "Reducing hysteresis to 1" in out["log"][0]
    assert all(math.isfinite(r["loss"]) for r in records)


def test_first_gradients_need_the_loss_scale_in_fp16():
    grads = loss_scaling.first_gradients(seq_len=32)
    assert set(grads) == {"embedding", "rest"} and grads["embedding"].numel() > 90 * grads["rest"].numel()
    at_one, at_scale = (precision.range_shares(grads["embedding"], "fp16", s) for s in (1, 2 ** 16))
    assert at_one["normal"] < 0.5 and at_scale["normal"] > 0.99


def test_the_steady_state_skips_hysteresis_steps_per_window_plus_one():
    for window, hysteresis in ((10, 2), (7, 3)):
        history = loss_scaling.steady_state(dict(FP16, loss_scale_window=window, hysteresis=hysteresis),
                                            limit=2 ** 14, steps=80)
        cycle = loss_scaling.last_cycle(history)
        assert (cycle["clean"], cycle["skipped"]) == (window + 1, hysteresis)
        assert max(r["scale"] for r in history[20:]) == 2 ** 15 and min(r["scale"] for r in history[20:]) == 2 ** 14
    with pytest.raises(LabsError, match="run more steps"):
        loss_scaling.last_cycle(loss_scaling.steady_state(FP16, limit=2 ** 14, steps=10))


def test_without_a_gpu_the_fp16_engine_is_refused_before_anything_runs(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a GPU host runs the real engine")
    from labs import config

    run, why = loss_scaling.engine_run(config.load("zero3.json"), tmp_path / "run", steps=2)
    assert run is None and why == "no GPU here"
    fp16 = config.variant(config.load("zero3.json"), {"bf16": None, "fp16": FP16})
    run, why = loss_scaling.engine_run(fp16, tmp_path / "run", steps=2)
    assert run is None and why.startswith("config key 'fp16.enabled'") and not any(tmp_path.iterdir())
    # labs' rule, not DeepSpeed's: DeepSpeed's CPU accelerator allows fp16 where oneDNN supports it
    assert loss_scaling.deepspeed_fp16_support() == ("cpu", bool(torch.ops.mkldnn._is_mkldnn_fp16_supported()))


# ------------------------------------------------------------------------------------------ costs and records
def test_bytes_per_parameter_by_precision_and_stage():
    zero0 = {r["precision"]: r for r in precision_costs.bytes_per_parameter(stage=0)}
    zero3 = {r["precision"]: r for r in precision_costs.bytes_per_parameter(stage=3)}
    assert [zero0[p]["total"] for p in ("fp32", "fp16", "bf16")] == [16, 16, 16]
    assert (zero0["bf16"]["params"], zero0["bf16"]["grads"], zero0["bf16"]["optimizer"]) == (2, 2, 12)
    assert round(zero3["fp32"]["total"]) == 20 and round(zero3["bf16"]["total"]) == 16


def test_compared_says_less_more_or_the_same():
    assert precision_costs.compared(66, 100) == "34% less" and precision_costs.compared(108.5, 100) == "8% more"
    assert precision_costs.compared(99.99, 100) == "the same"
    with pytest.raises(LabsError, match="a baseline must be positive"):
        precision_costs.compared(1, 0)


def test_the_recorded_pair_is_run_e_in_both_formats():
    bf16, fp16 = precision_costs.recorded_pair()
    assert (bf16["precision"], fp16["precision"]) == ("bf16", "fp16") and bf16["run"] == fp16["run"]
    for key in ("preset", "gpus", "micro_batch", "seq_len", "loss", "kernels", "checkpointing"):
        assert bf16[key] == fp16[key], key
    assert fp16["ds_config"]["fp16"]["loss_scale"] == 0 and "fp16" not in bf16["ds_config"]
    assert bf16["timing"] == "median of steps 3-6" and bf16["peak_tflops"] == 989
    assert bf16["reserved_gib"] > bf16["peak_gib"] and bf16["mfu_causal"] < bf16["mfu"]
    assert all(math.isfinite(n) for n in precision_costs.recorded_grad_norms("fp16"))
    with pytest.raises(LabsError, match="unknown recorded precision 'fp8'"):
        precision_costs.recorded_grad_norms("fp8")


def test_peak_by_precision_halves_activations_and_fp32_does_not_fit_run_e():
    bf16, _ = precision_costs.recorded_pair()
    rows = {r["precision"]: r for r in precision_costs.peak_rows(bf16, measured={"bf16": bf16["peak_gib"]})}
    # fp32 activations are twice bf16's (only the int64 token ids keep their size)
    assert rows["fp32"]["activations"] == pytest.approx(2 * rows["bf16"]["activations"], rel=1e-3)
    assert rows["fp16"]["peak"] == rows["bf16"]["peak"] and not rows["fp32"]["fits"] and rows["bf16"]["fits"]
    assert abs(rows["bf16"]["measured"] / rows["bf16"]["peak"] - 1) < 0.10
    assert "does not fit" in str(precision_costs.fp32_advice(bf16))
    fitting = {r["precision"]: r for r in precision_costs.peak_rows(precision_costs.fp32_fitting_row(bf16))}
    assert fitting["fp32"]["fits"] and fitting["bf16"]["peak"] < rows["bf16"]["peak"]
    with pytest.raises(LabsError, match="unknown precision"):
        precision_costs.estimate_like(bf16, "fp64")


def test_the_figures_draw():
    import matplotlib.pyplot as plt

    records = [dict(step=s, scale=2.0 ** (16 - s // 3), overflow=s == 2, hysteresis=2, loss=10.0 - s)
               for s in range(1, 11)]
    ax = figures.loss_scale_history(records)
    ax.figure.canvas.draw()
    assert all(float(t).is_integer() for t in ax.get_xticks()) and all(float(t).is_integer() for t in ax.get_yticks())
    figures.format_ranges(precision.format_rows(), marks={"x": 1.0})
    figures.rounding_error({"fp16": precision.relative_error("fp16", points=50)})
    figures.weight_drift(precision.drift(0.02, 1e-5, 10, "bf16"))
    figures.gradients_vs_fp16(torch.tensor([1e-6, 1e-3, 0.0]), 2 ** -24, 2 ** -14, 65504)
    figures.gradients_vs_fp16({"a": torch.tensor([1e-6, 1e-3]), "b": torch.tensor([1e-2])}, 2 ** -24, 2 ** -14, 65504)
    figures.memory_by_precision({"bf16": {"params": 1.0, "activations": 2.0}}, measured={"bf16": 3.5},
                                reserved={"bf16": 4.0})
    plt.close("all")


# ------------------------------------------------------------------------------------------ exercises
@pytest.mark.parametrize("id, right, wrong", [
    ("04.1", 2048, 256),                 # fp16's 11 significant bits, not bf16's 8
    ("04.2", 18, 17),
    ("04.3", 21, 11),                    # 6 on the way down (2 use up hysteresis), then 3 per try, not 1
    ("04.4", 1.0, 0.99),                 # every update rounded away, not 100 of them applied
    ("04.5", "smaller", "larger"),
])
def test_chapter_4_checkers_accept_the_answer_and_reject_others(id, right, wrong, capsys):
    from labs.course import exercises

    assert exercises.check(id, None) is False and "not answered yet" in capsys.readouterr().out
    assert exercises.check(id, right) is True and capsys.readouterr().out.startswith(f"{id} correct")
    assert exercises.check(id, wrong) is False and capsys.readouterr().out.startswith(f"{id} not yet")


def test_the_questions_wrap_to_a_width_and_keep_every_word(capsys):
    from labs.course import exercises

    exercises.show("04")
    one_line = capsys.readouterr().out
    exercises.show("04", width=116)
    wrapped = capsys.readouterr().out
    assert max(map(len, one_line.splitlines())) > 116 >= max(map(len, wrapped.splitlines()))
    assert one_line.split() == wrapped.split() and len(one_line.splitlines()) == 5


def test_bf16_saves_less_with_full_checkpointing_on_8_gpus_than_on_run_e():
    from labs.course.exercises import ch04

    assert 20 < ch04.bf16_saving_percent() < ch04.run_e_saving_percent() < 40
