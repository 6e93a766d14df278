"""DeepSpeed configs as files: find and load a plain-JSON config, read what it asks for (stage, precision,
offload), and show or make variants of it. Filling its "auto" values is labs.resolve's job."""
from __future__ import annotations

import copy
import json
import os
from pathlib import Path

from labs import CONFIGS
from labs.errors import LabsError


def find(name) -> Path:
    """A config path as given, or, for a relative name that is not a file here, the file of that name in the
    course's ds_configs/ (so `labs train --config zero2.json` works from any directory)."""
    path = Path(name)
    if not path.exists() and not path.is_absolute() and (CONFIGS / path).is_file():
        return CONFIGS / path
    return path


def load(path) -> dict:
    path = find(path)
    if path.is_dir():
        raise LabsError(f"config '{path}' is a directory; pass a DeepSpeed JSON file such as zero3.json")
    if not path.is_file():
        raise LabsError(f"config '{path}' does not exist; pass a DeepSpeed JSON file such as zero3.json "
                        "(a path, or a file name in the course's ds_configs/)")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise LabsError(f"config '{path}' is not UTF-8 text (byte {exc.start}); save it as UTF-8 JSON") from None
    except json.JSONDecodeError as exc:
        raise LabsError(f"config '{path}' is not valid JSON: line {exc.lineno} column {exc.colno}: {exc.msg} "
                        "(plain JSON: no comments, no trailing commas)") from None
    if not isinstance(config, dict):
        raise LabsError(f"config '{path}' must hold a JSON object ({{...}}), not a {type(config).__name__}")
    return config


def stage(config: dict) -> int:
    return int(config.get("zero_optimization", {}).get("stage", 0))


def offloads(config: dict) -> dict:
    """{'optimizer': 'cpu'|'nvme'|None, 'param': ...} as the config asks. FSDP2's "fsdp": {"offload": "cpu"} puts
    both on the host (its optimizer steps there too)."""
    if (config.get("fsdp") or {}).get("offload") == "cpu":
        return {"optimizer": "cpu", "param": "cpu"}
    zero = config.get("zero_optimization", {})
    return {part: (zero.get(f"offload_{part}") or {}).get("device") if
            (zero.get(f"offload_{part}") or {}).get("device") != "none" else None for part in ("optimizer", "param")}


def precision(config: dict) -> str:
    """'bf16', 'fp16' or 'fp32' (DeepSpeed's default when neither section is enabled)."""
    if config.get("bf16", {}).get("enabled") is True:
        return "bf16"
    if config.get("fp16", {}).get("enabled") is True:
        return "fp16"
    return "fp32"


PRECISIONS = ("bf16", "fp16", "fp32")


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
