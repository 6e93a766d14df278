"""The one resolver: every default a run takes when nobody says otherwise, and every DeepSpeed "auto" value,
filled in one place. Training (`labs train`), the memory calculator (`labs memory`, the chapter-1 widget) and
`labs bench` all call it, so they can never disagree about what "the default" is.

    from labs import resolve
    resolve.run_defaults("qwen2.5-7b")   # {'seq_len': 4096, 'micro_batch': 2, 'grad_accum': 1, 'lr': 0.0001}
    resolve.default_config(stage=2)       # ds_configs/zero2.json: what `labs memory --stage 2` assumes
    resolve.ds_config(raw, world_size=2, dims=models.shape("tiny"), steps=30, on_gpu=False, preset="tiny")
"""
from __future__ import annotations

import copy
import functools
import json

from labs import CONFIGS
from labs import config as config_lib
from labs import fsdp, models
from labs.errors import LabsError, check_choice

# What a run uses when neither the command line nor the config file says. The tiny model learns fast at a high
# learning rate; a 7B model from random weights spikes at 3e-4 with a short warm-up, so it starts lower.
RUN_DEFAULTS = {"tiny": dict(seq_len=64, micro_batch=2, grad_accum=1, lr=5e-3),
                "qwen-7b": dict(seq_len=4096, micro_batch=2, grad_accum=1, lr=1e-4),
                "qwen2.5-3b": dict(seq_len=4096, micro_batch=2, grad_accum=1, lr=1e-4),
                "qwen2.5-7b": dict(seq_len=4096, micro_batch=2, grad_accum=1, lr=1e-4)}
# A model given only by its parameter count (memory calculator) or dims.
GENERIC_DEFAULTS = dict(seq_len=4096, micro_batch=2, grad_accum=1, lr=1e-4)
DEFAULT_CONFIG = "zero3.json"
ENGINES = ("deepspeed", "fsdp2")
# The lesson config of each ZeRO stage: what `labs memory --stage N` assumes when no --config is given.
STAGE_FILES = {0: "zero0_ddp.json", 1: "zero1.json", 2: "zero2.json", 3: "zero3.json"}
# Offload levels the chapters and the calculator name: (offload_optimizer device, offload_param device).
OFFLOAD_LEVELS = {"none": (None, None), "optimizer": ("cpu", None), "optimizer+params": ("cpu", "cpu")}
# DeepSpeed 0.19's defaults for the buffer knobs (deepspeed/runtime/zero/config.py), used where a config is silent.
ZERO_DEFAULTS = dict(reduce_bucket_size=5e8, allgather_bucket_size=5e8, overlap_comm=False, contiguous_gradients=True,
                     stage3_prefetch_bucket_size=5e7, stage3_param_persistence_threshold=1e5,
                     stage3_max_live_parameters=1e9, stage3_max_reuse_distance=1e9, sub_group_size=1e9,
                     zero_hpz_partition_size=1)
# Blocks where "auto" is DeepSpeed's own value, not a placeholder for labs (or HF) to fill (but see _zenflow).
NATIVE_AUTO = ("zero_optimization.zenflow.",)


def run_defaults(preset: str | None) -> dict:
    """seq_len, micro_batch, grad_accum and lr for a preset (or for a model given by size alone)."""
    if preset is None:
        return dict(GENERIC_DEFAULTS)
    return dict(RUN_DEFAULTS[models.check_preset(preset)])


def default_config(stage: int | None = None) -> dict:
    """The config a run or an estimate uses when none is named: zero3.json, or the lesson file of `stage`."""
    if stage is not None and stage not in STAGE_FILES:
        raise LabsError(f"ZeRO stage must be 0, 1, 2 or 3, not {stage!r}")
    return json.loads(_config_text(DEFAULT_CONFIG if stage is None else STAGE_FILES[stage]))


