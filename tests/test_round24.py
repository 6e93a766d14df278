"""The GPU runs of 2026-12-06 on real H100s (rounds 24, 28, 29 and 30): labs.card_cap on the card it stands for (runs
y6, y6b), the 7B row of chapter 10 on the card (ZeRO-3, 70% of the optimizer offloaded) on two hosts, the parts of its
optimizer step, and a copy of the updated weights cast on the GPU that did not pay. Each test checks the readings
against the files and the READMEs' figures against the readings."""
import json

import pytest

from conftest import unquoted
from labs import RESULTS
from labs.course import one_card_7b, one_gpu_report
from labs.metrics import read_jsonl


def test_on_the_card_the_cap_changes_nothing():
    """On a real H100, card_cap's limit is what the card leaves the process: the case that failed without it (run y3)
    fails under it with the same figures, at a limit within 0.02 GiB of the card less what the rank held outside
    PyTorch; the cases that fit, fit both ways with the same peaks and speeds within 2%."""
    rows = {r["case"]: r for r in one_gpu_report.cap_on_real_card()}
    failed = [r for r in rows.values() if r["capped"] != "ok"]
    assert [r["case"] for r in failed] == ["stock-zero2-cknone-mb1-ga8"] and failed[0]["uncapped"] == "failed"
    f = failed[0]
    assert f["cap"] == pytest.approx(f["capacity"] - f["outside_pytorch"], abs=0.02)
    y3 = one_gpu_report.real_card()["failed"][0]
    assert (f["allocated"], f["requested"], f["reserved_unused"]) == (y3["allocated"], y3["requested"],
                                                                      y3["reserved_unused"])
    fit = [r for r in rows.values() if r["capped"] == "ok"]
    assert len(fit) == 2 and all(r["uncapped"] == "ok" and r["uncapped_run"] == "y6b" for r in fit)
    for r in fit:
        assert r["over_uncapped"] == pytest.approx(1, abs=0.02) and r["peak_gib"] == r["uncapped_peak_gib"]


def test_the_7b_on_real_h100s_holds_the_capped_h200s_memory_and_runs_at_its_hosts_pace():
    """Rounds 24 and 28: each split's GPU peak equals the capped H200's to the hundredth of a GiB, and forward plus
    backward at 8 x 1 agrees within 3% across the three hosts, while the optimizer step (CPU Adam) took at least 40%
    longer on round 28's host than on round 24's; on round 28's host, 8 x 1 ran faster than 4 x 2, as on the H200."""
    rows = one_card_7b.rows()
    capped = {r["batch"]: r for r in rows if r["round"] == 26}
    real = [r for r in rows if r["card"] == "H100"]
    assert {r["round"] for r in real} == {24, 28} and {r["offloaded"] for r in real} == {0.7}
    for r in real:
        assert r["gpu_gib"] == pytest.approx(capped[r["batch"]]["gpu_gib"], abs=0.01)
        assert r["gpu_gib"] == pytest.approx(r["predicted_gpu_gib"], rel=0.025)
        assert r["host_gib"] == pytest.approx(r["predicted_host_gib"], rel=0.05)
        assert r["fewest_checkpointed"] == capped[r["batch"]]["fewest_checkpointed"]
    at_8x1 = {r["round"]: r for r in rows if r["batch"] == "8 x 1"}
    work = [r["fwd_s"] + r["bwd_s"] for r in at_8x1.values()]
    assert max(work) / min(work) < 1.03
    assert at_8x1[28]["optimizer_step_s"] / at_8x1[24]["optimizer_step_s"] > 1.4
    r28 = {r["batch"]: r for r in real if r["round"] == 28}
    assert r28["8 x 1"]["tokens_per_s_per_gpu"] > r28["4 x 2"]["tokens_per_s_per_gpu"]
    a, b, c = at_8x1[24], at_8x1[28], r28["4 x 2"]
    figures = (f"GPU peaks {a['gpu_gib']:.2f} GiB at 8 x 1 and {c['gpu_gib']:.2f} at 4 x 2",
               f"against {a['predicted_gpu_gib']:.2f} and {c['predicted_gpu_gib']:.2f} predicted",
               f"held {a['host_gib']:.1f} GiB of host memory", f"against {a['predicted_host_gib']:.1f} predicted",
               f"Round 24 ran {a['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU at 8 x 1 ({a['mfu']:.1%} MFU with "
               f"full attention, {a['mfu_causal']:.1%} causal)",
               f"{b['tokens_per_s_per_gpu']:,.0f} at 8 x 1 and {c['tokens_per_s_per_gpu']:,.0f} at 4 x 2",
               f"took {a['fwd_s'] + a['bwd_s']:.2f} s at 8 x 1 in both rounds "
               f"({at_8x1[26]['fwd_s'] + at_8x1[26]['bwd_s']:.2f} on the capped H200)",
               f"took {a['optimizer_step_s']:.2f} s in round 24 and {b['optimizer_step_s']:.2f} s in round 28 "
               f"({at_8x1[26]['optimizer_step_s']:.2f} on the capped H200)")
    missing = unquoted(one_card_7b.H100 / "README.md", figures)
    assert not missing, missing
    assert round(b["fwd_s"] + b["bwd_s"], 2) == round(a["fwd_s"] + a["bwd_s"], 2)


