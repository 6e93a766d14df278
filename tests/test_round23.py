"""The GPU runs of 2026-12-06 (rounds 23 and 26, one H200) and what chapters 9 and 10 read from them: the measured
verdict (plain offload against ZenFlow at equal time), ZenFlow's start-up host, labs.card_cap against the real H100,
and the 7B on one GPU with an H100's memory. Each test checks the readings against the files and the READMEs'
figures against the readings."""
import json

import pytest

from conftest import unquoted
from labs import CONFIGS, RESULTS
from labs.course import one_card_7b, one_gpu_report, zenflow_report as z, zenflow_verdict as v


def test_round_23_repeats_round_19s_weights_and_plain_offload_trains_as_no_offload():
    """The verdict compares round 23's runs with round 19's overlapped ZenFlow: that holds only if the pipeline gave
    the same weights (pre-training and no offload within a few hundredths of a nat at every step) and every run
    starts from them at the same tokens per step; plain offload is the same Adam, so its losses follow no offload's."""
    gaps = v.repeat_gaps()
    assert gaps["pre-training"] < 0.02 and gaps["no offload"] < 0.05
    runs = v.runs()
    assert len({round(r["losses"][0], 6) for name, r in runs.items() if name != "ft_zfm64"}) == 1   # round 23's
    assert max(abs(a - b) for a, b in zip(runs["ft_off48"]["losses"], runs["ft_ref48"]["losses"])) < 0.05
    for name in ("ft_off48", "ft_zfs48"):
        summary = json.loads((v.ROUND23 / name / "summary.json").read_text())
        assert summary["tokens_per_step"] == 32768 and (summary["micro_batch"], summary["gradient_accumulation"]) == (8, 1)


def test_the_sequential_zenflow_config_is_the_one_round_23_ran():
    """The committed config the chapter's train line names differs from the overlapped one in overlap_step only, and
    its zenflow block is the one the run resolved."""
    overlapped = json.loads((CONFIGS / "bench" / "labs_zero2_offload_zenflow.json").read_text())
    sequential = json.loads((CONFIGS / "bench" / "labs_zero2_offload_zenflow_sequential.json").read_text())
    assert sequential["zero_optimization"]["zenflow"]["overlap_step"] is False
    sequential["zero_optimization"]["zenflow"]["overlap_step"] = True
    assert sequential == overlapped
    ran = json.loads((v.ROUND23 / "ft_zfs48" / "ds_config.json").read_text())["zero_optimization"]["zenflow"]
    assert ran == {**overlapped["zero_optimization"]["zenflow"], "overlap_step": False}


def test_equal_time_verdict_and_the_readme_hold_what_chapter_10_prints():
    """Plain offload is ahead of both ZenFlows at equal time (each ZenFlow's 48 steps are worth fewer of plain
    offload's than plain offload makes in that time); the sequential ZenFlow beats the overlapped one at equal time;
    the results README's table and prose are these numbers."""
    runs, equal, both = v.runs(), v.equal_time(), v.overlap_or_not()
    assert 0.45 < runs["ft_off48"]["share"] < 0.55 and abs(runs["ft_off48"]["gap"]) < 0.01
    for e in equal.values():
        assert e["worth"] < e["off_steps"] and e["off_loss"] < e["zen_loss"] and e["had"] < e["tie"]
    assert both["sequential_loss"] < both["overlapped_loss"]
    assert both["sequential_available_gib"] > both["overlapped_available_gib"]
    readme = (z.FINETUNE / "README.md").read_text().split("## Round 23")[1]
    for name in ("ft_off48", "ft_zfs48"):
        r = runs[name]
        assert f"| {r['label']} | {r['share']:.1%} | {r['gap']:+.{2 if name == 'ft_zfs48' else 3}f} |" in readme
    assert f"| ZenFlow, overlapped (round 19, its first 48 steps) | {runs['ft_zfm64']['share']:.1%} | " \
           f"{runs['ft_zfm64']['gap']:+.2f} |" in readme
    prose = " ".join(readme.split())
    seq, ovl = equal["ft_zfs48"], equal["ft_zfm64"]
    for figure in (f"plain offload makes {seq['off_steps']:.1f}, whose loss is {seq['zen_loss'] - seq['off_loss']:.2f} nats",
                   f"it makes {ovl['off_steps']:.1f}, {ovl['zen_loss'] - ovl['off_loss']:.2f} nats lower",
                   f"{both['overlapped_loss'] - both['sequential_loss']:.2f} nats ahead of the overlapped run",
                   f"({both['sequential_available_gib']:.1f} GiB available against {both['overlapped_available_gib']:.1f}"):
        assert figure in prose, figure


