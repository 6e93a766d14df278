"""Round 41, a third fresh real H100 (2026-12-06): the repeats round 40 could not run. labs' 71.4% row (as chosen in
round 39) and stock's best setup alternated twice (L S L S), then the 62.2% row once and the step's parts. Each test
checks a reading against the files."""
import json

import pytest

from conftest import l_s_l_s_text, unquoted
from labs.course import offload_verdict, offload_vs_stock, stock_search
from labs.course.one_card_runs import cpu_model, round_parts

ROUND41 = stock_search.H100 / "round41"


def test_round_41_ran_round_39s_configs_in_the_order_l_s_l_s():
    """The same configs as rounds 39 and 40 byte for byte, labs' row on the committed config with labs' default copy,
    and the runs started labs, stock, labs, stock (each run folder's environment.json records its start)."""
    for name in ("labs_zero3_offload_61.json", "stock_z3_off0.61_sg2e8.json"):
        assert (stock_search.H100 / "round39" / name).read_bytes() == (ROUND41 / name).read_bytes()
    started = {}
    for run_name in ("labs_copy", "stock61_sg2", "labs_copy_again", "stock61_sg2_again", "labs61"):
        environment = json.loads((ROUND41 / run_name / "environment.json").read_text())
        started[run_name] = environment["started"]
        if run_name.startswith("labs_copy"):
            spec = json.loads((ROUND41 / run_name / "run.json").read_text())
            assert spec["config"] == "ds_configs/bench/labs_zero3_offload_70.json"
            assert environment["LABS_OFFLOAD_COPY"] is None and environment["offload_copy"] == "gpu"
    assert list(started) == sorted(started, key=started.get)


def test_the_verdict_counts_round_41_as_a_third_machine_and_the_readme_states_it():
    """Round 41 ran labs' row as it stands, so the target counts it; its ratio is labs' slower run over stock's
    fastest; the round folder's README and the target line give the figures as read."""
    found = offload_vs_stock.stock_best()
    round41 = found["rounds"]["41"]
    assert round41["row"] == found["row"] and "41" in found["judged"]
    labs = sorted(r["tokens_per_s"] for r in round41["labs"])
    stock = sorted(r["tokens_per_s"] for r in round41["stock"])
    assert round41["ratio"] == pytest.approx(labs[0] / stock[-1])
    assert offload_verdict.target(found)["machines"] == len(found["judged"]) >= 3
    text = l_s_l_s_text(round41)
    assert unquoted(stock_search.H100 / "README.md", [text]) == []


def test_round_41s_host_had_the_slowest_cpu_adam_and_the_same_copy():
    """The step's parts: CPU Adam per 10^9 parameters slower on round 41's host than on any other host timed, and
    DeepSpeed's cast copy (stock's) with it; the copy from page-locked memory the same as everywhere (within 5%); the
    README says so as the files give it."""
    parts = {n: round_parts(n) for n in ("31", "38", "39", "41")}
    slowest = max(parts, key=lambda n: parts[n]["cpu_adam_s"])
    assert slowest == "41"
    copies = [p["copy_to_gpu_fp32_registered_s"] for p in parts.values()]
    assert max(copies) < 1.05 * min(copies)
    cast = sorted(p["copy_to_gpu_bf16_pageable_s"] for n, p in parts.items() if n != "41")
    assert parts["41"]["copy_to_gpu_bf16_pageable_s"] > cast[-1]          # DeepSpeed's cast copy slowed with the CPU
    assert unquoted(stock_search.H100 / "README.md", [
        f"{parts['41']['cpu_adam_s']:.3f} s per 10^9 parameters",
        f"{parts['41']['copy_to_gpu_bf16_pageable_s']:.3f} s against {cast[0]:.3f}-{cast[-1]:.3f}"]) == []
    models = {n: cpu_model(stock_search.H100 / f"round{n}" / "cpu.txt") for n in parts}
    assert models["41"] == models["38"] == models["31"] != models["39"]
