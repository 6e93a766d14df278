"""zero-course labs: train Qwen-architecture models with DeepSpeed ZeRO, from 2 CPU ranks to H200s."""
__version__ = "0.1.0"

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent      # the course repository (labs is installed editable)
CONFIGS = ROOT / "ds_configs"
RUNS = ROOT / "runs"
RESULTS = ROOT / "results"
