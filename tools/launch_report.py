"""What `make test` launched: `python tools/launch_report.py CACHE_FOLDER` (the Makefile runs it at the end).

Reads the ledger labs.runcache keeps under LABS_RUN_CACHE and prints one summary line, the slowest launches, and the
groups of trained launches that differ only in steps or instruments (each group could be one run that several
tests and chapters share through the cache). CI time is spent almost entirely in these launches."""
import json
import sys
from collections import defaultdict
from pathlib import Path

LEDGER = "launches.jsonl"   # labs.runcache.LEDGER (tests/test_runcache.py checks): importing labs would load torch
SHAPE = ("preset", "config", "nproc", "engine", "activation_checkpointing", "precision")


def report(folder: Path, slowest: int = 12) -> str:
    path = folder / LEDGER
    if not path.is_file():
        return f"launch report: no ledger in {folder} (no labs run launched under LABS_RUN_CACHE)"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    trained = [r for r in rows if not r["reused"]]
    lines = [f"launch report: {len(rows)} labs runs, {len(rows) - len(trained)} reused from the run cache, "
             f"{len(trained)} trained in {sum(r['seconds'] for r in trained):.0f} s "
             f"({sum(r['key'] is None for r in trained)} of them not reusable: local weights, data, resume, checkpoints or nodes)"]
    lines.append(f"slowest {min(slowest, len(trained))}:")
    for r in sorted(trained, key=lambda r: -r["seconds"])[:slowest]:
        lines.append(f"  {r['seconds']:6.1f} s  {Path(str(r['config'])).name} x{r['nproc']} {r['steps']} steps  "
                     f"{r['out']}")
    groups = defaultdict(list)
    for r in trained:
        groups[tuple(str(r.get(k)) for k in SHAPE)].append(r)
    shared = [g for g in groups.values() if len(g) > 1]
    if shared:
        lines.append("trained more than once with the same config, differing in steps or instruments:")
        for group in sorted(shared, key=lambda g: -sum(r["seconds"] for r in g)):
            variants = sorted({(r["steps"], ",".join(r.get("instruments") or [])) for r in group})
            lines.append(f"  {Path(str(group[0]['config'])).name} x{group[0]['nproc']}: {len(group)} runs, "
                         f"{sum(r['seconds'] for r in group):.0f} s; (steps, instruments): {variants}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(report(Path(sys.argv[1])))
