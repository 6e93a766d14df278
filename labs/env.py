"""The environment: a short report with fixes (`labs env`), and the repairs `labs.launch` applies to the
environment of the ranks it starts."""
from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata as md
import json
import os
import platform
import re
import sys
import types
from pathlib import Path

import torch

from labs import ROOT


# Transparent huge pages for malloc's memory, and freed memory kept for reuse (no mmap below 1 GiB, no trim below
# 4 GiB, the heap grown 256 MiB at a time): see the CPU ranks' branch of repaired_environment.
MALLOC_KEEP = ("glibc.malloc.mmap_threshold=1073741824:glibc.malloc.trim_threshold=4294967296:"
               "glibc.malloc.top_pad=268435456")
MALLOC_TUNABLES = f"glibc.malloc.hugetlb=1:{MALLOC_KEEP}"


def repaired_environment(nproc: int, cpu_offload: bool, base: dict | None = None,
                         cores: int | None = None) -> tuple[dict, list[str]]:
    """A copy of the environment for the ranks, with known traps fixed; returns it and what changed.
    Everything else (NCCL_NVLS_ENABLE=0 and the like) is inherited unchanged. `cores` defaults to this
    process's usable CPUs (give another to see what a bigger host would get)."""
    env = dict(os.environ if base is None else base)
    changes = []
    arch = env.get("TORCH_CUDA_ARCH_LIST", "")
    fixed = re.sub(r"(\d+\.\d+)a\b", r"\1", arch)
    if fixed != arch:
        # DeepSpeed 0.19's JIT builder reads '9.0a' as an int and crashes while building FusedAdam.
        env["TORCH_CUDA_ARCH_LIST"] = fixed
        changes.append(f"TORCH_CUDA_ARCH_LIST {arch!r} -> {fixed!r} (DeepSpeed's op builder cannot parse 'a')")
    cores = cores or usable_cores()
    threads = max(1, cores // max(1, nproc))
    if "OMP_NUM_THREADS" not in env or (cpu_offload and env["OMP_NUM_THREADS"] == "1" and threads > 1):
        # torchrun sets OMP_NUM_THREADS=1 for several ranks; CPU-Adam then steps on one core.
        if env.get("OMP_NUM_THREADS") == "1":
            changes.append(f"OMP_NUM_THREADS 1 -> {threads} (CPU-Adam would run on one core)")
        env["OMP_NUM_THREADS"] = str(threads)
    # DeepSpeed's CPU accelerator counts its devices from LOCAL_SIZE, which DeepSpeed's own launcher sets to the ranks
    # per node (over any inherited value, as here); unset, it runs `numactl --hardware` at every ZeRO-3 gradient
    # reduction (160 times a rank in an 8-step tiny run: 0.4 s of its CPU) and, where numactl is missing, counts one
    # device per node. GPU ranks ignore it.
    env["LOCAL_SIZE"] = str(nproc)
    if not torch.cuda.is_available():
        env["DS_ACCELERATOR"] = "cpu"
        # A CPU rank allocates and frees its activations every step (the tiny preset's logits alone: 128 tokens x
        # 151,936 vocabulary entries, 78 MB in fp32, several times a step), and glibc hands every block over 32 MiB
        # back to the kernel when it is freed, which zeroes fresh pages at the next allocation: on this course's 2-core
        # VM, 22% of a tiny 2-rank run's busy CPU samples (perf) were the kernel's clear_page. Two settings (a user's
        # own GLIBC_TUNABLES wins):
        # - transparent huge pages for malloc's memory (glibc >= 2.35; the kernel zeroes 2 MiB at a time; nothing
        #   changes where its THP is off) took tests/test_train.py from 69 s to 54 s (user + sys CPU 101 s to 76 s);
        # - then keeping freed memory for the next step (MALLOC_KEEP, glibc >= 2.26): a rank's memory stays at its
        #   peak until it exits. A 30-step 2-rank tiny run with both, against huge pages alone (2026-12-07, four pairs
        #   run alternately), spent 6.6-8.0 s of system CPU instead of 12.9-17.8, and less busy CPU in all in every
        #   pair (42-51 s against 45-61); with MALLOC_KEEP alone, about as much as with both (three pairs).
        env.setdefault("GLIBC_TUNABLES", MALLOC_TUNABLES)
    # DeepSpeed's just-in-time ops are built per Python environment: keep each environment's builds (and their
    # lock files) apart, so two checkouts never wait on, or load, each other's build.
    env.setdefault("TORCH_EXTENSIONS_DIR", extensions_dir())
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("PYTHONWARNINGS", "ignore::FutureWarning")   # DeepSpeed calls deprecated torch.distributed APIs
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    # What importing DeepSpeed sets in every rank (a CUDA check that creates no CUDA context): set here too, so a run's
    # environment is the same whether or not this process imported DeepSpeed before (labs.prefork compares them).
    env.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    return env, changes


# CPU ranks on any host, a GPU host included: no GPU visible (labs then trains on the CPU with gloo) and DeepSpeed's
# CPU accelerator (it would pick CUDA from the driver otherwise).
CPU_ONLY = {"CUDA_VISIBLE_DEVICES": "", "DS_ACCELERATOR": "cpu"}


def importable_path(env: dict) -> str:
    """PYTHONPATH for the processes labs starts: this checkout's labs first, then what `env` had (on a GPU host
    that may be where DeepSpeed was installed), so they import the same labs whatever their working directory. Each
    folder once: a run started from a process that had this PYTHONPATH already gets the same one (labs.prefork
    matches environments)."""
    return os.pathsep.join(dict.fromkeys([str(ROOT), *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]]))


