"""Chapter 10's sizing table: a model on one GPU with its optimizer offloaded, on the cards users have. Predicted by
labs.memory, not run.

For each card, setup and split of the same tokens per optimizer step into micro-batch x accumulation, the fewest
checkpointed layers (the first k) whose GPU peak fits the card, and the host memory that run needs. The setups:
plain offload (ZeRO-2, every optimizer state on the host) with PyTorch's pinned allocator, which rounds each buffer up
to a power of two, and with DeepSpeed's own (`DS_PIN_MEMORY_BACKEND=native`: each at its own size); ZenFlow, which
runs only N x 1 (it makes the accumulation boundary its update boundary: chapter 10, round 12); and ZeRO-3 with part
of the optimizer offloaded (`offload_optimizer.ratio`), at the smallest share whose GPU peak fits, so the least host.

labs.memory's host figure models training. ZenFlow's start-up, while labs moved DeepSpeed's pinned buffers into
shared memory, took more in round 19 (`startup_extra_bytes_per_param`, measured on the 3B), when labs kept every
pinned original until the last buffer had moved; labs.zenflow_host now gives each back as soon as it has moved, which
is not yet measured on a GPU.

    offload_sizing.rows("qwen2.5-7b")          # one row per card, setup and split that fits
    offload_sizing.startup_extra_bytes_per_param()
"""
from __future__ import annotations

import copy

from labs import CONFIGS, config, memory, models
from labs.course import zenflow_moments_report
from labs.memory.units import GiB

ALL_SPLITS = ((8, 1), (4, 2), (2, 4), (1, 8))     # 8 sequences per step, as every round of chapter 10
SEQ_LEN = 4096
RATIOS = tuple(k / 10 for k in range(1, 11))      # shares of the optimizer offloaded, tried smallest first
SETUPS = {"plain offload": dict(config="bench/labs_zero2_offload.json", splits=ALL_SPLITS),
          "plain offload, native pinning": dict(config="bench/labs_zero2_offload.json", host_pinning="exact"),
          "ZenFlow": dict(config="bench/labs_zero2_offload_zenflow.json"),
          "ZeRO-3, part offloaded": dict(config="bench/labs_zero3_offload_half.json", ratios=RATIOS)}
CARDS = ("H100", "H200")


def setup_config(config_name: str, ratio: float | None = None) -> dict:
    """A setup's DeepSpeed config, with the offloaded share of the optimizer set where `ratio` is given."""
    loaded = copy.deepcopy(config.load(CONFIGS / config_name))
    if ratio is not None:
        loaded["zero_optimization"]["offload_optimizer"]["ratio"] = ratio
    return loaded


def fewest_checkpointed(preset: str, ds_config: dict, card: str, micro_batch: int, grad_accum: int,
                        seq_len: int = SEQ_LEN, host_pinning: str = "torch") -> dict | None:
    """The run that fits `card` with the fewest checkpointed layers, other settings as given (Liger's kernels and
    loss, as chapter 10 ran); None if even every layer checkpointed does not fit."""
    inputs = dict(preset=preset, ds_config=ds_config, micro_batch=micro_batch, grad_accum=grad_accum,
                  seq_len=seq_len, loss="liger", kernels="liger", host_pinning=host_pinning)
    advice = memory.advise(card, **inputs)
    if advice.fits_as_is:
        found, checkpointing = advice.current, "none"
    else:   # the advisor also tries ZeRO-3, parameter offload and other losses: keep only checkpointing
        only = [o for o in advice.options if set(o["change"]) == {"activation_checkpointing"}]
        if not only:
            return None
        found, checkpointing = only[0]["estimate"], only[0]["change"]["activation_checkpointing"]
    layers = models.shape(preset)["num_hidden_layers"]
    return dict(checkpointed=models.checkpointed_layers(checkpointing, layers), layers=layers,
                gpu_gib=found.total_per_gpu_bytes / GiB, usable_gib=advice.usable_bytes / GiB,
                host_gib=found.host_per_node_bytes / GiB)


def rows(preset: str = "qwen2.5-7b", cards=CARDS) -> list[dict]:
    """One row per card, setup and split that fits, in that order (ZeRO-3's: its smallest offloaded share that fits)."""
    out = []
    for card in cards:
        for setup, how in SETUPS.items():
            for micro_batch, grad_accum in how.get("splits", ALL_SPLITS[:1]):
                for ratio in how.get("ratios", (None,)):
                    found = fewest_checkpointed(preset, setup_config(how["config"], ratio), card, micro_batch,
                                                grad_accum, host_pinning=how.get("host_pinning", "torch"))
                    if found:
                        out.append(dict(card=card, setup=setup, batch=f"{micro_batch} x {grad_accum}",
                                        offloaded=1.0 if ratio is None else ratio, config=how["config"], **found))
                        break
    return out


def startup_extra_bytes_per_param() -> float:
    """Round 19 on the 3B (labs' one set of moments, and labs' move of then, which gave the pinned originals back
    only at the end): the host memory in use at the run's tightest second, during ZenFlow's start-up, above what was in
    use at the tightest second while it trained, per parameter. Both are the same run on the same host, so the system's
    own memory cancels; the optimizer process's moments were not yet allocated at start-up, so this understates the
    start-up's own buffers by them."""
    found = zenflow_moments_report.round19_moments()["ft_zfm64"]
    params = models.param_counts(models.shape("qwen2.5-3b"))["total"]
    return (found["least_available_running_gib"] - found["least_available_gib"]) * GiB / params
