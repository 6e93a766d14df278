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
from labs.runfolder import Run, nearest_existing

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
def tied_share(dims: dict) -> float:
    """The share of a model's parameters in an output layer tied to the input embedding (0 when untied)."""
    if not dims.get("tie_word_embeddings"):
        return 0.0
    return dims["vocab_size"] * dims["hidden_size"] / models.param_counts(dims)["total"]


def expected_bytes_per_param(stage: int, ranks: int = 1, tied: float = 0.0) -> dict:
    """Chapter 1's bytes per parameter (labs.memory) for each format a ZeRO run with Adam and bf16 can write
    (`ranks`: how many wrote the checkpoint; `tied`: tied_share of the model). Only the universal copy depends on
    them, and on the stage, as DeepSpeed 0.19.8's ds_to_universal writes it: every parameter's fp32 weights and
    moments whole, plus
    - ZeRO-3 (_save_optimizer_state_stage3): rank 0's optimizer file copied whole as the common state, so its
      partition again (12 / ranks);
    - ZeRO-1/2 (_save_optimizer_state): the common state without the partitions (a few KiB), and the model-states
      file copied (the bf16 module, 2); a tied output layer has no optimizer state of its own, so the converter
      writes its weight again, in fp32, from the module (4 x tied)."""
    bf16, fp32, adam = memory.DTYPE_BYTES["bf16"], memory.DTYPE_BYTES["fp32"], memory.OPTIMIZERS["adamw"]
    states = fp32 + adam
    universal = states * (1 + 1 / ranks) if stage >= 3 else states + bf16 + fp32 * tied
    return {"DeepSpeed checkpoint (every rank's files)": states + (bf16 if stage < 3 else 0),
            "universal checkpoint": universal, "16-bit model (save_16bit_model)": bf16,
            "Hugging Face export, fp32 (zero_to_fp32)": fp32, "Hugging Face export, bf16": bf16}


def why(stage: int) -> dict:
    """What each format holds, for a checkpoint written at `stage`."""
    universal = ("the fp32 weights and moments, whole, one folder per parameter; plus rank 0's optimizer file, "
                 "copied whole as the 'common' state: 12/N more" if stage >= 3 else
                 "the fp32 weights and moments, whole, one folder per parameter; plus the model-states file (the "
                 "bf16 module) and a tied output layer's weight again in fp32")
    return {"DeepSpeed checkpoint (every rank's files)": "fp32 master weights + Adam's two moments, every rank's "
            "partition; " + ("the bf16 weights only as shapes" if stage >= 3 else "the bf16 module (rank 0)"),
            "universal checkpoint": universal,
            "16-bit model (save_16bit_model)": "the bf16 weights ZeRO-3 gathers on save",
            "Hugging Face export, fp32 (zero_to_fp32)": "the fp32 master weights, consolidated",
            "Hugging Face export, bf16": "the master weights rounded to what the run computed with"}


def size_rows(path: Path, exports: dict, universal: Path | None = None, preset_7b="qwen-7b",
              ranks_7b=8) -> list[dict]:
    """Bytes on disk of each format of the checkpoint at `path` (exports: {"fp32": folder, "bf16": folder}), per
    parameter, next to chapter 1's bytes per parameter, and what that means for `preset_7b` on `ranks_7b` GPUs
    (same stage). `other_bytes`: what the files hold beyond the expected bytes (metadata), over `files` files."""
    manifest = checkpoint.manifest(path)
    params = models.param_counts(manifest["dims"])["total"]
    dims_7b = models.shape(preset_7b)
    params_7b = models.param_counts(dims_7b)["total"]
    stage = manifest["zero_stage"]
    expected = expected_bytes_per_param(stage, manifest["world_size"], tied_share(manifest["dims"]))
    expected_7b = expected_bytes_per_param(stage, ranks_7b, tied_share(dims_7b))
    deepspeed = {name: size for name, size in manifest["files"].items() if name.endswith("_states.pt")}
    universal_files = [p for p in Path(universal).rglob("*") if p.is_file()] if universal else []
    files = {"DeepSpeed checkpoint (every rank's files)": list(deepspeed.values()),
             "universal checkpoint": [p.stat().st_size for p in universal_files],
             "16-bit model (save_16bit_model)": [manifest["files"][checkpoint.SIXTEEN_BIT]]
             if checkpoint.SIXTEEN_BIT in manifest["files"] else [],
             "Hugging Face export, fp32 (zero_to_fp32)": _weights_sizes(exports.get("fp32")),
             "Hugging Face export, bf16": _weights_sizes(exports.get("bf16"))}
    rows = []
    for name, holds in why(stage).items():
        measured = sum(files[name]) or None
        rows.append(dict(format=name, measured_bytes=measured, files=len(files[name]),
                         per_param=measured / params if measured else None, expected_per_param=expected[name],
                         other_bytes=measured - round(expected[name] * params) if measured else None,
                         bytes_7b=expected_7b[name] * params_7b, why=holds))
    return rows


