"""Chapter 10's sizing table: a model on one GPU with its optimizer offloaded, plain or with ZenFlow, on the cards
users have. Predicted by labs.memory, not run.

For each card and each split of the same tokens per optimizer step into micro-batch x accumulation, the fewest
checkpointed layers (the first k) whose GPU peak fits the card, and the host memory that run needs. ZenFlow runs only
N x 1: it makes the accumulation boundary its update boundary (chapter 10, round 12). labs.memory's host figure
models training. ZenFlow's start-up, while labs moved DeepSpeed's pinned buffers into shared memory, took more in
round 19 (`startup_extra_bytes_per_param`, measured on the 3B), when labs kept every pinned original until the last
buffer had moved; labs.zenflow_host now gives each back as soon as it has moved, which is not yet measured on a GPU.

    offload_sizing.rows("qwen2.5-7b")          # one row per card, setup and split that fits
    offload_sizing.startup_extra_bytes_per_param()
"""
from __future__ import annotations

from labs import CONFIGS, config, memory, models
from labs.course import zenflow_moments_report
from labs.memory.units import GiB

SETUPS = {"plain offload": "bench/labs_zero2_offload.json", "ZenFlow": "bench/labs_zero2_offload_zenflow.json"}
SPLITS = ((8, 1), (4, 2), (2, 4), (1, 8))        # 8 sequences per step, as every round of chapter 10
SEQ_LEN = 4096
CARDS = ("H100", "H200")


def fewest_checkpointed(preset: str, config_name: str, card: str, micro_batch: int, grad_accum: int,
                        seq_len: int = SEQ_LEN) -> dict | None:
    """The run that fits `card` with the fewest checkpointed layers, other settings as given (Liger's kernels and
    loss, as chapter 10 ran); None if even every layer checkpointed does not fit."""
    inputs = dict(preset=preset, ds_config=config.load(CONFIGS / config_name), micro_batch=micro_batch,
                  grad_accum=grad_accum, seq_len=seq_len, loss="liger", kernels="liger")
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
    """One row per card, setup and split that fits, in that order."""
    out = []
    for card in cards:
        for setup, config_name in SETUPS.items():
            for micro_batch, grad_accum in SPLITS:
                if setup == "ZenFlow" and grad_accum > 1:
                    continue
                found = fewest_checkpointed(preset, config_name, card, micro_batch, grad_accum)
                if found:
                    out.append(dict(card=card, setup=setup, batch=f"{micro_batch} x {grad_accum}", **found))
    return out


def startup_extra_bytes_per_param() -> float:
    """Round 19 on the 3B (labs' one set of moments): the host memory in use at the run's tightest second, during
    ZenFlow's start-up, above labs.memory's host figure for training, per parameter: with labs' move of that round,
    which gave the pinned originals back only at the end."""
    found = zenflow_moments_report.round19_moments()["ft_zfm64"]
    in_use_gib = found["total_gib"] - found["least_available_gib"]
    params = models.param_counts(models.shape("qwen2.5-3b"))["total"]
    return (in_use_gib - found["host_gib"]) * GiB / params
