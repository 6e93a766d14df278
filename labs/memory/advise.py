"""Fit verdicts: does a training setup fit a GPU, and if not, the cheapest change that makes it fit.

The search varies what the chapter teaches (ZeRO stage, activation checkpointing, the loss, optimizer and
parameter offload) and keeps the model, the batch and the number of GPUs. Options are ranked by a rough
slowdown factor made of typed rules of thumb, not of measurements; it only orders the options (the GPU chapter
measures real costs, and `labs memory --plan` ranks GPU-resident setups by a step-time model fitted to them):
- ZeRO-3: the paper gives it 1.5x the communication volume of ZeRO-1/2; counted as 1.1x the step time, since
  much of it overlaps with compute.
- checkpointing k of L layers: each recomputes its forward, a third of forward + backward: 1 + k / (3 L).
- loss 'chunked': the head's logits are computed twice: 1 + 2 vocab h / FLOPs per token (~3% at 7B);
  'liger': counted as free (it is often faster), but needs a GPU.
- optimizer offload: the Adam step runs on the CPU and grads cross PCIe: 1.5x. Parameter offload: 2x more.
Among options of the same cost, the one that changes fewest settings wins, then the lower figure the fit weighs: a
tie never adds a change that is not needed.
Every verdict weighs an estimate's `fit_bytes_on` the card (labs.memory.fit): its peak, except ZeRO-1/2's start-up
flatten where it exceeds the card's total memory, which DeepSpeed then makes on the CPU; the verdict then says how much
host memory that start-up needs.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from labs import models
from labs.memory import fit
from labs.memory.estimate import MemoryEstimate, estimate
from labs.memory.units import GiB, parse_bytes, usable_bytes

# The typed factors of the rules above (assumptions, not measurements).
SLOWDOWN = {"zero3": 1.1, "offload_optimizer": 1.5, "offload_param": 2.0, "liger": 1.0}


@dataclass
class Advice:
    gpu_memory_bytes: int
    usable_bytes: int
    fits_as_is: bool
    current: MemoryEstimate
    change: dict = field(default_factory=dict)        # the settings to change ({} if it fits as is)
    suggestion: MemoryEstimate | None = None
    slowdown: float = 1.0
    options: list = field(default_factory=list)       # every fitting combination, cheapest first

    def __str__(self) -> str:
        used, usable = self._held(self.current), self.usable_bytes / GiB
        if self.fits_as_is:
            return f"fits: {used} of {usable:.1f} GiB usable{self._start_up(self.current)}"
        if self.suggestion is None:
            return (f"does not fit: {used} > {usable:.1f} GiB usable, and no stage, offload, "
                    "checkpointing or loss change fits: use more GPUs, a smaller micro-batch or shorter sequences")
        changes = ", ".join(f"{k}={v}" for k, v in self.change.items())
        return (f"does not fit: {used} > {usable:.1f} GiB usable; cheapest change that fits: "
                f"{changes} ({self._held(self.suggestion)}, ~{self.slowdown:.2f}x the step time)"
                f"{self._start_up(self.suggestion)}")

    def _held(self, est: MemoryEstimate) -> str:
        """The bytes the verdict weighs: the peak, or the largest moment but init where the flatten is on the CPU."""
        phase = est.fit_phase_on(self.gpu_memory_bytes)
        if phase != est.peak_phase:
            return f"{est.phases[phase]['total'] / GiB:.1f} GiB at {phase}"
        return f"peak {est.total_per_gpu_bytes / GiB:.1f} GiB"

    def _start_up(self, est: MemoryEstimate) -> str:
        """Where DeepSpeed makes the start-up flatten on the CPU here: that, and the host memory it needs."""
        card = self.gpu_memory_bytes
        if not fit.flattens_on_cpu(est, card):
            return ""
        return (f"; its start-up flatten ({est.phases['init']['total'] / GiB:.1f} GiB, more than the card's "
                f"{card / GiB:.1f} GiB) is made on the CPU, with {est.start_up_host_per_node_bytes_on(card) / GiB:.1f} "
                f"GiB of host memory per node of {est.inputs['gpus_per_node']} GPUs at start-up")

    def as_dict(self) -> dict:
        card, suggestion = self.gpu_memory_bytes, self.suggestion
        return dict(gpu_memory_bytes=card, usable_bytes=self.usable_bytes,
                    fits_as_is=self.fits_as_is, change=self.change, slowdown=self.slowdown,
                    peak_bytes=self.current.total_per_gpu_bytes, fit_bytes=self.current.fit_bytes_on(card),
                    start_up_host_per_node_bytes=self.current.start_up_host_per_node_bytes_on(card),
                    suggested_peak_bytes=suggestion.total_per_gpu_bytes if suggestion else None,
                    suggested_fit_bytes=suggestion.fit_bytes_on(card) if suggestion else None,
                    suggested_start_up_host_per_node_bytes=(suggestion.start_up_host_per_node_bytes_on(card)
                                                            if suggestion else None),
                    verdict=str(self))


def advise(gpu_memory_bytes, reserve_bytes=None, **inputs) -> Advice:
    """`inputs` are memory.estimate's keyword arguments (preset, stage, gpus_per_node, ...), or an estimate's
    own `inputs`: `advise("H100", **est.inputs)`."""
    gpu_memory_bytes = parse_bytes(gpu_memory_bytes)
    usable = usable_bytes(gpu_memory_bytes, reserve_bytes)
    current = estimate(**inputs)
    base = current.inputs
    advice = Advice(gpu_memory_bytes, usable, current.fits(gpu_memory_bytes, reserve_bytes), current)
    if advice.fits_as_is:
        return advice
    dims = current.inputs["dims"] or (models.shape(base["preset"]) if base["preset"] else None)
    layers = dims["num_hidden_layers"] if dims else 0
    now = models.checkpointed_layers(base["activation_checkpointing"], layers)
    losses = [base["loss"]] + ([x for x in ("chunked", "liger") if x != base["loss"]] if dims else [])
    # FSDP2 has no ZeRO stage to raise, and its offload is its config block's: only the loss and checkpointing move
    fsdp2 = base["engine"] == "fsdp2"
    # labs runs ZenFlow under ZeRO-1/2 only (labs.resolve refuses it with stage 3)
    top = 2 if (base["ds_config"] or {}).get("zero_optimization", {}).get("zenflow") else 3
    for stage in [base["stage"]] if fsdp2 else range(base["stage"], top + 1):
        optimizer_offloads = {base["offload_optimizer"], "cpu"} if stage and not fsdp2 else {base["offload_optimizer"]}
        param_offloads = {base["offload_param"], "cpu"} if stage == 3 and not fsdp2 else {base["offload_param"]}
        for loss in losses:
            for off_opt in optimizer_offloads:
                for off_param in param_offloads:
                    settings = dict(stage=stage, loss=loss, offload_optimizer=off_opt, offload_param=off_param)
                    k = _fewest_layers(settings, base, now, layers, gpu_memory_bytes, reserve_bytes)
                    if k is None:
                        continue
                    settings["activation_checkpointing"] = _how(k, layers, base["activation_checkpointing"])
                    est = estimate(**{**base, **settings})
                    cost = _slowdown(settings, base, k, layers, dims)
                    change = {key: v for key, v in settings.items() if v != base[key]}
                    advice.options.append(dict(change=change, slowdown=cost, estimate=est))
    advice.options.sort(key=lambda o: (round(o["slowdown"], 6), len(o["change"]),
                                       o["estimate"].fit_bytes_on(gpu_memory_bytes)))
    if advice.options:
        best = advice.options[0]
        advice.change, advice.slowdown, advice.suggestion = best["change"], best["slowdown"], best["estimate"]
    return advice


def fewest_checkpointed(gpu_memory_bytes, reserve_bytes=None, **inputs) -> tuple[int, MemoryEstimate] | None:
    """The fewest decoder layers to checkpoint (the first k, at least as many as `inputs` checkpoint) for the setting
    to fit (`MemoryEstimate.fits`), every other setting as given, with the estimate at that k; None if even every
    layer checkpointed does not fit. The search advise() runs for each option, for one setup alone."""
    current = estimate(**inputs)
    base = current.inputs
    dims = base["dims"] or models.shape(base["preset"])
    layers = dims["num_hidden_layers"]
    now = models.checkpointed_layers(base["activation_checkpointing"], layers)
    card = parse_bytes(gpu_memory_bytes)
    k = _fewest_layers({}, base, now, layers, card, reserve_bytes)
    if k is None:
        return None
    return k, estimate(**{**base, "activation_checkpointing": _how(k, layers, base["activation_checkpointing"])})


def slowdown_rules() -> list[dict]:
    """The rules `advise` ranks options by, as rows for a table: each change and the factor it is charged."""
    return [dict(change="stage 3 (from 0-2)", factor=f"{SLOWDOWN['zero3']}x"),
            dict(change="checkpoint k more of L layers", factor="1 + k / (3 L)"),
            dict(change="loss chunked", factor="1 + 2 vocab hidden / FLOPs per token"),
            dict(change="loss liger", factor=f"{SLOWDOWN['liger']}x"),
            dict(change="optimizer offload", factor=f"{SLOWDOWN['offload_optimizer']}x"),
            dict(change="parameter offload", factor=f"{SLOWDOWN['offload_param']}x, on top of optimizer offload's")]


def _fewest_layers(settings, base, now, layers, card, reserve_bytes):
    """The fewest checkpointed layers (at least the current number) that fit `card`; None if even all do not."""
    def fits(k):
        how = _how(k, layers, base["activation_checkpointing"])
        return estimate(**{**base, **settings, "activation_checkpointing": how}).fits(card, reserve_bytes)

    low, high = now, max(now, layers)
    if not fits(high):
        return None
    while low < high:                  # memory falls as more layers are checkpointed
        mid = (low + high) // 2
        if fits(mid):
            high = mid
        else:
            low = mid + 1
    return low


def _how(k: int, layers: int, current):
    if k == models.checkpointed_layers(current, layers):
        return current
    return "none" if k == 0 else "full" if k == layers else k


def _slowdown(settings, base, k, layers, dims) -> float:
    cost = 1.0
    if settings["stage"] == 3 and base["stage"] != 3:
        cost *= SLOWDOWN["zero3"]
    if layers:
        cost *= 1 + (k - models.checkpointed_layers(base["activation_checkpointing"], layers)) / (3 * layers)
    if settings["loss"] == "chunked" and base["loss"] != "chunked" and dims:
        head_flops = 2 * dims["vocab_size"] * dims["hidden_size"]
        cost *= 1 + head_flops / models.flops_per_token(dims, base["seq_len"])
    if settings["offload_optimizer"] and not base["offload_optimizer"]:
        cost *= SLOWDOWN["offload_optimizer"]
    if settings["offload_param"] and not base["offload_param"]:
        cost *= SLOWDOWN["offload_param"]
    return cost
