"""labs bench on CPU (tiny preset), and checks of the committed GPU results."""
import json
import tempfile

import pytest

from conftest import run_labs
from labs import memory
from labs.bench import results
from labs.errors import LabsError


def test_bench_runs_stock_and_labs_in_one_invocation(tmp_path):
    out = tmp_path / "bench.json"
    result = run_labs("bench", "--preset", "tiny", "--cases", "stock-zero3,labs-zero3", "--steps", 3, "--out", out,
                      "--work", tmp_path / "work", "--quiet")
    assert result.returncode == 0, result.stderr[-3000:]
    bench = json.loads(out.read_text())
    for key in ("date", "command", "host", "mfu_formula", "timing"):
        assert bench[key], key
    assert {"torch", "deepspeed", "transformers", "python"} <= set(bench["host"])
    for case in ("stock-zero3", "labs-zero3"):
        entry = bench["cases"][case]
        assert entry["status"] == "ok" and entry["ds_config"]["zero_optimization"]["stage"] == 3
        assert entry["timers_ms"]["fwd"] > 0          # DeepSpeed's wall_clock_breakdown reached the result
    assert bench["cases"]["stock-zero3"]["summary"]["activation_checkpointing"] == "full"
    assert bench["cases"]["labs-zero3"]["summary"]["loss"] == "chunked"     # no Triton here: labs' chunked loss
    assert "labs-zero3 / stock-zero3" in bench["ratios"]
    assert "ratio labs-zero3 / stock-zero3" in result.stdout


def test_unknown_case_is_one_clear_error(tmp_path):
    result = run_labs("bench", "--preset", "tiny", "--cases", "warp-drive", "--out", tmp_path / "x.json")
    assert result.returncode == 2 and "unknown bench case 'warp-drive'" in result.stderr
    assert not (tmp_path / "x.json").exists()


@pytest.mark.parametrize("where, message", [
    (dict(out="/proc/labs-bench.json"), "--out '/proc/labs-bench.json': cannot write there"),
    (dict(out="."), "--out '.' is a folder; name the JSON file to write"),
    (dict(work="/proc/labs-bench"), "--work '/proc/labs-bench': cannot write there"),
    (dict(out="notes.json"), "--out 'notes.json' exists and is not a labs bench result"),
    (dict(out="link.json"), "--out 'link.json': cannot write there"),
])
def test_a_result_file_or_work_folder_that_cannot_be_written_is_refused_before_any_case(where, message,
                                                                                          monkeypatch, tmp_path):
    """The result file was first written after the first case had run (minutes of GPU time, then a traceback).
    /proc refuses files even to root, whom access() lets through."""
    from labs import launch
    from labs.bench import runner

    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.json").write_text('{"mine": true}')
    (tmp_path / "link.json").symlink_to("/proc/labs-bench/r.json")     # a link to where nothing can be written
    made = {"notes.json", "link.json"}
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))    # where the default work folder is made
    monkeypatch.setattr(launch, "run", lambda **_: pytest.fail("a case ran"))
    with pytest.raises(LabsError, match=message):
        runner.run_cases(["stock-zero3"], preset="tiny", steps=3, **where)
    assert {p.name for p in tmp_path.iterdir()} == made and (tmp_path / "notes.json").read_text() == '{"mine": true}'


