"""labs.env's start-up savings in the ranks change what DeepSpeed loads, never what it computes."""
import os
import subprocess
import sys

import pytest

from labs import ROOT, env


def test_muon_stand_ins_only_for_runs_without_muon(monkeypatch):
    for name in (env.MUON_MODULE, env.MUON_KERNELS):
        monkeypatch.delitem(sys.modules, name, raising=False)
    env.skip_muon_import({"optimizer": {"type": "Muon", "params": {}}})
    assert env.MUON_MODULE not in sys.modules and env.MUON_KERNELS not in sys.modules   # Muon gets DeepSpeed's own
    env.skip_muon_import({"optimizer": {"type": "AdamW", "params": {"torch_adam": True}}})
    from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam   # what DeepSpeed's engines import
    from deepspeed.runtime.zero.muon.original_muon import muon_update       # what ZeRO-1/2's gradient copy imports

    assert MuonWithAuxAdam is sys.modules[env.MUON_MODULE].MuonWithAuxAdam and not isinstance(object(), MuonWithAuxAdam)
    with pytest.raises(RuntimeError, match="not Muon"):                    # never silently a no-op update
        muon_update(None, None)
    for name in (env.MUON_MODULE, env.MUON_KERNELS):
        monkeypatch.delitem(sys.modules, name)


def test_labs_runs_moves_the_chapters_runs():
    """make test points LABS_RUNS at its temporary folder, so the chapters, run beside the unit tests, leave runs/ alone
    (tests/conftest.py fails any test that writes into the checkout)."""
    probe = [sys.executable, "-c", "import labs; print(labs.RUNS)"]
    env = {k: v for k, v in os.environ.items() if k != "LABS_RUNS"}
    default = subprocess.run(probe, capture_output=True, text=True, env=env, cwd=ROOT).stdout.strip()
    moved = subprocess.run(probe, capture_output=True, text=True, env=dict(env, LABS_RUNS="/tmp/elsewhere"),
                           cwd=ROOT).stdout.strip()
    assert (default, moved) == (str(ROOT / "runs"), "/tmp/elsewhere")


