"""Rebuild `labs bench`'s result file from the run folders a bench invocation left, when the file itself was lost.

GPU round 5 (2026-12-02): the device tool brings back at most 8 files from a call; the first call wrote 9 and the
bench's JSON was among those left behind, then cleared with the call's output folder. The case run folders were still
on the warm host (/tmp/bench-work) and came back in a later call. This writes the same fields `labs bench` writes
(labs.bench.runner.finished_case, as run_cases does), from those folders, plus `assembled`, which says so, and the
ranks' OMP_NUM_THREADS from the folders' environment.json; the host facts are copied from a result file written by
the same host in the same session. labs.memory's predictions are computed when this runs.

    python tools/assemble_bench_result.py --runs DIR --host-from OTHER.json --command "..." --out RESULT.json CASE...
"""
import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from labs.bench import runner  # noqa: E402
from labs.bench.cases import case_options, describe  # noqa: E402
from labs.runfolder import Run  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("cases", nargs="+")
    p.add_argument("--runs", required=True, help="the bench's --work folder, one run folder per case")
    p.add_argument("--host-from", required=True, help="a result file from the same host and session")
    p.add_argument("--command", required=True, help="the bench command as it was run")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    other = json.loads(Path(a.host_from).read_text())
    first = Run(Path(a.runs) / a.cases[0])
    steps = first.spec["steps"]
    result = dict(what=other["what"], date=json.loads((first.path / "environment.json").read_text())["started"],
                  command=a.command, host=other["host"], preset=first.spec["preset"], steps=steps,
                  timing=other["timing"], mfu_formula=other["mfu_formula"],
                  mfu_causal_formula=other["mfu_causal_formula"], gpu_memory=None, cases={},
                  assembled=f"rebuilt by tools/assemble_bench_result.py from the run folders; host facts from "
                            f"{Path(a.host_from).name} (the same host, the same session); wall_s not recorded")
    for name in a.cases:
        run = Run(Path(a.runs) / name)
        options = dict(case_options(name, result["preset"], steps, None, None, on_gpu=True), gpu_memory=None)
        result["cases"][name] = dict(description=describe(name), options={k: str(v) for k, v in options.items()},
                                     **runner.finished_case(run), wall_s=None)
    threads = {json.loads((Path(a.runs) / name / "environment.json").read_text())["OMP_NUM_THREADS"] for name in a.cases}
    assert len(threads) == 1, threads
    result["environment"] = {"OMP_NUM_THREADS": threads.pop()}    # what the ranks ran with (the bench did not record it)
    Path(a.out).write_text(json.dumps(runner.with_ratios(result), indent=1) + "\n")
    print(runner.format_table(result))


if __name__ == "__main__":
    main()