def test_offload_variants_change_one_lever_each():
    """offloadhalf and nvme differ from `offload` in the optimizer's placement only (ZeRO-3: ratio, device)."""
    from labs import CONFIGS
    from labs.bench.cases import compose
    base = json.loads((CONFIGS / compose("labs-zero3-offload-mb8")[1]["config"]).read_text())
    for option, changed in (("offloadhalf", {"ratio": 0.5}),
                            ("nvme", {"device": "nvme", "nvme_path": "/tmp/labs-nvme", "buffer_count": 4})):
        config = json.loads((CONFIGS / compose(f"labs-zero3-{option}-mb8")[1]["config"]).read_text())
        offload = config["zero_optimization"].pop("offload_optimizer")
        assert offload == {**base["zero_optimization"]["offload_optimizer"], **changed}
        config.pop("aio", None)
        assert config == {**base, "zero_optimization": {k: v for k, v in base["zero_optimization"].items()
                                                          if k != "offload_optimizer"}}
    with pytest.raises(LabsError, match="nvme is defined for labs with zero3"):
        compose("labs-zero2-nvme")
    for side in ("labs", "stock"):      # offloadall: the parameters follow the optimizer to the host, nothing else
        one = json.loads((CONFIGS / compose(f"{side}-zero3-offload-mb1")[1]["config"]).read_text())
        both = json.loads((CONFIGS / compose(f"{side}-zero3-offloadall-mb1")[1]["config"]).read_text())
        estimate = memory.estimate("qwen2.5-7b", gpus_per_node=2, ds_config=both)
        assert both["zero_optimization"].pop("offload_param") == one["zero_optimization"]["offload_optimizer"]
        assert both == one
        assert estimate.inputs["offload_param"] == "cpu" and estimate.params_per_gpu_bytes < 2**30


def test_stage_only_is_the_autotuners_zero_block_and_nothing_else():
    """stageonly keeps labs' config but cuts zero_optimization to its stage: what DeepSpeed's autotuner (fast mode)
    runs each candidate with (labs.bench.autotune.tuner_config + the autotuner's run_tuning_micro_batch_sizes)."""
    from labs import CONFIGS
    from labs.bench.cases import compose
    for stage in (2, 3):
        base = json.loads((CONFIGS / compose(f"labs-zero{stage}-mb4")[1]["config"]).read_text())
        cut = json.loads((CONFIGS / compose(f"labs-zero{stage}-stageonly-mb4")[1]["config"]).read_text())
        assert cut == {**base, "zero_optimization": {"stage": stage}} and len(base["zero_optimization"]) > 1
    base = json.loads((CONFIGS / compose("stock-zero2-mb8")[1]["config"]).read_text())
    cut = json.loads((CONFIGS / compose("stock-zero2-stageonly-mb8")[1]["config"]).read_text())
    assert cut == {**base, "zero_optimization": {"stage": 2}}


RECORDED = results.load_all()


@pytest.mark.parametrize("run", sorted(RECORDED))
def test_recorded_results_have_provenance(run):
    bench = RECORDED[run]
    assert bench["host"]["gpus"] and bench["host"]["driver"] and bench["host"]["deepspeed"]
    assert bench["date"].startswith("2026-") and "bench" in bench["command"]
    for entry in bench["cases"].values():
        if entry["status"] == "ok":
            assert entry["ds_config"] and len(entry["metrics"]) == entry["summary"]["steps"]


def test_valid_zero3_runs_compute_the_same_losses_as_stock():
    """Every labs ZeRO-3 case marked valid trains the same model on the same tokens as stock, so its per-step
    loss must match stock's to bf16 noise; the cases marked invalid are exactly those that did not."""
    table = results.rows(RECORDED, valid_only=False)
    checked = 0
    for row in table:
        stock = [r for r in table if r["run"] == row["run"] and r["case"] == "stock-zero3"]
        if not stock or row["engine"] != "deepspeed" or row["stage"] != 3 or row["precision"] != "bf16" \
                or row["tokens_per_step"] != stock[0]["tokens_per_step"] or row["case"] == "stock-zero3":
            continue
        gap = max(abs(a - b) for a, b in zip(row["losses"], stock[0]["losses"]))
        valid = RECORDED[row["run"]]["cases"][row["case"]]["valid"]
        assert (gap < 0.01) == valid, (row["run"], row["case"], gap)
        checked += 1
    assert checked >= 6


def test_memory_model_predicts_every_recorded_gpu_peak_within_10_percent():
    """Every bf16/fp16 case; float8 training (torchao) keeps fp8 casts labs.memory does not model, so its cases are
    left out (they are labelled as a different numeric recipe wherever they are shown)."""
    for row in (r for r in results.rows(RECORDED) if not r["fp8"]):
        predicted = results.predicted_peak_gib(row)
        assert abs(predicted / row["peak_gib"] - 1) <= 0.10, (row["run"], row["case"], predicted, row["peak_gib"])


