"""`labs autotune`: DeepSpeed's own autotuner (`deepspeed --autotuning tune`, DeepSpeed 0.19.8) driving labs'
training loop, and what it found.

    from labs.bench import autotune
    found = autotune.run(preset="tiny", config="zero3.json", stages=(3,), micro_batches=(1, 2), batch_per_gpu=2,
                         nproc=1, out="runs/autotune")
    found["experiments"]      # one row per candidate: stage, micro-batch, accumulation, tokens/s, labs' peak, error
    found["pick"]             # the autotuner's choice (its ds_config_optimal.json)

The autotuner starts one short training per candidate and keeps the fastest by DeepSpeed's own timers. labs gives it
- a config whose `train_micro_batch_size_per_gpu` is the list to try, with accumulation 1 and
  `zero_optimization.stage` the list of stages. The autotuner then runs micro-batch m with accumulation
  max(list) // m: with every m dividing `batch_per_gpu` = max(list), each candidate trains the same sequences per
  optimizer step (like for like);
- labs/bench/autotune_rank.py, the script each experiment's ranks run: labs' training loop with that config.
What a user should know about what it tunes, read from its source and checked by the tests:
- each experiment's `zero_optimization` is the stage alone, {"stage": N}: its micro-batch sweep (with `fast` on or
  off) drops every other key the config had, overlap_comm and bucket sizes included, so the candidates run
  DeepSpeed's defaults for them; in fast mode, which labs sets, so does the optimal config it writes;
- it first runs a model-info profile (one forward at micro-batch 1), then the candidates one after another;
- its metric is samples/s from DeepSpeed's forward, backward and step timers over one optimizer step: step
  end + 1, where the engine exits (the timers restart at every step while its flops profiler is on, which it is
  for the step after `start_profile_step`, a slower step).
labs keeps each experiment's own step times and peak memory (metrics.jsonl) beside the autotuner's figure; labs'
figure for a candidate is the median of its steps but the first and the profiled one.
Stopped (Ctrl-C, SIGTERM) or failed, the autotuner's finished candidates are still published, with autotune.json's
`complete` false and no pick: a long sweep is not lost with its last candidate.
Under --gpu-memory the autotuner plans for the cap, not the whole card (labs/bench/autotune_launcher.py).
Its clean-up step calls `pdsh -w HOST pkill -f NAME`; on one host labs puts a `pdsh` that does nothing first on the
PATH: the experiment's ranks are already gone with its launcher, and a pkill by name could hit processes labs did
not start. Several hosts are not supported here.
"""
from __future__ import annotations

import json
import random
import socket
import sys
import threading
import time
from pathlib import Path

from tqdm.auto import tqdm

from labs import env as env_lib
from labs import launch, metrics, runfolder, supervisor
from labs.errors import LabsError, RankFailed, RunStopped
from labs.table import Table

RANK_SCRIPT = Path(__file__).with_name("autotune_rank.py")
GPU_MEMORY_ENV = "LABS_AUTOTUNE_GPU_MEMORY_BYTES"       # read by labs.bench.autotune_launcher
STAGES = (1, 2, 3)
SHIMS = {"pdsh": "#!/bin/sh\n# labs: the autotuner's clean-up (pdsh ... pkill -f NAME) is not needed on one host\n"
                 "exit 0\n",
         # the autotuner starts each experiment as `deepspeed ...`: DeepSpeed may be importable without its script
         "deepspeed": f"#!/bin/sh\nexec '{sys.executable}' -m deepspeed.launcher.runner \"$@\"\n"}


