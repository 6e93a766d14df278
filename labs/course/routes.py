"""Chapter 8's routes into DeepSpeed and FSDP, each launched as a real multi-process job by its own stock launcher,
on the same model, data, seed and hyperparameters as a `labs train` run, so the per-step losses compare:

    trainer = routes.run("trainer", RUNS / "08" / "trainer", nproc=2, config="zero3.json", launcher="deepspeed")
    ds = routes.run("accelerate", RUNS / "08" / "acc_ds", nproc=2,
                    accelerate_config="accelerate_configs/deepspeed_zero2.yaml")
    trainer.losses, trainer.metrics, trainer.ds_config, trainer.ranks[0]["param_elements_held"]

The hyperparameters (micro-batch, accumulation, learning rate, Adam's betas and eps, weight decay, warm-up, clipping)
are what labs.resolve makes of the same DeepSpeed file for `labs train`; the route's own filler (HF's, accelerate's)
then fills the file's "auto" entries from them. The rank count is the caller's `nproc` on every launcher (accelerate
gets it as --num_processes, over the YAML's value). Bad input raises LabsError before anything starts or is written.
"""
from __future__ import annotations

import json
import re
import shlex
import sys
import time
from pathlib import Path

import torch
import yaml

from labs import ROOT, launch, rendezvous, runcache, runfolder, supervisor
from labs import config as config_lib
from labs.course import stages
from labs.env import importable_path, repaired_environment
from labs.errors import LabsError, RankFailed, check_choice

ROUTES = ("trainer", "accelerate")
LAUNCHERS = {"trainer": ("deepspeed", "torchrun"), "accelerate": ("accelerate",)}
ACCELERATE_TYPES = ("DEEPSPEED", "FSDP")
CHECKPOINTED = "zero_optimization.stage3_gather_16bit_weights_on_model_save"


def chapter_ranks() -> int:
    """The rank count chapter 8 runs everything with: 2 processes (gloo) on a machine without a GPU, else one per
    GPU, at most 2 (one GPU gives one rank)."""
    return min(2, torch.cuda.device_count()) if torch.cuda.is_available() else 2


def prepare(route, *, out, config="zero3.json", accelerate_config=None, launcher=None, preset="tiny", steps=8,
            seed=0, nproc=None, checkpoint_step=None) -> dict:
    """Check every input and return the route's spec (what RUN_DIR/route.json holds). `config` is the DeepSpeed
    file the Trainer gets (route "trainer") or whose resolved optimizer and schedule an FSDP run uses; an accelerate
    DEEPSPEED YAML names its own file. `checkpoint_step`: the Trainer saves a checkpoint there and a second Trainer
    resumes from it in the same job."""
    check_choice("route", route, ROUTES)
    launcher = launcher or LAUNCHERS[route][0]
    check_choice(f"launcher for route '{route}'", launcher, LAUNCHERS[route])
    yaml_config = _accelerate_yaml(accelerate_config) if route == "accelerate" else None
    if route == "accelerate" and yaml_config["distributed_type"] == "DEEPSPEED":
        config = yaml_config["deepspeed_file"]
    labs_spec, resolved = launch.prepare(preset=preset, config=config, steps=steps, nproc=nproc, seed=seed, out=out,
                                         instruments=())
    if checkpoint_step is not None and (route != "trainer" or not 0 < checkpoint_step < steps):
        raise LabsError(f"checkpoint_step {checkpoint_step!r}: only the trainer route resumes, from a step between 1 "
                        f"and {steps - 1}")
    optimizer, schedule = resolved.get("optimizer", {}).get("params", {}), resolved.get("scheduler", {})
    hyper = dict(micro_batch=resolved["train_micro_batch_size_per_gpu"],
                 grad_accum=resolved["gradient_accumulation_steps"], lr=optimizer.get("lr"),
                 betas=optimizer.get("betas", [0.9, 0.999]), eps=optimizer.get("eps", 1e-8),
                 weight_decay=optimizer.get("weight_decay", 0.0), clip=resolved.get("gradient_clipping", 0.0),
                 warmup_steps=schedule.get("params", {}).get("warmup_num_steps", 0))
    return dict(route=route, launcher=launcher, preset=preset, steps=steps, seed=seed, nproc=labs_spec["nproc"],
                seq_len=labs_spec["seq_len"], data=None, precision=labs_spec["precision"], hyper=hyper,
                scheduler=schedule, config=str(config_lib.find(config)), accelerate_config=yaml_config,
                checkpoint_step=checkpoint_step)


