"""Chapter 5's checkpoint experiments: runs that crash (through labs.checkpoint's fault hook) and are resumed or
resharded, what to read off them, each checkpoint format's size on disk against chapter 1's bytes per parameter,
and the recorded GPU save/resume timing.

    run, message = checkpoints.crashed_run("1:save:6", config="zero3.json", steps=8, save_every=2, out=...)
    resumed = launch.run(resume=run.path, stream=False)
    checkpoints.size_rows(resumed.path / "checkpoints" / "step00000004", export_dirs)
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import time
from pathlib import Path

import torch

from labs import RESULTS, checkpoint, env, launch, memory, metrics, models, resume
from labs import config as config_lib
from labs.errors import LabsError, RankFailed
from labs.runfolder import Run

# The first step after a reshard runs the same weights on the same rows; only how the rows group into matmuls
# changes (2 ranks x 2 rows, or 1 rank x 4), and with it the order in which the kernels accumulate: the loss may
# move in its last bits. 1e-5 is about ten float32 steps at a loss near 12 (a float32 step there is 9.5e-7).
SAME_WEIGHTS_TOLERANCE = 1e-5
# Later steps also sum the bf16 gradients in another order (one rank instead of a reduce-scatter of two), and the
# rounding differences feed the next steps: 1e-3 is under 1% of what the loss falls per step in these runs.
RESHARD_TOLERANCE = 1e-3
GPU_RESULTS = RESULTS / "gpu" / "checkpoints"   # apart from the bench files that results.load_all reads


def config_variant(base: str, changes: dict, path) -> Path:
    """A ds_configs/ file with `changes` (dotted keys), written to `path` so the run can name it."""
    return config_lib.write(config_lib.variant(config_lib.load(base), changes), path)


def crashed_run(kill: str, **options) -> tuple[Run | None, str]:
    """A launch.run whose rank dies where `kill` says (labs.checkpoint.FAULT_ENV: "RANK:step:STEP" after that
    step, "RANK:save:STEP" in the middle of that step's save). Returns the run folder labs kept (None when it
    kept nothing) and the error labs raised."""
    os.environ[checkpoint.FAULT_ENV] = kill
    try:
        launch.run(stream=False, **options)
    except RankFailed as failure:
        message = str(failure)
    else:
        raise AssertionError(f"the run was to crash ({kill}) and did not")
    finally:
        del os.environ[checkpoint.FAULT_ENV]
    kept = Path(options["out"])
    return (Run(kept) if (kept / resume.INTERRUPTED).is_file() else None), message


def loss_differences(losses: list[float], reference: list[float], after: int) -> list[float]:
    """|loss - reference| for the steps after `after` that both runs logged."""
    return [abs(a - b) for a, b in list(zip(losses, reference))[after:]]


def max_logit_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def bf16_steps(x: torch.Tensor, n: int) -> float:
    """n steps of bf16's grid at the size of the largest |x| (bf16 keeps 8 significant bits)."""
    return n * 2.0 ** (math.floor(math.log2(x.float().abs().max().item())) - 7)


# ---------------------------------------------------------------------------------------------- sizes
def expected_bytes_per_param(stage: int, ranks: int = 1) -> dict:
    """Chapter 1's bytes per parameter (labs.memory) for each format a ZeRO run with Adam and bf16 can write
    (`ranks`: how many wrote the checkpoint; only the universal copy depends on it)."""
    bf16, fp32, adam = memory.DTYPE_BYTES["bf16"], memory.DTYPE_BYTES["fp32"], memory.OPTIMIZERS["adamw"]
    return {"DeepSpeed checkpoint (every rank's files)": fp32 + adam + (bf16 if stage < 3 else 0),
            "universal checkpoint": (fp32 + adam) * (1 + 1 / ranks), "16-bit model (save_16bit_model)": bf16,
            "Hugging Face export, fp32 (zero_to_fp32)": fp32, "Hugging Face export, bf16": bf16}


WHY = {"DeepSpeed checkpoint (every rank's files)": "fp32 master weights + Adam's two moments, every rank's "
       "partition; ZeRO-1/2 add the bf16 module weights (rank 0), ZeRO-3 only their shapes",
       "universal checkpoint": "the same fp32 weights and moments, one folder per parameter, whole; plus rank 0's "
       "optimizer file copied whole as the 'common' state (DeepSpeed 0.19.8): 12/N more",
       "16-bit model (save_16bit_model)": "the bf16 weights ZeRO-3 gathers on save",
       "Hugging Face export, fp32 (zero_to_fp32)": "the fp32 master weights, consolidated",
       "Hugging Face export, bf16": "the master weights rounded to what the run computed with"}