def test_sweep_candidates_cover_every_cut_of_the_batch_and_keep_the_batch():
    from labs.bench import sweep

    names = sweep.candidates("labs", batch_per_gpu=8, layers=28, engines=("zero3",))
    assert len(names) == 5 * 4 and all(int(n.split("-mb")[1].split("-")[0]) * int(n.split("-ga")[1]) == 8 for n in names)
    stock = sweep.candidates("stock", batch_per_gpu=4, layers=28)
    assert {n.split("-")[2] for n in stock} == {"ckfull", "cknone"}         # stock has one flag: HF checkpointing
    different = {"cases": {"stock-zero3": {"status": "ok", "summary": {"tokens_per_step": 1, "tokens_per_s_per_gpu": 1,
                                                                       "peak_memory_bytes": [1]}},
                           "labs-zero3": {"status": "ok", "summary": {"tokens_per_step": 2, "tokens_per_s_per_gpu": 2,
                                                                      "peak_memory_bytes": [1]}}}}
    with pytest.raises(AssertionError, match="different tokens per optimizer step"):
        sweep.best_vs_best(different)
    assert sweep.best_vs_best(different, tokens_per_step=2)["ratio"] is None      # one side alone: no ratio


def test_recorded_sweeps_compare_like_for_like():
    """Each recorded sweep: every case at the sweep's tokens per optimizer step, both sides measured, and the ratio
    its result states is the ratio of the two best measured cases."""
    from labs.bench import sweep

    sweeps = {run: r for run, r in RECORDED.items() if "sweep" in r}
    assert sweeps
    for run, result in sweeps.items():
        again = sweep.best_vs_best(result, tokens_per_step=result["sweep"]["tokens_per_step"])
        assert again["ratio"] == pytest.approx(result["sweep"]["ratio"]) and again["ratio"] > 1, run
        assert {r["tokens_per_step"] for r in again["rows"]} == {result["sweep"]["tokens_per_step"]}


def test_planner_fits_the_recorded_runs():
    from labs.bench import planner

    model = planner.fit(results.rows(RECORDED))
    assert model["rms_relative_error"] < 0.08 and model["rows"] >= 15
    plans = planner.plan(gpu_memory="H100", batch_per_gpu=8)
    assert plans and all(p["predicted_peak_gib"] * 2**30 <= results.memory.usable_bytes("H100") for p in plans)


