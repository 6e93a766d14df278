"""DeepSpeed configs: load a plain-JSON file, fill its "auto" values the way the HF integration does,
and check it, with errors that name the key."""
from __future__ import annotations

import copy
import json
from pathlib import Path

from labs.errors import LabsError


def load(path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise LabsError(f"config '{path}' does not exist; pass a DeepSpeed JSON file such as ds_configs/zero3.json")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise LabsError(f"config '{path}' is not valid JSON: line {exc.lineno} column {exc.colno}: {exc.msg} "
                        "(plain JSON: no comments, no trailing commas)") from None
    if not isinstance(config, dict):
        raise LabsError(f"config '{path}' must hold a JSON object")
    return config


def stage(config: dict) -> int:
    return int(config.get("zero_optimization", {}).get("stage", 0))


def offloads(config: dict) -> dict:
    """{'optimizer': 'cpu'|'nvme'|None, 'param': ...} as the config asks."""
    zero = config.get("zero_optimization", {})
    return {part: (zero.get(f"offload_{part}") or {}).get("device") if
            (zero.get(f"offload_{part}") or {}).get("device") != "none" else None for part in ("optimizer", "param")}


def precision(config: dict) -> str:
    if config.get("bf16", {}).get("enabled") is True:
        return "bf16"
    if config.get("fp16", {}).get("enabled") is True:
        return "fp16"
    return "fp32"


def resolve(config: dict, *, world_size: int, micro_batch: int | None, grad_accum: int | None, steps: int,
            hidden_size: int, on_gpu: bool, lr: float | None = None, defaults: dict | None = None,
            layer_granularity: int | None = None) -> dict:
    """A copy of `config` with every "auto" replaced, batch sizes made consistent, and the adjustments a
    CPU run needs. `micro_batch`/`grad_accum`/`lr` come from the command line (None: not given); `defaults`
    holds the preset's values used when neither the command line nor the file sets one."""
    config = copy.deepcopy(config)
    defaults = {"micro_batch": 1, "grad_accum": 1, "lr": 3e-4, **(defaults or {})}
    micro_batch = _pick(config, "train_micro_batch_size_per_gpu", micro_batch, "--micro-batch")
    grad_accum = _pick(config, "gradient_accumulation_steps", grad_accum, "--grad-accum")
    train_batch = config.get("train_batch_size", "auto")
    if micro_batch is None and grad_accum is None and isinstance(train_batch, int):
        grad_accum = 1
    micro_batch = micro_batch or (train_batch // (world_size * (grad_accum or 1)) if isinstance(train_batch, int)
                                  else defaults["micro_batch"])
    grad_accum = grad_accum or (train_batch // (world_size * micro_batch) if isinstance(train_batch, int)
                                else defaults["grad_accum"])
    expected = micro_batch * grad_accum * world_size
    if train_batch == "auto":
        train_batch = expected
    if not isinstance(train_batch, int) or train_batch != expected or micro_batch < 1 or grad_accum < 1:
        raise LabsError(f"config key 'train_batch_size' is {train_batch!r} but micro-batch {micro_batch} x "
                        f"gradient accumulation {grad_accum} x {world_size} ranks = {expected}; "
                        "make them agree or set it to \"auto\"")
    config.update(train_batch_size=train_batch, train_micro_batch_size_per_gpu=micro_batch,
                  gradient_accumulation_steps=grad_accum)

    optimizer = config.get("optimizer")
    if optimizer:
        params = optimizer.setdefault("params", {})
        for key, value in {"lr": lr if lr is not None else defaults["lr"], "weight_decay": 0.0,
                           "betas": [0.9, 0.95], "eps": 1e-8}.items():
            if params.get(key, "auto") == "auto":
                params[key] = value
        peak_lr = params["lr"]
        if lr is not None and params["lr"] != lr:
            raise LabsError(f"config key 'optimizer.params.lr' is {params['lr']} but --lr is {lr}; "
                            "drop one or set the key to \"auto\"")
        # Without a GPU DeepSpeed cannot build FusedAdam: use torch's AdamW unless CPU-Adam (offload) runs it.
        if not on_gpu and offloads(config)["optimizer"] is None:
            params["torch_adam"] = True
    else:
        peak_lr = lr if lr is not None else defaults["lr"]
    scheduler = config.get("scheduler")
    if scheduler:
        warmup = max(2, steps // 10)   # DeepSpeed's log warm-up divides by log(warmup): never 1
        for key, value in {"warmup_num_steps": warmup, "total_num_steps": steps, "warmup_max_lr": peak_lr,
                           "warmup_min_lr": 0.0, "cos_min_ratio": 0.1, "warmup_min_ratio": 0.0}.items():
            if scheduler.setdefault("params", {}).get(key) == "auto":
                scheduler["params"][key] = value
    zero = config.get("zero_optimization", {})
    # The HF integration's rules: buckets scale with hidden^2; small params stay whole on every rank.
    for key, value in {"reduce_bucket_size": hidden_size * hidden_size,
                       "stage3_prefetch_bucket_size": int(0.9 * hidden_size * hidden_size),
                       "stage3_param_persistence_threshold": 10 * hidden_size,
                       # labs' own rule: fetch each decoder layer as one unit (labs.models.decoder_layer_granularity)
                       "stage3_module_granularity_threshold": layer_granularity}.items():
        if zero.get(key) == "auto" and value is not None:
            zero[key] = value
    for section in ("bf16", "fp16"):
        if config.get(section, {}).get("enabled") == "auto":
            config[section]["enabled"] = section == "bf16"
    if config.get("gradient_clipping") == "auto":
        config["gradient_clipping"] = 1.0

    left = _autos(config)
    if left:
        raise LabsError(f"config key '{left[0]}' is \"auto\", which labs cannot resolve; set a value")
    if not on_gpu:
        if precision(config) == "fp16":
            raise LabsError("config key 'fp16.enabled': DeepSpeed runs fp16 only on GPUs; use bf16 on CPU "
                            "(ds_configs/zero3.json)")
        if "nvme" in offloads(config).values():
            raise LabsError("config key 'zero_optimization.offload_*.device' is \"nvme\": NVMe offload needs a "
                            "GPU host with libaio; use \"cpu\" here")
    return config


def _pick(config: dict, key: str, given, flag: str):
    """A batch setting from the command line or the file; both given and different is an error."""
    in_file = config.get(key, "auto")
    if in_file != "auto" and not (isinstance(in_file, int) and in_file > 0):
        raise LabsError(f"config key '{key}' must be a positive integer or \"auto\", not {in_file!r}")
    if given is not None and in_file != "auto" and in_file != given:
        raise LabsError(f"config key '{key}' is {in_file} but {flag} is {given}; drop one or set the key to \"auto\"")
    return given if given is not None else (None if in_file == "auto" else in_file)


def _autos(node, prefix="") -> list[str]:
    if isinstance(node, dict):
        return [key for k, v in node.items() for key in _autos(v, f"{prefix}{k}.")]
    return [prefix[:-1]] if node == "auto" else []