def universal_rows(checkpoints_and_copies, preset_7b="qwen-7b", ranks_7b=8) -> list[dict]:
    """For each (checkpoint folder, its universal copy): the stage and ranks that wrote it, the universal copy's
    measured bytes per parameter, expected_bytes_per_param's, and 12 x (1 + 1/N), which holds for ZeRO-3 only;
    and `preset_7b`'s copy at that stage from `ranks_7b` GPUs, per parameter and in bytes."""
    dims_7b = models.shape(preset_7b)
    params_7b = models.param_counts(dims_7b)["total"]
    rows = []
    for path, universal in checkpoints_and_copies:
        manifest = checkpoint.manifest(path)
        stage, ranks, dims = manifest["zero_stage"], manifest["world_size"], manifest["dims"]
        per_param_7b = expected_bytes_per_param(stage, ranks_7b, tied_share(dims_7b))["universal checkpoint"]
        rows.append(dict(stage=stage, ranks=ranks, tied=tied_share(dims),
                         per_param=_folder_bytes(universal) / models.param_counts(dims)["total"],
                         expected_per_param=expected_bytes_per_param(stage, ranks, tied_share(dims))
                         ["universal checkpoint"],
                         zero3_formula=(memory.DTYPE_BYTES["fp32"] + memory.OPTIMIZERS["adamw"]) * (1 + 1 / ranks),
                         per_param_7b=per_param_7b, bytes_7b=per_param_7b * params_7b))
    return rows


def _weights_sizes(folder) -> list[int]:
    return [p.stat().st_size for p in sorted(Path(folder).glob("*.safetensors"))] if folder else []


def _folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())


# ---------------------------------------------------------------------------------------------- GPU timing
def gpu_results() -> list[dict]:
    """Recorded save/resume timings (results/gpu/checkpoints/), oldest first, each with its file name."""
    return [dict(json.loads(p.read_text()), file=str(p.relative_to(RESULTS.parent)))
            for p in sorted(GPU_RESULTS.glob("checkpoint_*.json"))]


def superseded_by_method(result: dict) -> list[str]:
    """How a recorded timing falls short of time_save_resume's current method (empty when it does not)."""
    return ((["its save was timed before the fsync"] if "fsync_seconds" not in result else []) +
            (["its load may have read the page cache"] if "cold_load=True" not in result.get("command", "") else []))


def projection(result: dict, preset="qwen2.5-7b") -> dict:
    """`preset`'s checkpoint at the recorded bytes per parameter, and its save and load at the recorded rates
    (a projection: the same disk, the same stage, time proportional to bytes)."""
    params = models.param_counts(models.shape(preset))["total"]
    size = result["checkpoint_bytes"] / result["params"] * params
    return dict(preset=preset, params=params, bytes=size, save_seconds=size / 1e9 / result["save_gb_per_s"],
                load_seconds=size / 1e9 / result["load_gb_per_s"])


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
    parent = nearest_existing(Path(out))
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