def test_readme_quotes_the_recorded_round_2_numbers():
    """The README's H200 table is typed prose: every figure in it must be what chapters 9 and 10 compute from
    results/gpu."""
    from conftest import ROOT
    from labs.course import gpu_report as g

    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("## Measured on H200"):]
    sweep = (g.best(g.RUNS["sweep"], "stock"), g.best(g.RUNS["sweep"], "labs"))
    cap = (g.best(g.RUNS["cap"], "stock"), g.best(g.RUNS["cap"], "labs"))
    fp8 = {r["case"]: r for r in g.case_rows(g.RUNS["fp8_vs_stock"])}
    fp8_labs, fp8_stock = fp8["labs-fsdp2-cknone-mb4-ga2-fp8-compile"], fp8["stock-fsdp2-cknone-mb2-ga4"]
    expected = [f"{sweep[0]['tokens_per_s_per_gpu']:,.0f}", f"{sweep[1]['tokens_per_s_per_gpu']:,.0f}",
                f"{sweep[1]['tokens_per_s_per_gpu'] / sweep[0]['tokens_per_s_per_gpu']:.2f}x",
                f"{sweep[1]['mfu']:.1%} ({sweep[1]['mfu_causal']:.1%})",
                f"{cap[0]['tokens_per_s_per_gpu']:,.0f}", f"{cap[1]['tokens_per_s_per_gpu']:,.0f}",
                f"{cap[1]['tokens_per_s_per_gpu'] / cap[0]['tokens_per_s_per_gpu']:.2f}x",
                f"{cap[1]['mfu']:.1%} ({cap[1]['mfu_causal']:.1%})",
                f"{fp8_stock['tokens_per_s_per_gpu']:,.0f}", f"{fp8_labs['tokens_per_s_per_gpu']:,.0f}",
                f"{fp8_labs['tokens_per_s_per_gpu'] / fp8_stock['tokens_per_s_per_gpu']:.2f}x", f"{fp8_labs['mfu']:.1%}"]
    hidden_labs = g.best(g.RUNS["offload"], "labs", offload=True)
    hidden = hidden_labs["tokens_per_s_per_gpu"] / {r["case"]: r for r in g.case_rows(g.RUNS["offload"])}[
        g.OFFLOAD_REFERENCE]["tokens_per_s_per_gpu"]
    ratio_n, off_labs, off_stock = g.offload_ratio(g.RUNS["offload_stock"])
    ratio_m = g.offload_ratio(g.RUNS["offload"])[0]
    expected += [f"{off_stock['tokens_per_s_per_gpu']:,.0f}", f"{off_labs['tokens_per_s_per_gpu']:,.0f}",
                 f"| {ratio_n:.2f}x (run m: {ratio_m:.2f}x;", f"was {ratio_m:.2f}x behind labs",
                 f"{off_labs['mfu']:.1%} ({off_labs['mfu_causal']:.1%})", f"at {hidden:.0%} of labs without"]
    round5 = g.round5_rows()
    p = {r["case"]: r for r in round5 if r["run"] == "p"}
    q = {r["case"]: r for r in round5 if r["run"] == "q"}
    t = {r["threads"]: r["tokens_per_s_per_gpu"] for r in round5 if "threads" in r}
    none, full, half = (p[f"labs-zero3-{c}-gpus1"] for c in ("mb4-ga2", "offload-mb8", "offloadhalf-mb8"))
    half_row = results.find(results.rows(RECORDED), g.RUNS["ratio"], half["case"])
    expected += [f"runs {half['tokens_per_s_per_gpu'] / full['tokens_per_s_per_gpu']:.2f}x ZeRO-3 full offload",
                 f"reaches {half['tokens_per_s_per_gpu'] / none['tokens_per_s_per_gpu']:.0%} of",
                 f"({results.estimate_for(half_row).total_per_gpu_bytes / 2**30:.1f} GiB against {half['peak_gib']:.1f}",
                 f"runs at {q['labs-zero3-nvme-mb8-gpus1']['tokens_per_s_per_gpu'] / q['labs-zero3-offload-mb8-gpus1']['tokens_per_s_per_gpu']:.3f}x",
                 f"runs {t[16] / t[8]:.2f}x 8 threads and {t[16] / t[4]:.2f}x 4"]
    from labs.course import autotune_report as ar
    s_run, (t_rows, u_rows, w_rows) = ar.found(ar.LABS_RUN), (ar.bench_rows(n) for n in ("neighbours", "repeat", "best"))
    pick, cut, stock = ("labs-fsdp2-cknone-mb4-ga2-gpus1", "labs-zero2-stageonly-cknone-mb4-ga2-gpus1",
                        "stock-zero2-stageonly-ckfull-mb8-ga1-gpus1")
    expected += [f"four candidates ({s_run['seconds']:.0f} s", f"ran {t_rows[pick]['tokens_per_s_per_gpu'] / t_rows[cut]['tokens_per_s_per_gpu']:.3f}x",
                 f"({u_rows[pick]['tokens_per_s_per_gpu'] / u_rows[cut]['tokens_per_s_per_gpu']:.3f}x and "
                 f"{w_rows[pick]['tokens_per_s_per_gpu'] / w_rows[cut]['tokens_per_s_per_gpu']:.3f}x",
                 f"pick ran {w_rows[pick]['tokens_per_s_per_gpu'] / w_rows[stock]['tokens_per_s_per_gpu']:.2f}x in one"]
    assert len(s_run["experiments"]) == 4 and s_run["pick"] == "z2_gas2_tmbspg4"
    from labs.course import zenflow_report as zr
    t14 = zr.round14_target()
    expected += [f"at update interval 4 it runs at {t14['hidden']['ft_zf']:.1%} of no",
                 f"is {t14['gaps']['ft_zf']:.2f} nats above", f"interval 2 runs at {t14['hidden']['ft_zf_ui2']:.1%},",
                 f"{t14['gaps']['ft_zf_ui2']:.2f} above;", f"interval 8 runs at {t14['hidden']['ft_zf_ui8']:.1%},",
                 f"{t14['gaps']['ft_zf_ui8']:.2f} above, but no full update"]
    assert t14["landed"]["ft_zf_ui8"] == []
    t15 = zr.round15_target()
    expected += [f"interval 2 is {t15['gaps']['ft_zf_ui2_64']:.2f} nats above", f"interval 4 {t15['gaps']['ft_zf64']:.2f} and",
                 f"interval 8 {t15['gaps']['ft_zf_ui8_64']:.2f}, with",
                 ", ".join(str(len(t15["landed"][n])) for n in ("ft_zf_ui2_64", "ft_zf64")) + f" and {len(t15['landed']['ft_zf_ui8_64'])} full"]
    t17 = zr.round17_target()
    expected += [f"interval 4 {t17['gaps']['ft_zf_sel4_64']:+.2f} nats against {t17['gaps']['ft_zf64']:+.2f} choosing once",
                 f"at {t17['hidden']['ft_zf_sel4_64']:.1%} of no", f"against {t17['hidden']['ft_zf64']:.1%}.",
                 f"control: {zr.refresh_memory('ctl_sel4_stock_sync')['least_available_gib']:.1f} GiB left)"]
    from labs.course import zenflow_columns_report as zc
    t18, peaks18 = zc.round18_target(), zc.peaks()
    extra18 = (peaks18["ft_zfc64"]["measured"] - peaks18["ft_zf64_ds"]["measured"]) / 2**30
    expected += [f"{extra18:.2f} GiB more on the 3B",
                 f"from {t18['gaps']['ft_zf64_ds']:+.2f} to {t18['gaps']['ft_zfc64']:+.2f} nats choosing once",
                 f"to {t18['gaps']['ft_zfc_sel4_64']:+.2f}", f"at {t18['hidden']['ft_zfc64']:.1%} and "
                 f"{t18['hidden']['ft_zfc_sel4_64']:.1%} of no", f"loss of about step {zc.caught_up('ft_zfc64')}."]
    from labs.course import zenflow_moments_report as zm
    t19, m19 = zm.round19_target(), zm.round19_moments()
    expected += [f"held {m19['ft_zfm64']['private_gib']:.1f} GiB", f"against {m19['ft_zfm64_ctl']['private_gib']:.1f} GiB",
                 f"`labs.memory`: {m19['ft_zfm64']['moments_gib']:.1f} and {m19['ft_zfm64_ctl']['moments_gib']:.1f} GiB of moments",
                 f"{t19['gaps']['ft_zfm64']:+.2f} nats against {t19['gaps']['ft_zfm64_ctl']:+.2f}",
                 f"({t19['hidden']['ft_zfm64']:.1%} and {t19['hidden']['ft_zfm64_ctl']:.1%})",
                 f"{t19['gaps']['ft_zfm_ui2_64']:+.2f} at {t19['hidden']['ft_zfm_ui2_64']:.1%}"]
    from labs.course import one_gpu_report as one
    for row in one.best_vs_best():
        expected += [f"{row['stock_tokens_per_s']:,.0f}", f"{row['labs_tokens_per_s']:,.0f}", f"{row['ratio']:.2f}x",
                     f"{row['mfu']:.1%} ({row['mfu_causal']:.1%})"]
        if row["repeat_ratio"]:
            expected.append(f"repeat {row['run']}2: {row['repeat_ratio']:.2f}x")
    expected.append(f"{one.eighty_gb()['corrected_cap']:.2f}x under the corrected cap")
    card = one.real_card()
    h100 = {r["case"]: r for r in card["cases"]}
    over = [r["over_capped"] for r in card["cases"] if r["over_capped"]]
    expected += [f"{h100[card['stock']]['h100']:,.0f}", f"{h100[card['labs']]['h100']:,.0f}", f"{card['ratio']:.2f}x",
                 f"stock first: {card['repeat_ratio']:.2f}x", f"{min(over):.3f}-{max(over):.3f}",
                 f"{card['failed'][0]['case'].split('-')[1].replace('zero', 'ZeRO-')} at 1 x 8"]
    h100_labs = g.best(one.REAL_CARD["sweep"], "labs")
    expected.append(f"{h100_labs['mfu']:.1%} ({h100_labs['mfu_causal']:.1%})")
    x_stock = g.best(one.SWEEPS["x"], "stock")
    expected += [f"ran {x_stock['tokens_per_s_per_gpu'] / w_rows[stock]['tokens_per_s_per_gpu']:.2f}x the autotuned pick",
                 f"labs gains {one.best_vs_best()[0]['ratio']:.2f}x"]
    assert all(p["pick_over_best"] >= 0.95 for s in one.SWEEPS.values() for p in g.planner_check(s))
    peaks = [r["ratio"] for r in results.peak_comparisons(merge_repeats=True)
             if r["case"] == "stock-zero2-cknone-mb2-ga4"]
    expected.append(f"measured\n{max(peaks):.3f}x its predicted peak in runs f and x")
    assert sorted(r["run"] for r in results.peak_comparisons() if r["case"] == "stock-zero2-cknone-mb2-ga4") == ["f", "x"]
    from labs.bench import offload_plan
    h100 = {r["setup"]: r for r in offload_plan.rows("qwen2.5-7b", cards=("H100",)) if r["batch"] == "8 x 1"}
    host_gib = g.result_file(g.RUNS["offload"])["host"]["host_memory_gib"]
    part = h100["ZeRO-3, part offloaded"]
    expected += [f"about {h100['plain offload']['host_gib']:.0f} GiB of host memory "
                 f"({h100['plain offload, native pinning']['host_gib']:.0f} with",
                 f"ZenFlow {h100['ZenFlow']['host_gib']:.0f} ({h100['ZenFlow, no overlap']['host_gib']:.0f} without its "
                 f"overlap), and ZeRO-3 with {part['offloaded']:.0%} of the",
                 f"offloaded {part['host_gib']:.0f}: only that one fits a {host_gib:.0f} GiB host"]
    assert [name for name, r in h100.items() if r["host_gib"] <= host_gib] == ["ZeRO-3, part offloaded"]
    from labs.course import one_card_7b, zenflow_verdict as zv
    ran = one_card_7b.rows()[0]
    runs23, equal23, both23 = zv.runs(), zv.equal_time(), zv.overlap_or_not()
    two_cards = next(r for r in g.recipes() if r["gpus"] == 2 and r["budget"].startswith("80"))
    expected += [f"{ran['tokens_per_s_per_gpu']:,.0f} tokens/s at {ran['batch']} with {ran['checkpointed']} of 28",
                 f"({ran['mfu']:.1%} MFU)", f"GPU peak {ran['gpu_gib']:.1f} GiB against {ran['predicted_gpu_gib']:.1f}",
                 f"host {ran['host_gib']:.1f} GiB against {ran['predicted_host_gib']:.1f}",
                 f"at {two_cards['labs_tokens_per_s'] / ran['tokens_per_s_per_gpu']:.1f}x that (run {two_cards['run']})",
                 f"({runs23['ft_off48']['gap']:+.3f} nats", f"at {runs23['ft_off48']['share']:.1%} of its speed",
                 f"(by {equal23['ft_zfm64']['zen_loss'] - equal23['ft_zfm64']['off_loss']:.2f} nats)",
                 f"(by {equal23['ft_zfs48']['zen_loss'] - equal23['ft_zfs48']['off_loss']:.2f})",
                 f"{runs23['ft_zfs48']['share']:.1%} of no offload's speed against {runs23['ft_zfm64']['share']:.1%}",
                 f"{runs23['ft_zfs48']['gap']:+.2f} nats against {runs23['ft_zfm64']['gap']:+.2f}",
                 f"{both23['overlapped_loss'] - both23['sequential_loss']:.2f} nats ahead"]
    from labs.course import cap_checks
    expected.append(f"reserved more than the {cap_checks.card_limit_gib():.1f} GiB a real H100 leaves PyTorch")
    missing = [figure for figure in expected if figure not in table]
    assert not missing, missing