def test_zenflow_start_up_is_no_longer_the_hosts_tightest_second():
    """Round 19's start-up (pinned originals kept to the end) was the host's tightest second; round 23's, with each
    buffer given back as soon as it has moved, is not: its tightest second comes after the optimizer process started,
    and the training rank's shared memory never exceeds its training figure."""
    start = v.startup()
    r19, r23 = start["round 19"], start["round 23"]
    assert r19["least_second"] < r19["process_from_second"] and r19["extra_bytes_per_param"] > 5
    assert r23["least_second"] >= r23["process_from_second"] and r23["extra_bytes_per_param"] == 0
    assert r23["rank_shared_gib"] == pytest.approx(r23["rank_shared_running_gib"])
    assert r23["least_available_gib"] == pytest.approx(r19["least_available_running_gib"], abs=1.0)


def test_card_cap_reproduces_the_real_h100s_out_of_memory_case():
    """Run y5: under labs.card_cap an H200 fails the case the real H100 failed (and the plain cap let through), with
    the card's own figures, and fits the two the card fit."""
    rows = {r["case"]: r for r in one_gpu_report.cap_after_card_cap()}
    failed = rows.pop("stock-zero2-cknone-mb1-ga8")
    assert (failed["card_cap"], failed["real_card"], failed["plain_cap"]) == ("failed", "failed", "ok")
    card = one_gpu_report.real_card()["failed"][0]
    for key in ("allocated", "reserved_unused", "requested"):
        assert failed[key] == pytest.approx(card[key], abs=0.01)
    assert failed["cap"] == pytest.approx(card["capacity"] - card["outside_pytorch"], abs=0.02)
    assert all(r["card_cap"] == r["real_card"] == "ok" and r["over_real_card"] > 1 for r in rows.values())


def test_the_7b_on_one_80gb_card_ran_as_labs_memory_predicted_and_the_readme_says_so():
    """Round 26: the offload_plan row that fits a 126 GiB host, run under an H100 cap at three splits of the same
    tokens per step: GPU peaks within 2.5% of labs.memory, the host within 5%, the whole batch as one micro-batch
    fastest; the README's figures are these."""
    rows = [r for r in one_card_7b.rows() if r["round"] == 26]
    assert {r["tokens_per_step"] for r in rows} == {32768} and {r["offloaded"] for r in rows} == {0.7}
    for r in rows:
        assert r["gpu_gib"] == pytest.approx(r["predicted_gpu_gib"], rel=0.025)
        assert r["host_gib"] == pytest.approx(r["predicted_host_gib"], rel=0.05)
        assert r["reserved_gib"] < 81559 / 1024
    speeds = [r["tokens_per_s_per_gpu"] for r in rows]
    assert speeds == sorted(speeds, reverse=True)
    first = rows[0]
    figures = (f"{first['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU at 8 x 1 ({first['mfu']:.1%} MFU with full "
               f"attention, {first['mfu_causal']:.1%} causal)",
               ", ".join(f"{r['gpu_gib']:.1f}" for r in rows[:2]) + f" and {rows[2]['gpu_gib']:.1f} GiB against",
               f"{first['host_gib']:.1f} GiB of host memory", f"against {first['predicted_host_gib']:.1f} predicted",
               f"({', '.join(str(r['cache_flushes']) for r in rows[:2])} and {rows[2]['cache_flushes']} over")
    missing = unquoted(one_card_7b.H200 / "README.md", figures)
    assert not missing, missing


def test_results_readme_names_every_new_file():
    readme = (RESULTS / "README.md").read_text()
    for path in ("gpu/2026-12-06_y5_cap_fixed_3b_1xh200.json", "gpu/zenflow_finetune_1xh200/round23/",
                 "gpu/one_card_7b_1xh200/"):
        assert path in readme and (RESULTS / path).exists(), path