def test_round_28_timed_cpu_adam_alone_and_recorded_its_host():
    """The CPU Adam benchmark ran with the 16 threads the host has, over 10^9 parameters; lscpu is recorded."""
    folder = one_card_7b.H100 / "round28"
    report = json.loads((folder / "cpu_adam_step.txt").read_text().splitlines()[-1])
    assert report["threads"] == int((folder / "nproc.txt").read_text()) == 16 and report["numel"] == 10**9
    assert "Model name:" in (folder / "cpu.txt").read_text()
    adam = one_card_7b.cpu_adam()
    assert adam["share"] < 0.5 and adam["seconds"] == report["median_s"]
    figures = (f"took {adam['seconds']:.3f} s per 10^9 parameters",
               f"over the {adam['offloaded_params'] / 1e9:.2f} B parameters",
               f"({adam['offloaded_params'] / adam['params']:.1%} of {adam['params'] / 1e9:.2f} B",
               f"about {adam['adam_s']:.2f} s of the step's {adam['optimizer_step_s']:.2f}")
    missing = unquoted(one_card_7b.H100 / "README.md", figures)
    assert not missing, missing


def test_results_readme_names_the_new_files():
    readme = (RESULTS / "README.md").read_text()
    for path in ("gpu/2026-12-06_y6_cap_on_card_3b_1xh100.json", "gpu/2026-12-06_y6b_no_cap_on_card_3b_1xh100.json",
                 "gpu/one_card_7b_1xh100/"):
        assert path in readme and (RESULTS / path).exists(), path


def test_readme_quotes_the_real_cards():
    """The README's figures for the 7B on real H100s and for runs y6 and y6b are the readings'."""
    at_8x1 = {r["round"]: r for r in one_card_7b.rows() if r["batch"] == "8 x 1" and r["card"] == "H100"}
    rows = {r["case"]: r for r in one_gpu_report.cap_on_real_card() if r["capped"] == "ok"}
    labs, stock = rows["labs-fsdp2-ck27-mb8-ga1"], rows["stock-fsdp2-cknone-mb1-ga8"]
    speeds = [f"{at_8x1[n]['tokens_per_s_per_gpu']:,.0f}" for n in (24, 28)]
    figures = (f"ran {speeds[0]} and {speeds[1]} tokens/s",
               f"took the same {at_8x1[24]['fwd_s'] + at_8x1[24]['bwd_s']:.2f} s on both",
               f"optimizer step {at_8x1[24]['optimizer_step_s']:.2f} s on one and "
               f"{at_8x1[28]['optimizer_step_s']:.2f} s on the other",
               f"{labs['tokens_per_s'] / stock['tokens_per_s']:.2f}x under `--gpu-memory H100`, "
               f"{labs['uncapped_tokens_per_s'] / stock['uncapped_tokens_per_s']:.2f}x without")
    missing = unquoted(RESULTS.parent / "README.md", figures)
    assert not missing, missing


def test_the_step_parts_and_the_copy_that_did_not_pay():
    """Round 29: the copy of the updated weights, cast on the CPU, is the step's largest part (over CPU Adam) and five
    times the same bytes copied without the cast; round 30: casting on the GPU from pageable masters gained nothing
    (within 5% either way), on one host, and the runs recorded which copy each used. The README's figures are these."""
    parts = one_card_7b.step_parts()
    per, scaled = parts["per_1e9"], parts["scaled"]
    assert scaled["copy_to_gpu_bf16"] > scaled["cpu_adam"] > scaled["grad_mul"]
    assert per["copy_to_gpu_bf16_s"] > 4 * per["copy_to_gpu_fp32_s"]
    assert parts["labs_over_deepspeed"] == pytest.approx(1, abs=0.05)
    recorded = {name: json.loads((one_card_7b.H100 / "round30" / name / "environment.json").read_text())
                for name in ("ds_copy", "labs_copy")}
    assert recorded["ds_copy"]["LABS_DEEPSPEED_OFFLOAD_COPY"] == "1" and \
        recorded["labs_copy"]["LABS_DEEPSPEED_OFFLOAD_COPY"] is None
    ab = parts["round30"]
    metrics = read_jsonl(one_card_7b.H100 / "round30" / "labs_copy" / "metrics.jsonl")
    steps = [m["timers_ms"]["step"] / 1e3 for m in metrics]
    figures = (f"Per 10^9 parameters: {per['grad_mul_s']:.3f} s for the gradients' unscale-and-clip pass, "
               f"{per['cpu_adam_s']:.3f} s for CPU Adam, {per['copy_to_gpu_bf16_s']:.3f} s for the copy",
               f"against {per['copy_to_gpu_fp32_s']:.3f} s for the same fp32 bytes",
               f"{parts['offloaded_params'] / 1e9:.2f} B offloaded parameters, that copy is about "
               f"{scaled['copy_to_gpu_bf16']:.1f} s",
               f"{ab['ds_copy']['tokens_per_s']:,.0f} tokens/s with DeepSpeed's copy, "
               f"{ab['labs_copy']['tokens_per_s']:,.0f} with labs'",
               f"({parts['labs_over_deepspeed']:.2f}x; the median optimizer step "
               f"{ab['ds_copy']['optimizer_step_s']:.2f} s against {ab['labs_copy']['optimizer_step_s']:.2f})",
               f"(its optimizer step {steps[2]:.2f} s at step 3, {steps[5]:.2f} at step 6)")
    missing = unquoted(one_card_7b.H100 / "README.md", figures)
    assert not missing, missing