def test_planner_scales_by_flops_per_sequence_and_keeps_its_ranking():
    """compute_scale is 1 where the model was fitted; for another preset every term scales alike, so the order of
    its candidates is the unscaled order, and the 3B predictions land near round 6's measurements (runs t, u, w)."""
    from labs.bench import planner
    from labs.course import autotune_report as ar
    assert planner.compute_scale("qwen2.5-7b", 4096) == 1.0
    assert planner.compute_scale("qwen2.5-3b", 2048) < planner.compute_scale("qwen2.5-3b", 4096) < 1.0
    coefficients = planner.fit(results.rows(RECORDED))["coefficients"]
    args = [("fsdp2", "liger", 4, 2, 0), ("zero2", "liger", 8, 1, 9), ("zero3", "stock", 2, 4, 36),
            ("zero2", "stock", 1, 8, 0)]
    orders = []
    for scale in (1.0, 0.47):
        steps = [planner.predict_step_seconds(coefficients, *a, layers=36, params=3_085_938_688, gpus=1, scale=scale)
                 for a in args]
        orders.append(sorted(range(len(args)), key=steps.__getitem__))
    assert orders[0] == orders[1]
    predicted = {p["case"]: p["predicted_tokens_per_s_per_gpu"] for p in planner.plan("qwen2.5-3b", gpus=1)}
    for name in ar.BENCH:
        for case, row in ar.bench_rows(name).items():
            ratio = predicted[case.replace("-gpus1", "").replace("stageonly-", "")] / row["tokens_per_s_per_gpu"]
            assert 0.9 < ratio < 1.1, (name, case, ratio)