@functools.lru_cache(maxsize=None)
def _config_text(name: str) -> str:
    """A ds_configs/ file, read once (the memory advisor asks for the defaults hundreds of times)."""
    return json.dumps(config_lib.load(CONFIGS / name))


def engine(raw: dict, engine: str | None = None) -> str:
    """The engine a run uses: the one asked for, else FSDP2 when the config has an "fsdp" block, else DeepSpeed."""
    if engine is None:
        return "fsdp2" if "fsdp" in raw else "deepspeed"
    check_choice("engine", engine, ENGINES)
    if engine == "deepspeed" and "fsdp" in raw:
        raise LabsError("config key 'fsdp' sets up FSDP2 but the engine is deepspeed; drop --engine (the block "
                        "selects FSDP2) or use a DeepSpeed config such as zero3.json")
    return engine


def ds_config(raw: dict, *, world_size: int, dims: dict | None, steps: int, on_gpu: bool, preset: str | None = None,
              micro_batch: int | None = None, grad_accum: int | None = None, lr: float | None = None,
              precision: str | None = None, engine: str = "deepspeed") -> dict:
    """A copy of `raw` with every "auto" replaced, batch sizes made consistent, and the adjustments a CPU run
    needs. `micro_batch`/`grad_accum`/`lr` come from the command line (None: not given; then the file's value,
    then the preset's default). `precision` ('fp32', 'bf16', 'fp16') overrides the file's bf16/fp16 sections.
    For FSDP2 the "fsdp" block is checked and completed (labs.fsdp.settings)."""
    defaults = run_defaults(preset)
    config = copy.deepcopy(raw)
    if precision is not None:
        check_choice("precision", precision, config_lib.PRECISIONS)
        for section in ("bf16", "fp16"):
            if section in config or section == precision:
                config[section] = {**config.get(section, {}), "enabled": section == precision}
    for section in ("bf16", "fp16"):
        if config.get(section, {}).get("enabled") == "auto":
            config[section]["enabled"] = section == "bf16"
    _batch(config, world_size, micro_batch, grad_accum, defaults)
    peak_lr = _optimizer(config, lr, defaults["lr"], on_gpu)
    _scheduler(config, steps, peak_lr)
    _zero(config, dims)
    _zenflow(config)
    if config.get("gradient_clipping") == "auto":
        config["gradient_clipping"] = 1.0
    if engine == "fsdp2" or "fsdp" in config:
        config["fsdp"] = fsdp.settings(config, world_size)
    left = [key for key in _autos(config) if not key.startswith(NATIVE_AUTO)]
    if left:
        raise LabsError(f"config key '{left[0]}' is \"auto\", which labs cannot resolve; set a value")
    if not on_gpu:
        if config_lib.precision(config) == "fp16":
            raise LabsError("config key 'fp16.enabled': labs runs fp16 only on GPU ranks (a CPU's fp16 support "
                            "depends on the processor); use bf16 on CPU (ds_configs/zero3.json)")
        if "nvme" in config_lib.offloads(config).values():
            raise LabsError("config key 'zero_optimization.offload_*.device' is \"nvme\": NVMe offload needs a "
                            "GPU host with libaio; use \"cpu\" here")
    return config


def zero_knobs(config: dict) -> dict:
    """DeepSpeed's value of every buffer knob for a resolved config: the config's, else DeepSpeed's default
    (overlap_comm, left out, is on at stage 3 only: DeepSpeed's ZeRO config turns it on for stage 3)."""
    zero = config.get("zero_optimization") or {}
    knobs = {key: zero.get(key, default) for key, default in ZERO_DEFAULTS.items()}
    if "overlap_comm" not in zero:
        knobs["overlap_comm"] = zero.get("stage", 0) == 3
    # ZeRO-3's partial offload: the share of the optimizer's sub-groups stepped on the host (1.0: all of them)
    knobs["offload_ratio"] = float((zero.get("offload_optimizer") or {}).get("ratio", 1.0))
    return knobs


