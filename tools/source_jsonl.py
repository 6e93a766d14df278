"""Write Python source files as JSONL ({"text": ...} per file): real text that every host with Python has.

ZenFlow's fine-tuning runs (round 14) need weights that have already learned something and then meet other text.
With nothing to download, labs first trains them on CPython's standard library, then fine-tunes them on another
body of code the GPU host has installed (transformers' sources: library code with long English docstrings).
Usage: python3 tools/source_jsonl.py OUT.jsonl stdlib|PACKAGE [MAX_MB]
"""
import importlib.util
import json
import sys
import sysconfig
from pathlib import Path

SKIPPED = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}


def source_root(name: str) -> Path:
    if name == "stdlib":
        return Path(sysconfig.get_paths()["stdlib"])
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"source_jsonl: no installed package '{name}'; name stdlib or an installed package")
    return Path(list(spec.submodule_search_locations)[0])


def source_files(root: Path):
    """The .py files under root in a fixed order, without test suites (mostly generated cases and fixtures)."""
    for path in sorted(root.rglob("*.py")):
        if not set(path.relative_to(root).parts) & SKIPPED:
            yield path


def main(out: str, name: str, max_mb: float = 64.0) -> None:
    root, written, files = source_root(name), 0, 0
    with open(out, "w", encoding="utf-8") as f:
        for path in source_files(root):
            text = path.read_text(encoding="utf-8", errors="replace")
            if text.strip():
                f.write(json.dumps({"text": text}) + "\n")
                written, files = written + len(text.encode()), files + 1
            if written >= max_mb * 2**20:
                break
    print(f"{out}: {files} files, {written / 2**20:.1f} MiB from {root}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], *(float(a) for a in sys.argv[3:4]))
