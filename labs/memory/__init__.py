"""The memory model: how many bytes training needs on each GPU and each host, and what to change when it does not
fit. `from labs import memory` gives the names the chapters use:

    est = memory.estimate("qwen2.5-7b", stage=3, gpus_per_node=2)      # estimate.py: the entry point
    memory.advise("H100", **est.inputs)                                  # advise.py: the cheapest change that fits
    memory.parse_bytes("80GiB"), memory.GPUS["H200"]                     # units.py

The parts, bottom up: layout.py (where parameters sit under ZeRO), activations.py (what autograd saves),
accounting.py (the ZeRO paper and DeepSpeed's estimators), peak.py (the live bytes moment by moment),
estimate.py (all of them for one setup), fit.py (the one rule of a fit verdict, for a card), advise.py (fit verdicts
and the cheapest change), cli.py (`labs memory`).
"""
from labs.memory import activations, fit, layout, peak
from labs.memory.accounting import OPTIMIZERS, deepspeed_estimator, paper_model_states_bytes
from labs.memory.advise import Advice, advise, fewest_checkpointed, slowdown_rules
from labs.memory.estimate import DTYPE_BYTES, MemoryEstimate, estimate, from_run, host_pinning_of
from labs.memory.units import GB, GPUS, GiB, gpu_bytes, parse_bytes, usable_bytes

__all__ = ["activations", "fit", "layout", "peak", "OPTIMIZERS", "deepspeed_estimator", "paper_model_states_bytes",
           "Advice", "advise", "fewest_checkpointed", "slowdown_rules", "DTYPE_BYTES", "MemoryEstimate", "estimate",
           "from_run", "GB", "GPUS", "GiB", "gpu_bytes", "parse_bytes", "usable_bytes", "host_pinning_of"]