def test_chapter_9s_recipes_are_labs_train_lines_that_run_the_measured_case():
    """gpu_report.recipes() prints, per setup, a `labs train` line for labs' best measured case: each must parse and
    pass labs' input checks (on this CPU: Liger swapped for the chunked loss and stock kernels, which need no GPU, and
    no memory check), with the case's engine, checkpointing, micro-batch and accumulation."""
    import shlex

    from labs import cli, launch, multinode
    from labs.course import gpu_report

    parser = cli._Parser(prog="labs")
    cli._train_args(parser.add_subparsers(dest="command", parser_class=cli._Parser))
    for recipe in gpu_report.recipes():
        line = recipe["command"].replace("--loss liger", "--loss chunked").replace("--kernels liger", "--kernels stock")
        assert line != recipe["command"], "labs' best is expected to use Liger"
        args = vars(parser.parse_args([*shlex.split(line)[1:], "--no-memory-check", "--out", "/nonexistent/x"]))
        spec, resolved = launch.inputs(**{k: v for k, v in args.items()
                                          if k not in ("command", "quiet", "slurm", "resume", *multinode.FLAGS)})
        side, engine, ck, mb, ga = recipe["labs"].split("-")
        assert (side, spec["engine"], spec["activation_checkpointing"], resolved["train_micro_batch_size_per_gpu"],
                resolved["gradient_accumulation_steps"], spec["nproc"]) == (
            "labs", engine, ck[2:], int(mb[2:]), int(ga[2:]), recipe["gpus"]), (recipe, spec)