# ---------------------------------------------------------------------------------------------- the parts
def _batch(config, world_size, micro_batch, grad_accum, defaults):
    """train_batch_size = micro-batch x accumulation x ranks, each from the flag, the file or the default."""
    micro_batch = _pick(config, "train_micro_batch_size_per_gpu", micro_batch, "--micro-batch")
    grad_accum = _pick(config, "gradient_accumulation_steps", grad_accum, "--grad-accum")
    train_batch = config.get("train_batch_size", "auto")
    if train_batch != "auto" and not (isinstance(train_batch, int) and train_batch > 0):
        raise LabsError(f"config key 'train_batch_size' must be a positive integer or \"auto\", not {train_batch!r}")
    if micro_batch is None and grad_accum is None and isinstance(train_batch, int):
        grad_accum = 1
    if micro_batch is None:
        micro_batch = train_batch // (world_size * grad_accum) if isinstance(train_batch, int) else \
            defaults["micro_batch"]
    if grad_accum is None:
        grad_accum = train_batch // (world_size * micro_batch) if isinstance(train_batch, int) else \
            defaults["grad_accum"]
    expected = micro_batch * grad_accum * world_size
    if train_batch == "auto":
        train_batch = expected
    if train_batch != expected or micro_batch < 1 or grad_accum < 1:
        raise LabsError(f"config key 'train_batch_size' is {train_batch!r} but micro-batch {micro_batch} x "
                        f"gradient accumulation {grad_accum} x {world_size} ranks = {expected}; "
                        "make them agree or set it to \"auto\"")
    config.update(train_batch_size=train_batch, train_micro_batch_size_per_gpu=micro_batch,
                  gradient_accumulation_steps=grad_accum)


def _optimizer(config, lr, default_lr, on_gpu) -> float:
    """Fill the optimizer's "auto" values; returns the peak learning rate the scheduler warms up to."""
    optimizer = config.get("optimizer")
    if not optimizer:
        return lr if lr is not None else default_lr
    params = optimizer.setdefault("params", {})
    for key, value in {"lr": lr if lr is not None else default_lr, "weight_decay": 0.0, "betas": [0.9, 0.95],
                       "eps": 1e-8}.items():
        if params.get(key, "auto") == "auto":
            params[key] = value
    if lr is not None and params["lr"] != lr:
        raise LabsError(f"config key 'optimizer.params.lr' is {params['lr']} but --lr is {lr}; "
                        "drop one or set the key to \"auto\"")
    # Without a GPU, DeepSpeed's engine still picks FusedAdam (runtime/engine.py, get_optimizer_configuration), which
    # its cpu accelerator builds as a C++ op from CPU Adam's code (ops/op_builder/cpu/fused_adam.py), compiled just in
    # time by the first run in an environment (tens of seconds on 2 cores): ask for torch's AdamW (torch_adam)
    # instead, unless the optimizer is offloaded and DeepSpeed's CPU Adam runs it.
    if not on_gpu and config_lib.offloads(config)["optimizer"] is None:
        params["torch_adam"] = True
    return params["lr"]


