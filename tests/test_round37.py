"""Rounds 37 and 38, each on a fresh real H100 (2026-12-06): labs' one-card 7B row set to offload what stock's best
offloads (62.2% of the parameters, 27 layers checkpointed) and with labs' copy no longer waiting after each sub-group
(labs.offload_copy), beside stock's best setup and the same row waiting after each sub-group. Each test checks the
readings against the files, and the verdict's rule."""
import json

import pytest

from conftest import ROOT
from labs import config as config_lib, memory
from labs.course import offload_vs_stock, stock_search
from labs.course.one_card_runs import round_parts

ROUND37 = stock_search.H100 / "round37"


def test_the_committed_61_percent_config_is_the_one_round_37_ran():
    """bench/labs_zero3_offload_61.json is the config labs' row of round 37 was given, key for key: the 70% config with
    the share and the sub-group size changed, nothing else."""
    committed = json.loads((ROOT / "ds_configs" / "bench" / "labs_zero3_offload_61.json").read_text())
    assert committed == json.loads((ROUND37 / "labs_zero3_offload_61.json").read_text())
    seventy = config_lib.load("bench/labs_zero3_offload_70.json")
    seventy["zero_optimization"]["offload_optimizer"]["ratio"] = 0.61
    seventy["zero_optimization"]["sub_group_size"] = 200000000
    assert committed == seventy


def test_labs_row_searched_fits_where_labs_memory_says_and_the_fewer_offloaded_does_not():
    """labs.memory predicts the 62.2% row to fit an H100 with 3 GiB to spare (measured within 0.1 GiB), and the 60.1%
    row (0.57 of 3e8) with next to nothing: that run ran out of memory on the card, with 4.9 GiB held by PyTorch's
    allocator unused, which labs.memory does not model."""
    found = stock_search.rounds()["37"]
    row = found["labs"][0]
    assert (row["offloaded_params"], row["checkpointed"]) == (pytest.approx(0.622, abs=5e-4), "27")
    assert row["gpu_gib"] == pytest.approx(row["predicted_gpu_gib"], abs=0.1)
    assert row["predicted_gpu_gib"] < memory.usable_bytes("H100") / 2**30 - 2.5
    log = (ROUND37 / "labs57.job.log").read_text()
    assert "OutOfMemoryError" in log and "4.91 GiB is reserved by PyTorch but unallocated" in log


@pytest.mark.parametrize("round_name", ["37", "38"])
def test_the_overlap_alone_shortens_the_step_and_changes_no_loss(round_name):
    """The same row twice on one host, the copies overlapped (the default) and waiting after each sub-group
    (LABS_OFFLOAD_COPY=gpu-wait, recorded): the overlapped optimizer step is shorter by about a fifth of a second or
    more, the losses agree to GPU noise (as two runs of one setup do), and only the overlapped row clears 1.5x stock's
    run of the host."""
    found = stock_search.rounds()[round_name]
    overlapped, waited = found["labs"][0], found["others"][0]
    assert (overlapped["copy"], waited["copy"]) == ("labs' overlapped", "labs'")
    recorded = json.loads((stock_search.H100 / f"round{round_name}" / "labs61_wait" / "environment.json").read_text())
    assert recorded["LABS_OFFLOAD_COPY"] == "gpu-wait" and recorded["offload_copy"] == "gpu-wait"
    assert waited["optimizer_step_s"] - overlapped["optimizer_step_s"] > 0.15
    assert overlapped["tokens_per_s"] > 1.03 * waited["tokens_per_s"]
    assert max(abs(a - b) for a, b in zip(overlapped["losses"], waited["losses"], strict=True)) < 2e-3
    stock = found["best"]["tokens_per_s"]
    assert overlapped["tokens_per_s"] >= 1.5 * stock > waited["tokens_per_s"]


def test_rounds_37_and_38_cleared_the_line_and_round_39_put_the_same_row_under_it():
    """The 62.2% row was labs' row in rounds 37 and 38 and cleared 1.5x stock's best on both (the verdict then said
    met, narrowly); round 39's blind repeat put its slower run under 1.5x. Judged on that row the target would be not
    met; labs' row since is another (tests/test_round39.py), and these ratios are reported as an earlier row's."""
    found = stock_search.rounds()
    row = found["37"]["row"]
    assert found["38"]["row"] == row != found["39"]["row"]
    ratios = stock_search.row_ratios(found)[row]
    assert [n for n, _, _ in ratios][:3] == ["37", "38", "39"]        # round 41 ran it too, after labs' row
    assert all(ratio >= 1.5 for n, ratio, _ in ratios if n != "39") and dict((n, r) for n, r, _ in ratios)["39"] < 1.5
    assert all(u["estimated_tokens_per_s"] < found[u["round"]]["best"]["tokens_per_s"]
               for u in stock_search.unrun(found))
    assert offload_vs_stock.stock_best()["row"] != row


def test_round_38_ran_what_round_37_ran_and_the_parts_say_the_host_moves_cpu_adam():
    """Round 38 (another machine) ran round 37's configs, byte for byte, and timed the step's parts: CPU Adam per
    10^9 parameters took longer than on round 31's host of the same CPU model, the page-locked copy the same."""
    for name in ("labs_zero3_offload_61.json", "stock_z3_off0.61_sg2e8.json"):
        assert (ROUND37 / name).read_bytes() == (stock_search.H100 / "round38" / name).read_bytes()
    parts = {n: round_parts(n) for n in ("31", "38")}
    assert parts["38"]["cpu_adam_s"] > 1.1 * parts["31"]["cpu_adam_s"]
    assert parts["38"]["copy_to_gpu_fp32_registered_s"] == pytest.approx(parts["31"]["copy_to_gpu_fp32_registered_s"],
                                                                        rel=0.05)


def test_the_readmes_quote_rounds_37_and_38_as_read():
    """The project README's row and paragraph, and the results README, state rounds 37 and 38's speeds, ratios (the
    waiting row's too) and round 38's parts as the files give them."""
    from conftest import unquoted
    found = stock_search.rounds()
    r37, r38 = found["37"], found["38"]
    speeds = lambda key: " and ".join(f"{f[key]['tokens_per_s']:,.0f}" for f in (r37, r38))
    waited = [f["others"][0] for f in (r37, r38)]
    parts = {n: round_parts(n) for n in ("31", "42", "38")}           # round 42's host: the same CPU model
    figures = [f"labs {speeds('labs_slower')} tokens/s, stock's best {speeds('best')}",
               f"{r37['ratio']:.2f}x and {r38['ratio']:.2f}x",
               " and ".join(f"{w['tokens_per_s']:,.0f}" for w in waited),          # the row waiting per sub-group
               ", ".join(f"{w['tokens_per_s'] / f['best']['tokens_per_s']:.2f}x"
                         for w, f in zip(waited, (r37, r38))),
               f"{parts['31']['cpu_adam_s']:.3f}, {parts['42']['cpu_adam_s']:.3f} and {parts['38']['cpu_adam_s']:.3f} "
               "s per 10^9"]
    assert unquoted(ROOT / "README.md", figures) == []
    waited_speeds = " and ".join(f"{w['tokens_per_s']:,.0f}" for w in waited)
    results = f"wait {waited_speeds}, stock {speeds('best')}"
    assert unquoted(ROOT / "results" / "README.md", [results]) == []