def run(route, out, stream=False, label=None, **kwargs) -> "RouteRun":
    """Launch one route (keyword arguments of `prepare`) and wait; returns the finished run folder. `label`: print
    one line when it starts and one when it is done; `stream`: copy the launcher's output as it comes."""
    spec = prepare(route, out=out, **kwargs)
    if label:
        print(f"{label}: {spec['steps']} steps of '{spec['preset']}' on {spec['nproc']} ranks ...", end=" ", flush=True)
    start = time.perf_counter()
    out = Path(out)
    env, _ = repaired_environment(spec["nproc"], cpu_offload=False)
    env.update(PYTHONPATH=importable_path(env), HF_HUB_OFFLINE="1")
    # Under `make test` the same route launched twice (chapter 8's Trainer job, tests/test_trainer_routes.py's) is
    # trained once: the key covers the spec, the DeepSpeed and accelerate files' contents and the environment variables
    # that change what the ranks do (labs.runcache.RANK_ENV and RANK_ENV_PREFIXES).
    files = dict(config=config_lib.load(spec["config"]),
                 accelerate=spec["accelerate_config"] and Path(spec["accelerate_config"]["path"]).read_text())
    reuse = runcache.key(spec, files, env)
    ledger = dict(spec, out=str(out), engine=f"{route} route ({spec['launcher']} launcher)")
    # the ranks write into a partial folder, published when all have finished
    with runfolder.claim(out) as work, runcache.held(reuse):
        if spec["route"] == "trainer" or spec["accelerate_config"]["distributed_type"] == "DEEPSPEED":
            spec["ds_config"] = str(_ds_config_for_ranks(spec, work))
        if spec["checkpoint_step"]:
            resumed = config_lib.variant(config_lib.load(spec["ds_config"]), {CHECKPOINTED: True})
            spec["resume_ds_config"] = str(config_lib.write(resumed, work / "ds_config_resume.json"))
        reused = runcache.restore(reuse, work, spec, spec_file="route.json")
        if not reused:
            command = launcher_command(spec, work)
            (work / "route.json").write_text(json.dumps(spec, indent=1) + "\n")
            (work / "command.txt").write_text(shlex.join(command) + "\n")
            # Owned as labs train owns torchrun: an interrupt stops the launcher's whole session, ranks included.
            with supervisor.own_tmpdir(env) as launch_env:
                code = supervisor.run(command, launch_env, work / "launch.log", echo=stream)
            if code != 0 or len(list(work.glob("rank*.json"))) != spec["nproc"]:
                raise RankFailed(_failure(work, code))
        runfolder.publish(work, out)
        runcache.store(reuse, out)                  # nothing to do for a reused job: its key is stored
        runcache.note(reuse, ledger, reused, time.perf_counter() - start)
    if label:
        origin = (f" (the same job, launched earlier in this make test: "
                  f"{json.loads((out / runcache.NOTE).read_text())['from']})" if reused else "")
        print(f"done in {time.perf_counter() - start:.0f} s{origin}", flush=True)
    return RouteRun(out)


# The reference runs carry chapters 2 and 3's instruments, which read the engine and change no loss: chapter 3's
# 8-step zero3.json run is then this very run, and `make test` (labs.runcache) trains it once for both chapters.
REFERENCE_INSTRUMENTS = stages.ALL_INSTRUMENTS


def reference(out, config="zero3.json", steps=8, label=None, **kwargs):
    """The `labs train` run the routes are compared with (labs.launch.run), announced like a route."""
    if label:
        spec, _ = launch.prepare(config=config, steps=steps, out=out, instruments=REFERENCE_INSTRUMENTS, **kwargs)
        print(f"{label}: {steps} steps of '{spec['preset']}' on {spec['nproc']} ranks ...", end=" ", flush=True)
    start = time.perf_counter()
    run = launch.run(config=config, steps=steps, out=out, stream=False, instruments=REFERENCE_INSTRUMENTS, **kwargs)
    if label:
        print(f"done in {time.perf_counter() - start:.0f} s", flush=True)
    return run


def shown_command(run_path) -> str:
    """A run folder's command.txt as a reader would type it: `python`, paths from the repository root, the run
    folder as RUN and the rendezvous port as PORT (both change from run to run)."""
    words = shlex.split((Path(run_path) / "command.txt").read_text())
    shown = []
    for word in words:
        relative = re.sub(r"[^\s=]*\.partial-\d+", "RUN", word.replace(f"{ROOT}/", ""))    # route_rank's RUN
        word = "python" if word == sys.executable else relative
        shown.append("PORT" if shown and shown[-1] in ("--master_port", "--main_process_port") else word)
    return " ".join(shown)


def launcher_command(spec: dict, run_dir: Path) -> list[str]:
    """The stock launcher's command line for a route (run from the repository root)."""
    script = ["labs.course.route_rank", str(run_dir)]
    port = str(rendezvous.free_port())
    if spec["launcher"] == "deepspeed":
        return [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(spec["nproc"]),
                "--master_port", port, "--no_local_rank", "--module", *script]
    if spec["launcher"] == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={spec['nproc']}",
                "-m", *script]
    yaml_config = spec["accelerate_config"]
    # --num_processes from the run's rank count: the YAML's own value is for the reader's copy of the file
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", yaml_config["path"],
               "--num_processes", str(spec["nproc"]), "--main_process_port", port]
    if yaml_config["distributed_type"] == "DEEPSPEED":
        command += ["--deepspeed_config_file", spec["ds_config"]]
    return command + ["-m", *script]