def size_rows(path: Path, exports: dict, universal: Path | None = None, preset_7b="qwen-7b",
              ranks_7b=8) -> list[dict]:
    """Bytes on disk of each format of the checkpoint at `path` (exports: {"fp32": folder, "bf16": folder}), per
    parameter, next to chapter 1's bytes per parameter, and what that means for a 7B model on `ranks_7b` GPUs."""
    manifest = checkpoint.manifest(path)
    params = models.param_counts(manifest["dims"])["total"]
    params_7b = models.param_counts(models.shape(preset_7b))["total"]
    expected = expected_bytes_per_param(manifest["zero_stage"], manifest["world_size"])
    expected_7b = expected_bytes_per_param(manifest["zero_stage"], ranks_7b)
    deepspeed = sum(size for name, size in manifest["files"].items()
                    if name.endswith("_states.pt"))
    measured = {"DeepSpeed checkpoint (every rank's files)": deepspeed,
                "universal checkpoint": _folder_bytes(universal) if universal else None,
                "16-bit model (save_16bit_model)": manifest["files"].get(checkpoint.SIXTEEN_BIT),
                "Hugging Face export, fp32 (zero_to_fp32)": _weights_bytes(exports.get("fp32")),
                "Hugging Face export, bf16": _weights_bytes(exports.get("bf16"))}
    return [dict(format=name, measured_bytes=measured[name], per_param=measured[name] / params if measured[name]
                 else None, expected_per_param=expected[name], bytes_7b=expected_7b[name] * params_7b, why=WHY[name])
            for name in expected]


def _weights_bytes(folder) -> int | None:
    return sum(p.stat().st_size for p in Path(folder).glob("*.safetensors")) if folder else None


def _folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())


# ---------------------------------------------------------------------------------------------- GPU timing
def gpu_results() -> list[dict]:
    """Recorded save/resume timings (results/gpu/checkpoints/), oldest first, each with its file name."""
    return [dict(json.loads(p.read_text()), file=str(p.relative_to(RESULTS.parent)))
            for p in sorted(GPU_RESULTS.glob("checkpoint_*.json"))]


def gpu_timing_blocker(out, preset="qwen2.5-7b", config="zero3.json", steps=2, **options) -> str | None:
    """Why time_save_resume cannot run here (None when it can): no GPU, a run labs.memory says does not fit
    (launch.prepare's own check), Liger Kernel asked for and missing, or too little disk for the checkpoint."""
    if not torch.cuda.is_available():
        return "no GPU here"
    if "liger" in (options.get("kernels"), options.get("loss")) and importlib.util.find_spec("liger_kernel") is None:
        return "Liger Kernel is not installed (pip install liger-kernel)"
    try:
        launch.prepare(preset=preset, config=config, steps=steps, save_every=steps, out=str(Path(out) / "save"),
                       **options)
    except LabsError as refused:
        return str(refused)
    need = 1.2 * expected_bytes_per_param(3)["DeepSpeed checkpoint (every rank's files)"] * \
        models.param_counts(models.shape(preset))["total"]       # the checkpoint and some room
    parent = Path(out)
    while not parent.exists():
        parent = parent.parent
    free = shutil.disk_usage(parent).free
    return None if free >= need else f"{free / 1e9:.0f} GB free under '{parent}', {need / 1e9:.0f} GB needed"


def drop_page_cache() -> bool:
    """Flush dirty pages and drop the Linux page cache, so that a load that follows reads the disk, not memory
    (root only: /proc/sys/vm/drop_caches). Returns whether it was dropped."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def time_save_resume(out, preset="qwen2.5-7b", config="zero3.json", steps=2, cold_load=False, **options) -> dict:
    """On a GPU host: a run that saves a checkpoint at its last step, then that run resumed for one more step
    without saving. The save's seconds and bytes come from the checkpoint's manifest, the load's from the resumed
    run's resumed.json. `cold_load`: drop the host's page cache between the two (drop_page_cache; it touches the
    whole host, so only when asked). Needs the disk for one checkpoint (12 bytes per parameter at ZeRO-3)."""
    out = Path(out)
    start = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    saved = launch.run(preset=preset, config=config, steps=steps, save_every=steps, out=out / "save", stream=False,
                       **options)
    manifest = checkpoint.manifest(checkpoint.complete(saved.path)[-1])
    cold = cold_load and drop_page_cache()
    resumed = launch.run(resume=saved.path, steps=steps + 1, save_every=None, out=out / "resume", stream=False)
    load = json.loads((resumed.path / checkpoint.RESUMED).read_text())
    gb = manifest["bytes"] / 1e9
    return dict(measured=start, what="one save and one resume of a ZeRO checkpoint, timed by labs",
                device=metrics.device_name(), gpus=saved.summary["world_size"], preset=preset,
                params=saved.summary["params"], zero_stage=manifest["zero_stage"], config=saved.spec["config"],
                checkpoint_bytes=manifest["bytes"], save_seconds=manifest["save_seconds"],
                fsync_seconds=manifest["fsync_seconds"],
                save_gb_per_s=gb / (manifest["save_seconds"] + manifest["fsync_seconds"]),
                save_note="write and flush to disk (fsync) together", load_seconds=load["load_seconds"],
                load_gb_per_s=gb / load["load_seconds"],
                load_note="the host's page cache was dropped before the load: a read from the disk" if cold else
                "the load reads files written moments before: part of them may come from the host's page cache, "
                "not the disk",
                first_loss_after_resume=resumed.losses[steps],
                loss_before=saved.losses[-1], versions=env.versions(),
                command=f"labs.course.checkpoints.time_save_resume(out, preset={preset!r}, config={config!r}, "
                        f"steps={steps}, cold_load={cold_load}, **{options!r})")
