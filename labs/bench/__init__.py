"""The GPU benchmark (`labs bench`) and the reader of its committed results.

    from labs import bench
    result = bench.run_cases(["stock-zero3", "labs-zero3"], preset="qwen2.5-7b", out="results/gpu/mine.json")
    from labs.bench import results
    results.rows(results.load_all())         # one row per recorded case, with provenance
"""
from labs.bench.cases import CASES, PAIRS, case_options, compose
from labs.bench.runner import format_table, host_info, run_cases, run_sweep

__all__ = ["CASES", "PAIRS", "case_options", "compose", "format_table", "host_info", "run_cases", "run_sweep"]
