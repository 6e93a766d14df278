"""Rounds 34 and 35 on real H100s (2026-12-06): stock's offload setups for the 7B on one card searched to the
smallest offloaded share labs.memory predicts to fit (labs.course.stock_search), against labs' row on the same host.
Each test checks the readings against the files, the search against labs.memory, and the results README's figures
against the readings."""
import json

import pytest

from conftest import ROOT, unquoted
from labs import memory
from labs.course import offload_vs_stock, stock_search

README = stock_search.H100 / "README.md"


def test_each_fitting_cell_is_the_smallest_share_that_fits():
    """A cell's share fits the usable H100 and the host, and one hundredth less fits at no sub-group size; a cell that
    fits at no share is over the usable H100 even with the whole optimizer offloaded."""
    usable = memory.usable_bytes("H100")
    for cell in stock_search.grid():
        m, g = (int(x) for x in cell["batch"].split(" x "))
        if not cell["fits"]:
            assert cell["smallest_gpu_gib"] * 2**30 > usable
            continue
        p = stock_search.predict(m, g, cell["checkpointed"], cell["offloaded"], cell["sub_group_size"])
        assert p.total_per_gpu_bytes <= usable and p.host_per_node_bytes <= stock_search.host_gib() * 2**30
        less = round(cell["offloaded"] - 0.01, 2)
        for size in stock_search.SUB_GROUPS:
            p = stock_search.predict(m, g, cell["checkpointed"], less, size)
            assert p.total_per_gpu_bytes > usable or p.host_per_node_bytes > stock_search.host_gib() * 2**30
    fitting = {(c["batch"], c["checkpointed"]) for c in stock_search.grid() if c["fits"]}
    assert fitting == {("1 x 8", "full"), ("1 x 8", "none"), ("2 x 4", "full"), ("4 x 2", "full")}


def test_stocks_fastest_cell_ran_at_its_smallest_share_and_labs_leads_on_every_host():
    """Round 35 ran stock's 2 x 4 at the grid's share and sub-group size (its config says so); every round's stock
    runs are stock at 32,768 tokens per step; labs' slower run is at least 1.5x stock's fastest in every round, and at
    least 1.5x every estimate for a cell not run at its smallest share; so the target is met."""
    cell = next(c for c in stock_search.grid() if (c["batch"], c["checkpointed"]) == ("2 x 4", "full"))
    config = json.loads((stock_search.H100 / "round35" / "stock61_sg8" / "ds_config.json").read_text())
    zero = config["zero_optimization"]
    assert (zero["offload_optimizer"]["ratio"], zero["sub_group_size"]) == (cell["offloaded"], cell["sub_group_size"])
    found = stock_search.rounds()
    assert list(found) == ["32", "34", "35"]
    for f in found.values():
        assert all(r["side"] == "stock" and r["loss"] == "hf" and r["tokens_per_step"] == 32768 for r in f["stock"])
        assert all(r["copy"] == "labs'" and r["tokens_per_step"] == 32768 for r in f["labs"])
        assert f["ratio"] >= 1.5
    unrun = stock_search.unrun(found)
    assert {(u["batch"], u["checkpointed"]) for u in unrun} == {("1 x 8", "full"), ("1 x 8", "none"), ("4 x 2", "full")}
    assert all(u["labs_over_estimate"] >= 1.5 for u in unrun)
    target = offload_vs_stock.target()
    assert target["verdict"] == "met" and target["met"] is True
    # the share at 2 x 4 is a weak lever: 61% on one host is no faster than 70% on another of the same CPU model
    by_round = {n: [r for r in f["stock"] if r["batch"] == "2 x 4"] for n, f in found.items()}
    fastest_61 = max(r["tokens_per_s"] for r in by_round["35"])
    assert fastest_61 < 1.02 * max(r["tokens_per_s"] for r in by_round["32"])


def test_labs_memory_overpredicts_only_the_5e8_runs():
    """Every GPU peak of rounds 34 and 35 is within 0.1 GiB of labs.memory but the two runs with 5e8-parameter
    sub-groups, which labs.memory overpredicts by more than 8 GiB (the safe side; not explained: see the README)."""
    found = stock_search.rounds()
    for n in ("34", "35"):
        for r in found[n]["stock"] + found[n]["labs"]:
            if r["side"] == "stock" and r["sub_group_size"] == 5e8:
                assert r["predicted_gpu_gib"] - r["gpu_gib"] > 8
            else:
                assert r["gpu_gib"] == pytest.approx(r["predicted_gpu_gib"], abs=0.1)


def test_labs_rows_ran_the_committed_config_and_the_readme_quotes_the_readings():
    """labs' runs of rounds 34 and 35 name bench/labs_zero3_offload_70.json and made labs' copy with the variable
    unset; the results README states every speed of both rounds as read."""
    found = stock_search.rounds()
    for n in ("34", "35"):
        for r in found[n]["labs"]:
            folder = stock_search.H100 / f"round{n}" / r["run"]
            assert json.loads((folder / "run.json").read_text())["config"] == "ds_configs/bench/labs_zero3_offload_70.json"
            recorded = json.loads((folder / "environment.json").read_text())
            assert recorded["LABS_OFFLOAD_COPY"] is None and recorded["offload_copy"] == "gpu"
    assert (ROOT / "ds_configs" / "bench" / "labs_zero3_offload_70.json").exists()
    listed = lambda runs: " and ".join([", ".join(f"{r['tokens_per_s']:,.0f}" for r in runs[:-1]),
                                        f"{runs[-1]['tokens_per_s']:,.0f}"] if len(runs) > 1 else
                                       [f"{runs[0]['tokens_per_s']:,.0f}"])
    figures = [f"stock ran {listed(found[n]['stock'])}" for n in ("34", "35")]
    figures += [f"labs {listed(found[n]['labs'])}" for n in ("34", "35")]
    assert unquoted(README, figures) == []