def usable_cores() -> int:
    """The CPUs this process may run on (a Slurm task's or a container's share), not all of the machine's."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def extensions_dir() -> str:
    """Where DeepSpeed's just-in-time ops are built and cached for this Python environment."""
    return os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(sys.prefix, "torch_extensions")


def ops_to_build(on_gpu: bool, cpu_offload: bool, fused_adam: bool) -> list[str]:
    """The DeepSpeed ops a run will compile first (tens of seconds to minutes each, once per environment): CPU Adam
    with an offloaded optimizer, FusedAdam on a GPU. (Never the CPU communication op: `skip_shm_comm_op`.)"""
    wanted = (["cpu_adam"] if cpu_offload else []) + (["fused_adam"] if on_gpu and fused_adam and not cpu_offload else [])
    # The ranks always get TORCH_EXTENSIONS_DIR (repaired_environment), and torch then builds each op straight in
    # <dir>/<op>/ (the py3XX_cpu / py3XX_cuXXX subfolder is only for its own default root).
    return [op for op in wanted if not os.path.isfile(os.path.join(extensions_dir(), op, f"{op}.so"))]


def skip_shm_comm_op() -> None:
    """Keep DeepSpeed from compiling its shared-memory allreduce op (deepspeed_shm_comm) in this process; call it
    before deepspeed.init_distributed. With the cpu accelerator, DeepSpeed's comm layer compiles that C++ op on its
    first start in an environment (30-60 s on 2 cores) for one method, inference_all_reduce, which only its inference
    kernels (AutoTP) call: ZeRO's training collectives go through torch.distributed (gloo) with or without it.
    Marking the op not compatible is what DeepSpeed itself does where it cannot build (off Linux), and its comm layer
    then starts without it. Other accelerators never build it: nothing to do there (and their op probes can be slow)."""
    if os.environ.get("DS_ACCELERATOR") != "cpu":
        return
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


MUON_MODULE = "deepspeed.runtime.zero.muon.muon_optimizer"
MUON_KERNELS = "deepspeed.runtime.zero.muon.original_muon"