def check(stages, micro_batches, batch_per_gpu) -> tuple[list[int], list[int]]:
    stages, micro_batches = sorted(set(stages)), sorted(set(micro_batches))
    if not stages or any(s not in STAGES for s in stages):
        raise LabsError(f"--stages {','.join(map(str, stages))}: each must be one of {', '.join(map(str, STAGES))}")
    if not micro_batches or any(m < 1 or batch_per_gpu % m for m in micro_batches) or \
            max(micro_batches) != batch_per_gpu:
        raise LabsError(f"--micro-batches {','.join(map(str, micro_batches))}: each must divide --batch-per-gpu "
                        f"{batch_per_gpu}, the largest equal to it (every candidate trains the same batch)")
    return stages, micro_batches


def tuner_config(resolved: dict, stages, micro_batches, work: Path, start_step: int, end_step: int) -> dict:
    """The config the autotuner reads: labs' resolved config with the lists to tune and the autotuning block."""
    config = {k: v for k, v in resolved.items() if k != "train_batch_size"}
    config["train_micro_batch_size_per_gpu"] = list(micro_batches)
    config["gradient_accumulation_steps"] = 1
    config["zero_optimization"] = {**resolved.get("zero_optimization", {}), "stage": list(stages)}
    config["autotuning"] = {"enabled": True, "fast": True, "metric": "throughput", "overwrite": False,
                            "start_profile_step": start_step, "end_profile_step": end_step,
                            "results_dir": str(work / "results"), "exps_dir": str(work / "exps")}
    return config


def run(preset="tiny", config="zero3.json", stages=(2, 3), micro_batches=(1, 2, 4, 8), batch_per_gpu=8, nproc=None,
        out="runs/autotune", start_step=3, end_step=5, stream=True, **train_options) -> dict:
    """Run the autotuner over `stages` x `micro_batches` at `batch_per_gpu` sequences per GPU per optimizer step;
    `train_options` are labs.launch.inputs' (loss, kernels, activation_checkpointing, seq_len, gpu_memory, ...).
    Writes `out` (a labs run folder: autotune.json, the autotuner's results/ and log) and returns autotune.json."""
    stages, micro_batches = check(stages, micro_batches, batch_per_gpu)
    if not 1 <= start_step <= end_step:
        raise LabsError(f"profiled steps {start_step}..{end_step}: need 1 <= start <= end")
    spec, resolved = launch.prepare(preset=preset, config=config, steps=end_step + 1, out=out, nproc=nproc,
                                    micro_batch=max(micro_batches), grad_accum=1, memory_check=False,
                                    instruments=(), **train_options)
    if spec["engine"] != "deepspeed" or spec.get("nodes"):
        raise LabsError(f"--config {config}: the autotuner tunes DeepSpeed ZeRO on one host; this is {spec['engine']}")
    spec["progress"] = "lines"
    out = Path(spec["out"])
    about = dict(command=f"labs autotune (labs.bench.autotune.run): preset {preset}, config {config}, stages {stages}, "
                         f"micro-batches {micro_batches}, {batch_per_gpu} sequences per GPU per step",
                 preset=preset, gpus=spec["nproc"], seq_len=spec["seq_len"], batch_per_gpu=batch_per_gpu,
                 profiled_steps=[start_step, end_step],
                 options={k: spec[k] for k in ("loss", "kernels", "activation_checkpointing", "stock", "gpu_memory_bytes")})
    with runfolder.claim(out) as work:
        command, env = _prepare(work, spec, tuner_config(resolved, stages, micro_batches, work, start_step, end_step))
        started, log = time.perf_counter(), work / "autotune.log"
        try:
            with _progress(log, 1 + len(stages) * len(micro_batches), stream):
                code = supervisor.run(command, env, log, echo=False)
        except (KeyboardInterrupt, RunStopped) as stop:
            stop.kept = _keep_partial(work, out, spec, about, started)
            raise
        if code != 0 or not (work / "results" / "ds_config_optimal.json").exists():
            tail = log.read_text(errors="replace")[-3000:]
            kept = _keep_partial(work, out, spec, about, started)
            raise RankFailed(f"the autotuner exited with code {code} without an optimal config; {kept}; its log ended:"
                             f"\n{tail}")
        found = _write(work, spec, about, started, complete=True)
        runfolder.publish(work, out)
    return found


