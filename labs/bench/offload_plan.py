"""What fits with the optimizer offloaded, when nothing fits without: each offload setup, on a card, with the host
memory it needs. Predicted by labs.memory, not run; `labs memory --plan` prints it when no GPU-resident candidate
fits, and chapter 10 sizes the 7B on one GPU with it.

For each card, setup and split of the same sequences per optimizer step into micro-batch x accumulation, the fewest
checkpointed layers (the first k) whose GPU peak fits the card, and the host memory that run needs. The setups: plain
offload (ZeRO-2, every optimizer state on the host) with PyTorch's pinned allocator, which rounds each buffer up to a
power of two, and with DeepSpeed's own (`DS_PIN_MEMORY_BACKEND=native`: each at its own size); ZenFlow, with its CPU
step overlapped in a second process and without (`overlap_step: false`), which runs only N x 1 (it makes the
accumulation boundary its update boundary: chapter 10, round 12); and ZeRO-3 with part of the optimizer offloaded
(`offload_optimizer.ratio`), at the smallest share whose GPU peak fits, so the least host; and ZeRO-3 with the
parameters offloaded too, the last resort of a small card (each layer's weights cross PCIe at every forward and
backward).
labs.memory's host figure models training: ZenFlow's start-up took more in chapter 10's round 19, and no more since labs
gives each pinned buffer back as soon as it has moved (round 23).

    offload_plan.rows("qwen2.5-7b", cards=("H100",))      # one row per card, setup and split that fits
"""
from __future__ import annotations

import copy

from labs import CONFIGS, config, memory, models, resolve
from labs.memory import layout
from labs.memory.units import GiB

SEQ_LEN = 4096
RATIOS = tuple(k / 10 for k in range(1, 11))      # shares of the optimizer offloaded, tried smallest first
SETUPS = {"plain offload": dict(config="bench/labs_zero2_offload.json", all_splits=True),
          "plain offload, native pinning": dict(config="bench/labs_zero2_offload.json", host_pinning="exact"),
          "ZenFlow": dict(config="bench/labs_zero2_offload_zenflow.json"),
          "ZenFlow, no overlap": dict(config="bench/labs_zero2_offload_zenflow_sequential.json"),
          "ZeRO-3, part offloaded": dict(config="bench/labs_zero3_offload_half.json", ratios=RATIOS),
          "ZeRO-3, parameters offloaded too": dict(config="bench/labs_zero3_offload_all.json")}
CARDS = ("H100", "H200")


def splits(batch_per_gpu: int) -> list[tuple[int, int]]:
    """Every micro-batch x accumulation that makes `batch_per_gpu` sequences per step, largest micro-batch first."""
    return [(m, batch_per_gpu // m) for m in range(batch_per_gpu, 0, -1) if batch_per_gpu % m == 0]


def setup_config(config_name: str, ratio: float | None = None) -> dict:
    """A setup's DeepSpeed config, with the offloaded share of the optimizer set where `ratio` is given."""
    loaded = copy.deepcopy(config.load(CONFIGS / config_name))
    if ratio is not None:
        loaded["zero_optimization"]["offload_optimizer"]["ratio"] = ratio
    return loaded


def fewest_checkpointed(preset: str, ds_config: dict, card, micro_batch: int, grad_accum: int, gpus: int = 1,
                        seq_len: int = SEQ_LEN, host_pinning: str = "torch") -> dict | None:
    """The run that fits `card` (a name or a size; `MemoryEstimate.fits`) with the fewest checkpointed layers, other
    settings as given (Liger's kernels and loss, labs' fast path); None if even every layer checkpointed does not fit.
    `gpu_gib` is its peak, `fit_gib` what the fit weighs (the peak but for a start-up flatten DeepSpeed makes on the
    CPU on a card too small for it, whose host memory per node is `start_up_host_gib`)."""
    found = memory.fewest_checkpointed(card, preset=preset, ds_config=ds_config, gpus_per_node=gpus,
                                       micro_batch=micro_batch, grad_accum=grad_accum, seq_len=seq_len, loss="liger",
                                       kernels="liger", host_pinning=host_pinning)
    if found is None:
        return None
    checkpointed, estimate = found
    return dict(checkpointed=checkpointed, layers=models.shape(preset)["num_hidden_layers"],
                gpu_gib=estimate.total_per_gpu_bytes / GiB, fit_gib=estimate.fit_bytes_on(card) / GiB,
                usable_gib=memory.usable_bytes(card) / GiB, host_gib=estimate.host_per_node_bytes / GiB,
                start_up_host_gib=estimate.start_up_host_per_node_bytes_on(card) / GiB)


def rows(preset: str = "qwen2.5-7b", cards=CARDS, gpus: int = 1, batch_per_gpu: int = 8,
         seq_len: int = SEQ_LEN) -> list[dict]:
    """One row per card, setup and split that fits, in that order (ZeRO-3's: its smallest offloaded share that fits,
    and the share of the parameters that setting offloads); `host_gib` is per node (`gpus` ranks)."""
    out = []
    for card in cards:
        for setup, how in SETUPS.items():
            for micro_batch, grad_accum in splits(batch_per_gpu)[:None if how.get("all_splits") else 1]:
                for ratio in how.get("ratios", (None,)):
                    ds_config = setup_config(how["config"], ratio)
                    found = fewest_checkpointed(preset, ds_config, card, micro_batch, grad_accum, gpus, seq_len,
                                                how.get("host_pinning", "torch"))
                    if found:
                        sub_group = ds_config["zero_optimization"].get(
                            "sub_group_size", resolve.ZERO_DEFAULTS["sub_group_size"])
                        params_share = 1.0 if ratio is None else layout.zero3_offloaded_share(
                            models.shape(preset), ratio, sub_group)       # whole sub-groups: more than the setting
                        out.append(dict(card=card, setup=setup, batch=f"{micro_batch} x {grad_accum}",
                                        offloaded=1.0 if ratio is None else ratio, offloaded_params=params_share,
                                        config=how["config"], **found))
                        break
    return out
