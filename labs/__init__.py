"""zero-course labs: train Qwen-architecture models with DeepSpeed ZeRO, from 2 CPU ranks to H200s."""
__version__ = "0.1.0"

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent      # the course repository (labs is installed editable)
CONFIGS = ROOT / "ds_configs"
# where the chapters write their runs; `make test` points LABS_RUNS elsewhere, so that the notebooks, which it runs
# beside the unit tests, leave the checkout as they found it (tests/conftest.py checks that the tests do)
RUNS = Path(os.environ.get("LABS_RUNS") or ROOT / "runs")
RESULTS = ROOT / "results"