def scheduler_steps(steps: int) -> dict:
    """The scheduler's "auto" step counts for a run of `steps` optimizer steps: the warm-up is a tenth of the run,
    at least 2 (DeepSpeed's log warm-up divides by log(warmup): never 1)."""
    return {"warmup_num_steps": max(2, steps // 10), "total_num_steps": steps}


def _scheduler(config, steps, peak_lr):
    scheduler = config.get("scheduler")
    if not scheduler:
        return
    for key, value in {**scheduler_steps(steps), "warmup_max_lr": peak_lr,
                       "warmup_min_lr": 0.0, "cos_min_ratio": 0.1, "warmup_min_ratio": 0.0}.items():
        if scheduler.setdefault("params", {}).get(key) == "auto":
            scheduler["params"][key] = value


def _zero(config, dims):
    """The HF integration's rules for ZeRO's "auto" knobs: buckets scale with hidden^2, small parameters stay
    whole on every rank; NVMe swap buffers hold the largest parameter; a decoder layer fetched as one unit.
    Without the model's shape, DeepSpeed's own defaults."""
    zero = config.get("zero_optimization")
    if not zero:
        return
    h = dims["hidden_size"] if dims else None
    if h:
        rules = {"reduce_bucket_size": h * h, "stage3_prefetch_bucket_size": int(0.9 * h * h),
                 "stage3_param_persistence_threshold": 10 * h,
                 "stage3_module_granularity_threshold": models.decoder_layer_granularity(dims)}
    else:       # a model known only by its size (the memory calculator): DeepSpeed's own defaults
        rules = {key: ZERO_DEFAULTS[key] for key in ("reduce_bucket_size", "stage3_prefetch_bucket_size",
                                                     "stage3_param_persistence_threshold")}
        rules["stage3_module_granularity_threshold"] = 0
    for key, value in rules.items():
        if zero.get(key) == "auto":
            zero[key] = value
    offload_param = zero.get("offload_param") or {}
    if offload_param.get("buffer_size") == "auto" and dims:
        # Each NVMe swap buffer must hold the largest parameter whole (DeepSpeed asserts it at start-up).
        offload_param["buffer_size"] = max(dims["vocab_size"], dims["intermediate_size"]) * h


def _pick(config: dict, key: str, given, flag: str):
    """A batch setting from the command line or the file; both given and different is an error."""
    in_file = config.get(key, "auto")
    if in_file != "auto" and not (isinstance(in_file, int) and not isinstance(in_file, bool) and in_file > 0):
        raise LabsError(f"config key '{key}' must be a positive integer or \"auto\", not {in_file!r}")
    if given is not None and in_file != "auto" and in_file != given:
        raise LabsError(f"config key '{key}' is {in_file} but {flag} is {given}; drop one or set the key to \"auto\"")
    return given if given is not None else (None if in_file == "auto" else in_file)


def _zenflow(config: dict):
    """ZenFlow's update_interval "auto" is refused: DeepSpeed 0.19.8's configure_zenflow (runtime/zenflow/engine.py)
    sets gradient_accumulation_steps = update_interval, which is 0 for "auto", and engine.backward divides every
    loss by it: the gradients of the first step are inf/NaN and so are the weights after it
    (tools/repro_zenflow_nan.py shows it with DeepSpeed alone). A number works (DeepSpeed's ZenFlow example: 4).
    ZenFlow under ZeRO-3 is refused too: labs' fixes (labs.zenflow_*) restate DeepSpeed 0.19.8's ZeRO-1/2 ZenFlow only,
    and ZeRO-3's (runtime/zenflow/engine_stage3.py) failed at the tiny preset's first forward on a CPU, with and
    without them (IndexError in the embedding, 2026-12-05; DeepSpeed issue 7686 reports another ZeRO-3 ZenFlow failure)."""
    zero = config.get("zero_optimization") or {}
    if zero.get("zenflow") and zero.get("stage") == 3:
        raise LabsError("config key 'zero_optimization.zenflow' is set with 'zero_optimization.stage' 3: labs runs "
                        "ZenFlow under ZeRO stage 1 or 2 only (ZeRO-3's failed at its first forward); set the stage to "
                        "2 (ds_configs/bench/labs_zero2_offload_zenflow.json)")
    if zero.get("zenflow", {}).get("update_interval") == "auto":
        raise LabsError("config key 'zero_optimization.zenflow.update_interval' is \"auto\": DeepSpeed 0.19.8 then "
                        "divides every loss by 0 and the weights turn NaN after the first step; set a number, e.g. 4 "
                        "(ds_configs/bench/labs_zero2_offload_zenflow.json)")


def _autos(node, prefix="") -> list[str]:
    if isinstance(node, dict):
        return [key for k, v in node.items() for key in _autos(v, f"{prefix}{k}.")]
    return [prefix[:-1]] if node == "auto" else []
