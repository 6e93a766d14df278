"""The DeepSpeed config keys the course uses, listed by code so that the book's cheat sheet (book/cheatsheet.md)
can be checked to miss none: every key path in the JSON files under ds_configs/, and the keys the chapters
change in code cells as config variants (`config.variant(cfg, {"zero_optimization.KEY": ...})`, or with the
prefix held in a variable, `Z + "KEY"`)."""
from __future__ import annotations

import json
import re
from pathlib import Path

from labs import CONFIGS, ROOT

NOTEBOOKS = ROOT / "notebooks"
SECTIONS = ("zero_optimization", "optimizer", "scheduler", "bf16", "fp16", "aio", "fsdp")
# A quoted dotted key path whose first part is a config section: "zero_optimization.offload_param.device".
_DOTTED = re.compile(r"""["'](?P<key>(?:%s)\.[a-z0-9_]+(?:\.[a-z0-9_]+)*)["']""" % "|".join(SECTIONS))
# The prefix in a variable: Z = "zero_optimization." then Z + "reduce_bucket_size".
_PREFIX = re.compile(r"""^(?P<var>\w+)\s*=\s*["'](?P<prefix>(?:%s)\.)["']""" % "|".join(SECTIONS), re.M)


def key_paths(node: dict, prefix: str = "") -> list[str]:
    """Every key of a nested config, sections and leaves, as dotted paths."""
    paths = []
    for key, value in node.items():
        paths.append(prefix + key)
        if isinstance(value, dict):
            paths += key_paths(value, f"{prefix}{key}.")
    return paths


def config_keys(folder: Path = CONFIGS) -> dict[str, list[str]]:
    """{dotted key: the config files (relative to `folder`) that set it} over every *.json under `folder`."""
    found: dict[str, list[str]] = {}
    for path in sorted(Path(folder).rglob("*.json")):
        for key in key_paths(json.loads(path.read_text())):
            found.setdefault(key, []).append(str(path.relative_to(folder)))
    return dict(sorted(found.items()))


def code_keys(source: str) -> set[str]:
    """The config key paths a piece of code names as dotted strings ("zero_optimization.stage") or builds
    from a prefix variable (Z + "stage")."""
    keys = {m.group("key") for m in _DOTTED.finditer(source)}
    for m in _PREFIX.finditer(source):
        keys |= {m["prefix"] + k for k in re.findall(r"\b%s\s*\+\s*[\"']([a-z0-9_.]+)[\"']" % m["var"], source)}
    return keys


def notebook_keys(folder: Path = NOTEBOOKS) -> dict[str, list[str]]:
    """{dotted key: the chapters (notebook stems) whose code cells name it}."""
    found: dict[str, list[str]] = {}
    for path in sorted(Path(folder).glob("*.ipynb")):
        cells = json.loads(path.read_text())["cells"]
        source = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
        for key in sorted(code_keys(source)):
            found.setdefault(key, []).append(path.stem)
    return dict(sorted(found.items()))


def course_keys() -> list[str]:
    """Every config key the course uses: in ds_configs/ or changed by a chapter."""
    return sorted(set(config_keys()) | set(notebook_keys()))


def missing_from(text: str, keys) -> list[str]:
    """The keys that `text` (the cheat sheet's markdown) does not name as `code`."""
    return [key for key in keys if f"`{key}`" not in text]
