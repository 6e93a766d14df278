"""DeepSpeed configs: load a plain-JSON file, fill its "auto" values the way the HF integration does,
and check it, with errors that name the key."""
from __future__ import annotations

import copy
import json
import os
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


PRECISIONS = ("bf16", "fp16", "fp32")


def resolve(config: dict, *, world_size: int, micro_batch: int | None, grad_accum: int | None, steps: int,
            hidden_size: int, on_gpu: bool, lr: float | None = None, defaults: dict | None = None,
            layer_granularity: int | None = None, force_precision: str | None = None,
            largest_param_numel: int | None = None) -> dict:
    """A copy of `config` with every "auto" replaced, batch sizes made consistent, and the adjustments a
    CPU run needs. `micro_batch`/`grad_accum`/`lr` come from the command line (None: not given); `defaults`
    holds the preset's values used when neither the command line nor the file sets one. `force_precision`
    ('fp32', 'bf16', 'fp16') overrides the file's bf16/fp16 sections (the chapters compare stages in fp32);
    `largest_param_numel` sizes NVMe parameter buffers left "auto"."""
    config = copy.deepcopy(config)
    if force_precision is not None:
        if force_precision not in PRECISIONS:
            raise LabsError(f"precision '{force_precision}': choose one of {', '.join(PRECISIONS)}")
        for section in ("bf16", "fp16"):
            if section in config or section == force_precision:
                config[section] = {**config.get(section, {}), "enabled": section == force_precision}
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
    offload_param = zero.get("offload_param") or {}
    if offload_param.get("buffer_size") == "auto" and largest_param_numel:
        # Each NVMe swap buffer must hold the largest parameter whole (DeepSpeed asserts it at start-up).
        offload_param["buffer_size"] = int(largest_param_numel)
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


def check_nvme_paths(config: dict):
    """NVMe offload writes swap files under `nvme_path`: it must be an existing, writable folder."""
    for part in ("optimizer", "param"):
        section = config.get("zero_optimization", {}).get(f"offload_{part}") or {}
        if section.get("device") != "nvme":
            continue
        path = Path(str(section.get("nvme_path", "")))
        if not path.is_dir() or not os.access(path, os.W_OK):
            raise LabsError(f"config key 'zero_optimization.offload_{part}.nvme_path' is '{path}', which is not a "
                            "writable folder here; point it at a folder on a local NVMe drive")


def diff(old: dict, new: dict) -> list[str]:
    """What changed from config `old` to config `new`, one line per dotted key:
    '+ key: value' (added), '- key: value' (removed), '~ key: old -> new' (changed)."""
    before, after = _flatten(old), _flatten(new)
    lines = []
    for key in list(after) + [k for k in before if k not in after]:
        if key not in before:
            lines.append(f"+ {key}: {json.dumps(after[key])}")
        elif key not in after:
            lines.append(f"- {key}: {json.dumps(before[key])}")
        elif before[key] != after[key]:
            lines.append(f"~ {key}: {json.dumps(before[key])} -> {json.dumps(after[key])}")
    return lines


def variant(config: dict, changes: dict) -> dict:
    """A copy of `config` with dotted keys set, e.g. {"zero_optimization.overlap_comm": False}; a value
    None removes the key."""
    config = copy.deepcopy(config)
    for dotted, value in changes.items():
        *parents, leaf = dotted.split(".")
        node = config
        for part in parents:
            node = node.setdefault(part, {})
        if value is None:
            node.pop(leaf, None)
        else:
            node[leaf] = value
    return config


def write(config: dict, path) -> Path:
    """Write a config as plain JSON (what `labs.launch.run(config=...)` reads)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config, indent=1) + "\n")
    return path


def _flatten(node, prefix="") -> dict:
    if isinstance(node, dict) and node:
        return {key: value for k, v in node.items() for key, value in _flatten(v, f"{prefix}{k}.").items()}
    return {prefix[:-1]: node}


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
