"""`labs bench`: the stock reference and the labs fast path, run one after the other on the same GPUs in one
invocation, with throughput, MFU, memory (measured and predicted) and where the time goes.

What the cases are: labs.bench.cases. MFU = flops_per_token * tokens/s per GPU / peak (989 TFLOP/s dense bf16 on an
H100/H200), with flops_per_token = 6 * (N - input embedding) + 12 * L * H * S counting the full attention matrix
(labs.models.flops_per_token; the shared reference figures' convention), and `mfu_causal` beside it counting only the
causal half (6 * L * H * S), which is what the attention kernels compute.
"""
from __future__ import annotations

import contextlib
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from labs import env, launch, memory, resolve, runfolder
from labs.bench import planner, sweep
from labs.bench.cases import PAIRS, case_options, describe
from labs.errors import LabsError, RankFailed
from labs.table import Table

def run_cases(names: list[str], preset="qwen2.5-7b", steps=8, seq_len=None, micro_batch=None, out=None,
              work=None, stream=True, gpu_memory=None) -> dict:
    """Run the named cases one after the other; returns (and writes to `out`, after every case) the result with
    every case's summary, per-step metrics, resolved config and predicted memory. The run folders go to `work`
    (default: a new folder under the system's temporary directory, never into the course checkout)."""
    made = not work
    work = Path(work) if work else Path(tempfile.mkdtemp(prefix="labs-bench-"))
    try:                                 # every case's input is checked before the first one runs
        options = {name: dict(case_options(name, preset, steps, seq_len, micro_batch), gpu_memory=gpu_memory)
                   for name in names}
        _can_write("--work", work, folder=True)
        for name, opts in options.items():
            launch.prepare(out=work / name, **opts)
        if out:
            _can_write("--out", Path(out))
    except BaseException:                # a refused input, an interrupt
        if made:
            with contextlib.suppress(OSError):
                work.rmdir()             # the empty temporary folder made above: nothing is left
        raise
    result = dict(what="labs bench: stock reference and labs fast path on the same machine, one after the other",
                  date=time.strftime("%Y-%m-%dT%H:%M:%S%z"), command=shlex.join([Path(sys.argv[0]).name] + sys.argv[1:]),
                  host=host_info(), preset=preset, steps=steps, timing="median step time of steps 3..N",
                  mfu_formula="(6 * (N - input embedding) + 12 * layers * hidden * seq) * tokens/s per GPU / peak",
                  mfu_causal_formula="(6 * (N - input embedding) + 6 * layers * hidden * seq) * tokens/s per GPU / peak",
                  gpu_memory=gpu_memory,
                  cases={})
    for name in names:
        print(f"\n=== {name}: {describe(name)}", flush=True)
        entry = dict(description=describe(name), options={k: str(v) for k, v in options[name].items()})
        started = time.time()
        try:
            run = launch.run(out=work / name, stream=stream, **options[name])
            entry.update(finished_case(run))
        except RankFailed as exc:
            entry.update(status="failed", error=_last_error_line(str(exc)), error_tail=str(exc)[-3000:])
        entry["wall_s"] = round(time.time() - started, 1)
        result["cases"][name] = entry
        if out:   # written after every case, so a later crash or time-out keeps what was measured
            target = Path(os.path.realpath(out))           # through a link, as _can_write checked it
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(json.dumps(with_ratios(result), indent=1) + "\n")
    return with_ratios(result)


def run_sweep(preset="qwen2.5-7b", gpus=None, gpu_memory=None, batch_per_gpu=8, top=3, extra=(), seq_len=None,
              **run_options) -> dict:
    """Best against best in one invocation: the planner's `top` fastest predicted candidates of each side that fit
    the memory (labs.bench.planner), plus `extra` cases (levers on top of them), all at `batch_per_gpu` sequences per
    GPU per optimizer step; then each side's best measured case and the ratio (labs.bench.sweep.best_vs_best)."""
    gpus = gpus or (torch.cuda.device_count() if torch.cuda.is_available() else 2)    # as labs.launch starts them
    budget = gpu_memory or (torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else "H200")
    plans = planner.plan(preset, gpus=gpus, gpu_memory=budget, batch_per_gpu=batch_per_gpu,
                         seq_len=seq_len or 4096)
    # labs first: stock's DeepSpeed cases wait for FusedAdam's first build, which a fresh host compiles meanwhile
    names = [p["case"] for side in ("labs", "stock") for p in [q for q in plans if q["side"] == side][:top]]
    result = run_cases(names + [n for n in extra if n not in names], preset=preset, seq_len=seq_len,
                       gpu_memory=gpu_memory, **run_options)
    tokens = batch_per_gpu * (seq_len or resolve.run_defaults(preset)["seq_len"]) * gpus
    result["sweep"] = dict(batch_per_gpu=batch_per_gpu, gpu_memory=str(budget), top=top,
                           plan=[p for p in plans if p["case"] in names or p["case"] in extra],
                           **sweep.best_vs_best(result, tokens_per_step=tokens))
    if run_options.get("out"):
        Path(os.path.realpath(run_options["out"])).write_text(json.dumps(result, indent=1) + "\n")
    return result