def test_cpu_ranks_ask_glibc_for_huge_pages_unless_the_user_chose(tmp_path):
    """On a machine without CUDA the ranks' environment asks glibc for transparent huge pages (labs.env: the kernel
    then zeroes a rank's fresh memory 2 MiB at a time); a user's own GLIBC_TUNABLES is kept. Where the kernel allows
    THP on request, a process started with it really gets huge pages for a large buffer, and one without does not."""
    import torch
    if torch.cuda.is_available():
        pytest.skip("GPU ranks keep glibc's defaults")
    ranks, _ = env.repaired_environment(2, cpu_offload=False, base={})
    assert ranks["GLIBC_TUNABLES"] == env.MALLOC_TUNABLES == f"glibc.malloc.hugetlb=1:{env.MALLOC_KEEP}"
    mine, _ = env.repaired_environment(2, cpu_offload=False, base={"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})
    assert mine["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2"
    thp = "/sys/kernel/mm/transparent_hugepage/enabled"
    if not os.path.exists(thp) or "[never]" in open(thp).read():
        pytest.skip("this kernel gives no transparent huge pages")
    touch = ("b = bytearray(64 << 20)\nfor i in range(0, len(b), 4096): b[i] = 1\n"
             "print(next(int(l.split()[1]) for l in open('/proc/self/smaps_rollup') if l.startswith('AnonHugePages')))")
    huge_kib = {tunables: int(subprocess.run([sys.executable, "-c", touch], capture_output=True, text=True, check=True,
                                             env=dict(os.environ, GLIBC_TUNABLES=tunables)).stdout)
                for tunables in ("", env.MALLOC_TUNABLES)}
    assert huge_kib[env.MALLOC_TUNABLES] >= 32 * 1024, huge_kib      # most of the 64 MiB buffer
    if "[madvise]" in open(thp).read():
        assert huge_kib[""] == 0, huge_kib                            # only on request


def test_make_test_gives_every_process_what_cpu_ranks_get():
    """`make test` exports labs.env.MALLOC_TUNABLES to all it starts (its processes end with it); other targets
    export nothing (labs.env sets CPU ranks' own). Probed by a prerequisite that prints what it got and stops make."""
    def seen(goal):
        probe = "test: probe\nprobe:\n\t@echo \"[$$GLIBC_TUNABLES]\"; exit 3\n"
        return subprocess.run(["make", "-s", "-f", "Makefile", "-f", "-", "-o", ".venv/.installed", goal],
                              input=probe, cwd=ROOT, text=True, capture_output=True,
                              env={k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}).stdout.strip()
    assert seen("test") == f"[{env.MALLOC_TUNABLES}]" and seen("probe") == "[]"


def test_cpu_ranks_keep_freed_memory_for_the_next_step():
    """glibc returns a freed block over 32 MiB to the kernel, and the next step's block is faulted in (and zeroed by
    the kernel) again; with labs.env.MALLOC_KEEP the freed block is reused: ten rounds of a 64 MiB buffer fault in
    about one round's pages instead of ten (counted beyond a start-up without the buffer, in pages of any size)."""
    def faults(tunables, rounds):
        churn = (f"import resource\nfor _ in range({rounds}):\n    b = bytearray(64 << 20)\n"
                 "    b[::4096] = b'\\1' * (len(b) // 4096)\n    del b\n"
                 "print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)")
        return int(subprocess.run([sys.executable, "-c", churn], capture_output=True, text=True, check=True,
                                  env=dict(os.environ, GLIBC_TUNABLES=tunables)).stdout)

    added = {tunables: faults(tunables, 10) - faults(tunables, 0) for tunables in ("", env.MALLOC_KEEP)}
    assert added[""] > 0 and added[env.MALLOC_KEEP] < 0.3 * added[""], added


def test_cpu_info_is_measured_once_per_machine_and_then_read(tmp_path, monkeypatch):
    """DeepSpeed's CPU Adam asks py-cpuinfo three times per process, ~1 s each: labs answers from a file after the
    first measurement, in this process and in the next (a second serve, as a new rank would do, measures nothing)."""
    import cpuinfo

    from labs import env

    found = {"arch": "X86_64", "flags": ["avx2"], "vendor_id_raw": "GenuineIntel"}
    calls = []

    def measure():
        calls.append(1)
        return found

    for _process in range(2):
        monkeypatch.setattr(cpuinfo, "get_cpu_info", measure)
        env.serve_cpu_info_from_cache(str(tmp_path))
        assert [cpuinfo.get_cpu_info() for _ in range(3)] == [found] * 3
    assert len(calls) == 1 and [p.name.startswith("cpu_info-") for p in tmp_path.iterdir()] == [True]


def test_deepspeeds_cpu_accelerator_counts_the_ranks_per_node_without_numactl(monkeypatch):
    """The ranks get LOCAL_SIZE (ranks per node), as DeepSpeed's own launcher sets it, over an inherited one. With it,
    DeepSpeed's CPU accelerator counts its devices without running `numactl --hardware`, which ZeRO-3 asks at every
    gradient reduction (labs.env)."""
    assert env.repaired_environment(2, cpu_offload=False, base={})[0]["LOCAL_SIZE"] == "2"
    assert env.repaired_environment(4, cpu_offload=False, base={"LOCAL_SIZE": "8"})[0]["LOCAL_SIZE"] == "4"
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    def no_numactl(*args, **kwargs):
        raise AssertionError(f"DeepSpeed ran {args[0]}")
    monkeypatch.setattr(subprocess, "check_output", no_numactl)
    monkeypatch.setenv("LOCAL_SIZE", "3")
    assert CPU_Accelerator().device_count() == 3
    monkeypatch.delenv("LOCAL_SIZE")
    with pytest.raises(AssertionError, match="numactl"):
        CPU_Accelerator().device_count()