def skip_muon_import(ds_config: dict) -> None:
    """Keep DeepSpeed from importing its Muon optimizer in a run that does not use Muon; call it before
    deepspeed.initialize. Importing either Muon module sets up torch.compile for Muon's kernels (torch._dynamo and
    inductor: ~1.4 s of a rank's CPU), and DeepSpeed imports them in runs without Muon: every ZeRO engine asks
    `isinstance(optimizer, MuonWithAuxAdam)`, and ZeRO-1/2 imports `muon_update` in every step's gradient copy,
    then calls it only for parameters marked `use_muon` under a Muon optimizer. Here both modules are stand-ins:
    no optimizer is an instance of their MuonWithAuxAdam, so DeepSpeed gets the same answer ("not Muon"), and their
    `muon_update` raises if anything ever calls it. A config whose optimizer is Muon gets DeepSpeed's real modules."""
    if str((ds_config.get("optimizer") or {}).get("type", "")).lower() == "muon":
        return
    for name in (MUON_MODULE, MUON_KERNELS):
        if name not in sys.modules:
            sys.modules[name] = _muon_stand_in(name)


def _muon_stand_in(name: str) -> types.ModuleType:
    stand_in = types.ModuleType(name, "labs.env.skip_muon_import: this run's optimizer is not Muon")

    class MuonWithAuxAdam:           # never instantiated: only isinstance checks see it
        pass

    def not_muon(*args, **kwargs):
        raise RuntimeError(f"{name} is labs' stand-in (labs.env.skip_muon_import): this run's optimizer is not Muon")

    stand_in.MuonWithAuxAdam = MuonWithAuxAdam
    stand_in.muon_update = stand_in.adam_update = not_muon
    return stand_in


def _version(name: str) -> str | None:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def report() -> dict:
    """Versions, devices, which DeepSpeed ops can build here, and problems with their fixes."""
    info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "cpu_cores": os.cpu_count(), "gpus": []}
    for name in ("deepspeed", "transformers", "accelerate", "tiktoken", "dashscope", "liger-kernel", "triton"):
        info[name] = _version(name)
    problems = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            info["gpus"].append(f"{props.name}, {props.total_memory / 2**30:.0f} GiB, sm_{props.major}{props.minor}")
    elif info["cuda"] is None:
        problems.append("no GPU: training runs on CPU with gloo (2 ranks). On a GPU host install a CUDA build "
                        "of torch (README: 'GPU hosts')")
    if info["deepspeed"] is None:
        problems.append("DeepSpeed is missing: `pip install deepspeed==0.19.8`")
    else:
        info["deepspeed_ops"] = _deepspeed_ops()
    if info["dashscope"] is None:
        problems.append("the Qwen tokenizer file is missing: `pip install --no-deps dashscope==2.0.2`")
    if torch.cuda.is_available() and info["liger-kernel"] is None:
        problems.append("Liger Kernel is missing (the fast loss and kernels): `pip install liger-kernel`")
    _, fixes = repaired_environment(max(1, torch.cuda.device_count()), cpu_offload=True)
    problems += [f"environment: {fix}; `labs` launches fix this for their ranks" for fix in fixes]
    info["problems"] = problems
    return info


def name_deepspeed_accelerator() -> str:
    """Tell DeepSpeed which accelerator this process has (cuda with a GPU, else cpu) before it is first imported, as
    `repaired_environment` does for the ranks; left to guess, DeepSpeed logs a warning ("Setting accelerator to
    CPU ...") on every machine without a GPU. A value already set wins. Returns the name. Also makes this process
    read py-cpuinfo's answer from the machine's file (`serve_cpu_info_from_cache`), before DeepSpeed first asks."""
    serve_cpu_info_from_cache()
    return os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")