def _can_write(option: str, path: Path, folder=False):
    """Refuse, before any case runs, a result file or work folder that cannot be written (a case takes minutes of
    GPU time, and the result file was first written after it), and a result file labs did not write. A trial file in
    the nearest folder that exists, not access(), which says yes to root everywhere; nothing is left behind."""
    shown = path
    try:
        if not folder:
            path = Path(os.path.realpath(path))            # through a link, to what will be written
            if path.is_dir():
                raise LabsError(f"{option} '{shown}' is a folder; name the JSON file to write")
            if path.exists():
                if not _bench_result(path):
                    raise LabsError(f"{option} '{shown}' exists and is not a labs bench result; labs replaces only "
                                    "what it wrote: choose another file")
                with open(path, "a"):                      # writable, and not emptied by the check
                    return
        parent = runfolder.nearest_existing(path if folder else path.parent)
        with tempfile.NamedTemporaryFile(dir=parent, prefix=".labs-bench-check-"):
            pass
    except OSError as e:
        raise LabsError(f"{option} '{shown}': cannot write there ({e.strerror}); choose another path") from None


def _bench_result(path: Path) -> bool:
    try:                        # a regular file only: reading /dev/stdout's terminal would wait for input
        return path.is_file() and str(json.loads(path.read_text()).get("what", "")).startswith("labs bench")
    except (OSError, ValueError, AttributeError):
        return False


def finished_case(run) -> dict:
    """What a result file keeps of a finished case's run folder: summary, resolved config, per-step metrics, the
    mean DeepSpeed timers after warm-up and labs.memory's prediction (computed now, from the run's configuration)."""
    return dict(status="ok", summary=run.summary, ds_config=run.ds_config, metrics=run.metrics,
                timers_ms=_mean_timers(run.metrics, warmup=2), predicted=_predicted(run))


def with_ratios(result):
    cases = result["cases"]
    ok = {n for n, c in cases.items() if c.get("status") == "ok"}
    result["ratios"] = {f"{a} / {b}": cases[a]["summary"]["tokens_per_s_per_gpu"] / cases[b]["summary"]["tokens_per_s_per_gpu"]
                        for a, b in PAIRS if a in ok and b in ok}
    return result


def _mean_timers(records, warmup):
    kept = [r["timers_ms"] for r in records[warmup:] if r.get("timers_ms")]
    if not kept:
        return None
    return {k: statistics.mean(t[k] for t in kept) for k in kept[0]}


def _predicted(run) -> dict:
    """labs.memory's prediction for this run's configuration: the peak and what it is made of."""
    est = memory.from_run(run)
    return dict(total_per_gpu_bytes=est.total_per_gpu_bytes, peak_phase=est.peak_phase,
                model_states_per_gpu_bytes=est.model_states_per_gpu_bytes, phases=est.phases)


def _last_error_line(message: str) -> str:
    lines = [line for line in message.strip().splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or "error" in line]
    return (errors or lines or ["unknown"])[-1][:500]


def host_info() -> dict:
    info = dict(env.versions(), cuda=torch.version.cuda, cpu_cores=os.cpu_count(), hostname=platform.node(),
                omp_num_threads=os.environ.get("OMP_NUM_THREADS"))    # CPU Adam's threads: a lever of its own
    if torch.cuda.is_available():
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        try:
            info["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                            capture_output=True, text=True, timeout=20).stdout.split()[0]
        except Exception:
            info["driver"] = None
    try:
        info["host_memory_gib"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError):
        pass
    return info


def format_table(result: dict) -> str:
    rows = []
    for name, case in result["cases"].items():
        if case["status"] != "ok":
            rows.append(dict(case=name, gpus="", tok=case["status"], tflops="", mfu="", peak="", pred="",
                             timers=case.get("error", "")[:60]))
            continue
        s, t = case["summary"], case.get("timers_ms") or {}
        predicted = (case.get("predicted") or {}).get("total_per_gpu_bytes")
        rows.append(dict(case=name, gpus=str(s["world_size"]), tok=f"{s['tokens_per_s_per_gpu']:,.0f}",
                         tflops=f"{s['tflops_per_gpu']:.1f}", mfu=f"{s['mfu']:.1%}" if s.get("mfu") else "-",
                         peak=f"{max(s['peak_memory_bytes']) / 2**30:.1f}",
                         pred=f"{predicted / 2**30:.1f}" if predicted else "-",
                         timers="/".join(f"{t[k]:.0f}" for k in ("fwd", "bwd", "step") if k in t) or "-"))
    headers = dict(case="case", gpus="GPUs", tok="tokens/s/GPU", tflops="TFLOP/s", mfu="MFU", peak="peak GiB",
                   pred="pred GiB", timers="fwd/bwd/step ms")
    lines = [str(Table(rows, [(headers[k], k, "") for k in headers]))] if rows else []
    lines += [f"ratio {pair}: {ratio:.2f}x tokens/s per GPU" for pair, ratio in result["ratios"].items()]
    if result.get("sweep", {}).get("ratio"):
        best = result["sweep"]["best"]
        lines.append(f"best against best at {result['sweep']['tokens_per_step']:,} tokens per optimizer step: labs "
                     f"{best['labs']['case']} / stock {best['stock']['case']} = {result['sweep']['ratio']:.2f}x")
    return "\n".join(lines)