def _prepare(work: Path, spec: dict, tuner: dict) -> tuple[list[str], dict]:
    """Write the autotuner's inputs into `work`; return its command and environment."""
    base, shims = work / "base", work / "bin"
    base.mkdir()
    shims.mkdir()
    (base / "run.json").write_text(json.dumps(spec, indent=1) + "\n")
    (base / "autotune_config.json").write_text(json.dumps(tuner, indent=1) + "\n")
    for name, text in SHIMS.items():
        (shims / name).write_text(text)
        (shims / name).chmod(0o755)
    env, _ = env_lib.repaired_environment(spec["nproc"], False)
    env["PYTHONPATH"] = env_lib.importable_path(env)
    env["PATH"] = f"{shims}:{env.get('PATH', '')}"
    if spec["device"] == "cpu":
        # DeepSpeed's CPU accelerator counts its "devices" as NUMA nodes unless LOCAL_SIZE says otherwise
        env.update(env_lib.CPU_ONLY, LOCAL_SIZE=str(spec["nproc"]))
    if spec.get("gpu_memory_bytes"):
        env[GPU_MEMORY_ENV] = str(spec["gpu_memory_bytes"])      # the autotuner plans for the cap
    command = [sys.executable, "-m", "labs.bench.autotune_launcher", "--autotuning", "tune",
               f"--num_gpus={spec['nproc']}", f"--master_port={_free_port_range(64)}", str(RANK_SCRIPT),
               str(base), "--deepspeed_config", str(base / "autotune_config.json")]
    (work / "command.txt").write_text(" ".join(command) + "\n")
    return command, env


def _write(work: Path, spec: dict, about: dict, started: float, complete: bool) -> dict:
    found = dict(collect(work / "results", spec), **about, complete=complete, seconds=time.perf_counter() - started,
                 measured=time.strftime("%Y-%m-%dT%H:%M:%S%z"), versions=env_lib.versions())
    (work / "autotune.json").write_text(json.dumps(found, indent=1) + "\n")
    return found


def _keep_partial(work: Path, out: Path, spec: dict, about: dict, started: float) -> str:
    """A stopped or failed autotuner: publish the candidates that finished (autotune.json says complete: false), so
    hours of trials are not lost; with none finished, nothing is kept."""
    results = work / "results"
    if not results.is_dir() or not any((d / "metrics.json").exists() for d in results.iterdir()):
        return "no candidate had finished, nothing was kept"
    found = _write(work, spec, about, started, complete=False)
    runfolder.publish(work, out)
    return f"the {sum('tokens_per_s_per_gpu' in r for r in found['experiments'])} finished candidates are kept in {out}" \
           " (autotune.json: complete false, no pick)"


def collect(results: Path, spec: dict) -> dict:
    """Every experiment of an autotuner results folder, with the autotuner's pick (None if it never chose) and the
    model-info run."""
    rows, model_info = [], None
    for exp_dir in sorted(p for p in results.iterdir() if (p / "exp.json").exists()):
        exp = json.loads((exp_dir / "exp.json").read_text())
        if exp["name"] == "profile_model_info":
            info = exp_dir / "model_info.json"
            model_info = json.loads(info.read_text()) if info.exists() else None
            continue
        rows.append(experiment_row(exp_dir, exp["ds_config"], spec))
    optimal_file = results / "ds_config_optimal.json"
    if not optimal_file.exists():                # the autotuner was stopped before it chose
        return dict(experiments=rows, pick=None, model_info=model_info)
    optimal = json.loads(optimal_file.read_text())
    pick = next(r for r in rows if (r["stage"], r["micro_batch"]) ==
                (optimal["zero_optimization"]["stage"], optimal["train_micro_batch_size_per_gpu"]))
    return dict(experiments=rows, pick=pick["name"], model_info=model_info)


