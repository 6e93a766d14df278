"""The GPU benchmark (`labs bench`) and the reader of its committed results.

    from labs import bench
    result = bench.run_cases(["stock-zero3", "labs-zero3"], preset="qwen2.5-7b", out="results/gpu/mine.json")
    from labs.bench import results
    results.rows(results.load_all())         # one row per recorded case, with provenance
"""
from labs.bench.runner import CASES, PAIRS, case_options, format_table, host_info, run_cases

__all__ = ["CASES", "PAIRS", "case_options", "format_table", "host_info", "run_cases"]
