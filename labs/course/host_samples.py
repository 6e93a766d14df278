"""Host memory of a recorded GPU run, from tools/host_memory.sh's samples (one line per second: the host's available
memory; every python process's RssAnon, private memory, and RssShmem, shared memory, which also holds the blocks
PyTorch page-locks; and each process's command line the first time it is seen).

    host_samples.read(RESULTS / "gpu" / "zenflow_1xh200" / "off20b")   # total, least available, per-role figures
"""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path

# What each process of a run is, from its command line.
ROLES = {"-m labs.rank": "training rank", "spawn_main": "ZenFlow's optimizer process"}


def read(run_dir: Path, free_txt: Path | None = None) -> dict:
    """The host's total memory (`free -g` at the host's start, rounded down: free.txt in the run folder, else
    `free_txt`), its least available memory (GiB), and per (role, "RssAnon" | "RssShmem") both the largest value over
    the run (`peaks`) and the value at the second the host was tightest (`at_tightest`). Peaks of different processes
    need not coincide, and a process's shared pages count in every process that maps them: sum `at_tightest`'s
    private figures and one copy of the shared ones, not the peaks. `timeline`: per second, from the first sample,
    the available memory and the per-role figures (GiB). `rank_at_tightest_gib`: the training rank's private plus
    shared memory at that second (its shared pages hold the page-locked buffers)."""
    free_txt = run_dir / "free.txt" if (run_dir / "free.txt").exists() else free_txt
    total_gib = next(float(line.split()[1]) for line in free_txt.read_text().splitlines() if line.startswith("Mem:"))
    roles, avail_kib, per_second = {}, {}, defaultdict(dict)
    for line in (run_dir / "host_samples.txt").read_text().splitlines():
        second, pid, what, *rest = line.split()
        if pid == "avail":
            avail_kib[second] = int(what)
        elif what == "cmd":
            role = next((r for key, r in ROLES.items() if key in " ".join(rest)), None)
            if role:
                roles[pid] = role
        elif pid in roles:
            per_second[second][(roles[pid], what.rstrip(":"))] = int(rest[0]) / 2**20
    tightest = min(avail_kib, key=avail_kib.get)
    peaks = {}
    for sample in per_second.values():
        for key, gib in sample.items():
            peaks[key] = max(peaks.get(key, 0.0), gib)
    start = min(int(second) for second in avail_kib)
    timeline = [dict(second=int(s) - start, available_gib=avail_kib[s] / 2**20, **{" ".join(k): v for k, v in
                                                                                  per_second.get(s, {}).items()})
                for s in sorted(avail_kib, key=int)]
    at_tightest = per_second.get(tightest, {})
    return dict(total_gib=total_gib, least_available_gib=avail_kib[tightest] / 2**20, peaks=peaks,
                at_tightest=at_tightest, timeline=timeline,
                rank_at_tightest_gib=sum(gib for (role, _), gib in at_tightest.items() if role == "training rank"))