def serve_cpu_info_from_cache(folder: str | None = None):
    """Answer py-cpuinfo's `get_cpu_info()` from a file after its first answer on this machine. DeepSpeed asks it up
    to three times in each process that builds CPU Adam (the op's -march and SIMD flags, then the optimizer's vendor
    check), and every answer costs about a second of CPU: py-cpuinfo starts a Python process that probes and times
    the CPU (73 such processes, 65 s of CPU, in one `make test` on a 2-core VM). The file sits beside DeepSpeed's
    just-in-time builds, which are built for this CPU too, under a name that holds the CPU's model and flags.
    DeepSpeed reads only the architecture, vendor and flags; the cached clock figures are the first call's."""
    try:
        import cpuinfo
    except ImportError:
        return
    if getattr(cpuinfo.get_cpu_info, "served_by_labs", False):
        return
    measure = cpuinfo.get_cpu_info
    path = Path(folder or extensions_dir()) / f"cpu_info-{_cpu_fingerprint()}.json"

    def get_cpu_info():
        with contextlib.suppress(OSError, ValueError):
            return json.loads(path.read_text())
        info = measure()
        with contextlib.suppress(OSError):
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_name(f".{path.name}.{os.getpid()}")
            partial.write_text(json.dumps(info))
            partial.replace(path)          # whole or absent: two processes may write it at once
        return info

    get_cpu_info.served_by_labs = True
    cpuinfo.get_cpu_info = get_cpu_info    # DeepSpeed imports it from the package at each call


def _cpu_fingerprint() -> str:
    """A short digest of what names this CPU: its model and flags (the first processor in /proc/cpuinfo)."""
    text = platform.machine() + platform.processor()
    with contextlib.suppress(OSError):
        first = Path("/proc/cpuinfo").read_text().split("\n\n")[0]
        text += "\n".join(line for line in first.splitlines() if line.startswith(("vendor_id", "model name", "flags")))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _deepspeed_ops() -> dict:
    """Can each op that the course uses be built (just in time) on this machine?"""
    name_deepspeed_accelerator()
    from deepspeed.accelerator import get_accelerator

    ops = {}
    for op in ("FusedAdamBuilder", "CPUAdamBuilder", "AsyncIOBuilder"):
        try:
            builder = get_accelerator().create_op_builder(op)
            with _quiet_fds():   # the compatibility probes compile test programs and print linker errors
                ops[op.replace("Builder", "")] = bool(builder and builder.is_compatible(verbose=False))
        except Exception as exc:   # a broken toolchain is a finding, not a crash of the report
            ops[op.replace("Builder", "")] = f"error: {exc}"
    return ops


@contextlib.contextmanager
def _quiet_fds():
    """Silence stdout/stderr at the file-descriptor level (child compilers write there directly)."""
    sys.stdout.flush(), sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with open(os.devnull, "w") as devnull:
        os.dup2(devnull.fileno(), 1)
        os.dup2(devnull.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)


def format_report(info: dict) -> str:
    lines = [f"python {info['python']}, torch {info['torch']} (CUDA {info['cuda'] or 'none'}), "
             f"{info['cpu_cores']} CPU cores"]
    lines.append("GPUs: " + ("; ".join(info["gpus"]) if info["gpus"] else "none"))
    lines.append(", ".join(f"{name} {info[name] or 'missing'}" for name in
                           ("deepspeed", "transformers", "accelerate", "tiktoken", "dashscope", "liger-kernel")))
    if "deepspeed_ops" in info:
        lines.append("DeepSpeed ops buildable here: " +
                     ", ".join(f"{op} {'yes' if ok is True else 'no' if ok is False else ok}"
                               for op, ok in info["deepspeed_ops"].items()))
    lines += [f"problem: {p}" for p in info["problems"]] or ["no problems found"]
    return "\n".join(lines)


def versions() -> dict:
    """The versions a result depends on (recorded in every summary and bench result)."""
    found = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("deepspeed", "transformers", "accelerate", "liger-kernel", "triton"):
        if _version(name):
            found[name] = _version(name)
    if torch.cuda.is_available():
        found["cuda"] = torch.version.cuda
    return found
