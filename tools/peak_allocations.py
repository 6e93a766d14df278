"""Run one `labs bench` case with the peak_allocations instrument and print what was alive at its peak beside what
labs.memory predicts for it, phase by phase (for finding what a memory prediction missed; GPU only).

    python3 tools/peak_allocations.py CASE --preset qwen2.5-7b --steps 3 --out DIR

DIR/CASE/ gets the run folder's summary.json, metrics.jsonl, run.json, ds_config.json and
peak_allocations_rank*.json, and comparison.json (measured peak, replayed peak, the prediction's phases).
"""
import argparse
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from labs import launch  # noqa: E402
from labs.bench import sweep  # noqa: E402
from labs.bench.cases import case_options  # noqa: E402
from labs.memory.estimate import from_run  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("case")
parser.add_argument("--preset", default="qwen2.5-7b")
parser.add_argument("--steps", type=int, default=3)
parser.add_argument("--out", required=True)
parser.add_argument("--work", default="/tmp/peak-allocations")
args = parser.parse_args()

options = case_options(args.case, args.preset, args.steps, None, None)
run_dir = Path(args.work) / args.case
run = launch.run(out=run_dir, stream=False, instruments=("state_bytes", "peak_allocations"), **options)
summary = json.loads((run_dir / "summary.json").read_text())
predicted = from_run(run).as_dict()
found = summary["peak_allocations"][0]
if "skipped" in found:
    sys.exit(f"{args.case}: {found['skipped']}")
comparison = dict(case=args.case, preset=args.preset, steps=args.steps,
                  planner_prediction_bytes=sweep.predicted_peak_bytes(args.case, args.preset, 1),
                  max_memory_allocated_bytes=found["max_memory_allocated_bytes"],
                  replayed_peak_bytes=found["peak_bytes"], record_complete=found["record_complete"],
                  peak_moment=found["peak_moment"], predicted_phases=predicted["phases"],
                  predicted_peak_phase=predicted["peak_phase"])
dest = Path(args.out) / args.case
dest.mkdir(parents=True, exist_ok=True)
for name in ("summary.json", "metrics.jsonl", "run.json", "ds_config.json", "peak_allocations_rank0.json"):
    if (run_dir / name).exists():
        shutil.copy(run_dir / name, dest / name)
(dest / "comparison.json").write_text(json.dumps(comparison, indent=1) + "\n")
gib = 2 ** 30
print(f"{args.case}: max allocated {found['max_memory_allocated_bytes'] / gib:.2f} GiB, replayed "
      f"{found['peak_bytes'] / gib:.2f} GiB, planner's prediction {comparison['planner_prediction_bytes'] / gib:.2f} "
      f"GiB; peak at {found['peak_moment']}")
for group in found["groups"][:15]:
    print(f"  {group['bytes'] / gib:7.2f} GiB  {group['blocks']:5d} blocks  {group['label'][:150]}")