def _ds_config_for_ranks(spec, work: Path) -> Path:
    """The DeepSpeed file the ranks get, always copied into the run folder (RUN/ds_config.json): the route's file as
    it is, except on a machine without a GPU, where DeepSpeed's default AdamW is a fused kernel it would first
    compile (minutes): there torch's AdamW is asked for with torch_adam (labs.resolve does the same for `labs
    train`)."""
    raw = config_lib.load(spec["config"])
    if not torch.cuda.is_available() and "optimizer" in raw and not config_lib.offloads(raw)["optimizer"]:
        raw = config_lib.variant(raw, {"optimizer.params.torch_adam": True})
    return config_lib.write(raw, work / "ds_config.json")


def _accelerate_yaml(path) -> dict:
    """What labs needs from an accelerate config file, checked: its type, process count, and DeepSpeed file."""
    if path is None:
        raise LabsError("route 'accelerate' needs accelerate_config: a YAML file such as "
                        "accelerate_configs/deepspeed_zero2.yaml")
    found = Path(path) if Path(path).is_absolute() else ROOT / path
    if not found.is_file():
        raise LabsError(f"accelerate config '{path}' does not exist; pass a YAML file such as "
                        "accelerate_configs/fsdp2.yaml")
    try:
        loaded = yaml.safe_load(found.read_text())
    except yaml.YAMLError as exc:
        raise LabsError(f"accelerate config '{path}' is not valid YAML: {str(exc).splitlines()[0]}") from None
    if not isinstance(loaded, dict):
        raise LabsError(f"accelerate config '{path}' must hold a YAML mapping")
    kind = loaded.get("distributed_type")
    if kind not in ACCELERATE_TYPES:
        raise LabsError(f"accelerate config '{path}': distributed_type is {kind!r}; this chapter runs "
                        f"{' or '.join(ACCELERATE_TYPES)}")
    if not isinstance(loaded.get("num_processes"), int):
        raise LabsError(f"accelerate config '{path}': num_processes must be an integer")
    result = dict(path=str(found), distributed_type=kind, num_processes=loaded["num_processes"])
    if kind == "DEEPSPEED":
        name = (loaded.get("deepspeed_config") or {}).get("deepspeed_config_file")
        if not name:
            raise LabsError(f"accelerate config '{path}': deepspeed_config.deepspeed_config_file is missing; name a "
                            "DeepSpeed JSON file (relative to the repository root)")
        file = Path(name) if Path(name).is_absolute() else ROOT / name
        if not file.is_file():
            raise LabsError(f"accelerate config '{path}': deepspeed_config.deepspeed_config_file '{name}' does not "
                            "exist (relative paths are read from the repository root)")
        config_lib.load(file)       # accelerate reads it with json: plain JSON, no comments
        result["deepspeed_file"] = str(file)
    return result


def _failure(work: Path, code: int) -> str:
    errors = sorted(work.glob("rank*.err"), key=lambda p: p.stat().st_mtime)
    if errors:
        rank = errors[0].stem.replace("rank", "rank ")
        return f"{rank} failed (launcher exit code {code}):\n" + errors[0].read_text()
    tail = (work / "launch.log").read_bytes()[-4000:].decode("utf-8", "replace")
    return f"the launcher exited with code {code} before any rank reported an error; its output ended:\n{tail}"


class RouteRun:
    """A finished route folder: route.json, command.txt, launch.log and one rank<r>.json per rank."""

    def __init__(self, path):
        self.path = Path(path)
        self.spec = json.loads((self.path / "route.json").read_text())
        self.ranks = [json.loads((self.path / f"rank{r}.json").read_text()) for r in range(self.spec["nproc"])]

    @property
    def metrics(self) -> list[dict]:
        """Per step: the mean of the ranks' losses (as `labs train` records it), the learning rate and the
        gradient norm rank 0 saw."""
        return _metrics(self.ranks)

    @property
    def losses(self) -> list[float]:
        return [m["loss"] for m in self.metrics]

    @property
    def ds_config(self) -> dict | None:
        """The DeepSpeed config as the engine got it, every "auto" filled (None under FSDP)."""
        return self.ranks[0].get("ds_config")

    @property
    def resumed(self) -> list[dict] | None:
        """The resumed Trainer's steps (trainer route with checkpoint_step), numbered from the checkpoint on."""
        if "resumed" not in self.ranks[0]:
            return None
        first = self.spec["checkpoint_step"] + 1
        return [dict(m, step=m["step"] + first - 1) for m in _metrics([r["resumed"] for r in self.ranks])]


def _metrics(ranks: list[dict]) -> list[dict]:
    rows = []
    for i, losses in enumerate(zip(*[r["losses"] for r in ranks])):
        rows.append(dict(step=i + 1, loss=sum(losses) / len(losses), rank_losses=list(losses),
                         lr=ranks[0]["lrs"][i], grad_norm=ranks[0]["grad_norms"][i]))
    return rows