def experiment_row(exp_dir: Path, ds_config: dict, spec: dict) -> dict:
    """One candidate: the autotuner's throughput (as tokens/s per GPU), labs' step times and peak, or its error."""
    gpus = spec["nproc"]
    row = dict(name=exp_dir.name, stage=ds_config["zero_optimization"]["stage"],
               micro_batch=ds_config["train_micro_batch_size_per_gpu"],
               grad_accum=ds_config["gradient_accumulation_steps"], zero_keys=sorted(ds_config["zero_optimization"]))
    tuner_file = exp_dir / "metrics.json"
    if tuner_file.exists():
        tuner = json.loads(tuner_file.read_text())
        row.update(tokens_per_s_per_gpu=tuner["throughput"] * spec["seq_len"] / gpus, step_s=tuner["latency"] / 1e6)
    else:
        stderr = exp_dir / "stderr.log"
        lines = stderr.read_text(errors="replace").strip().splitlines() if stderr.exists() else []
        row["error"] = lines[-1] if lines else "no metrics.json: stopped before its profiled steps ended"
    steps = exp_dir / "labs_run" / "metrics.jsonl"
    records = metrics.read_jsonl(steps) if steps.exists() else []
    if records:
        # the first step warms up, and the flops profiler runs on the step after start_profile_step (slower)
        profiled = ds_config["autotuning"]["start_profile_step"] + 1
        seconds = metrics.median_after_warmup([r["step_time_s"] for r in records if r["step"] != profiled], warmup=1)
        row.update(labs_step_s=seconds,
                   labs_tokens_per_s_per_gpu=row["micro_batch"] * row["grad_accum"] * spec["seq_len"] / seconds,
                   labs_steps=len(records), memory_kind=records[0]["memory_kind"],
                   peak_gib=max(max(r["peak_memory_bytes"]) for r in records) / 2**30)
    return row


def table(found: dict) -> Table:
    """The experiments as a table (a value an experiment did not produce shows as "-")."""
    def value(key, spec):
        return lambda row: format(row[key], spec) if key in row else "-"

    return Table(found["experiments"], [
        ("experiment", "name", ""), ("stage", "stage", ""), ("micro-batch", "micro_batch", ""),
        ("accum.", "grad_accum", ""), ("tokens/s/GPU (autotuner)", value("tokens_per_s_per_gpu", ",.0f"), ""),
        ("tokens/s/GPU (labs)", value("labs_tokens_per_s_per_gpu", ",.0f"), ""), ("peak GiB", value("peak_gib", ".1f"), ""),
        ("error", lambda row: row.get("error", "")[:80], "")])


def _free_port_range(count: int) -> int:
    """A base port whose next `count` ports are free now (the autotuner gives experiment k the port base + k)."""
    for _ in range(100):
        base = random.randrange(20000, 60000 - count)
        if all(_port_free(base + k) for k in range(count)):
            return base
    raise LabsError("no free range of local ports for the autotuner's experiments")


def _port_free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


class _progress:
    """A tqdm bar over the autotuner's experiments, advanced from its log ("Done running exp_id = ...")."""
    def __init__(self, log: Path, total: int, show: bool):
        self.log, self.total, self.show, self.stop = log, total, show, threading.Event()

    def __enter__(self):
        if self.show:
            self.thread = threading.Thread(target=self._watch, daemon=True)
            self.thread.start()
        return self

    def _watch(self):
        with tqdm(total=self.total, desc="autotuner experiments", unit="exp") as bar:
            while True:
                stopping = self.stop.wait(1.0)
                done = self.log.read_text(errors="replace").count("Done running exp_id") if self.log.exists() else 0
                bar.update(min(done, self.total) - bar.n)
                if stopping:
                    return

    def __exit__(self, *exc):
        self.stop.set()
        if self.show:
            self.thread.join()
