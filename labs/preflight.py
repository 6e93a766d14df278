"""Checks that need more than a glance, run on the host before any rank starts (labs.launch.prepare calls them):
the DeepSpeed config against DeepSpeed's own config classes, the GPU packages a run asks for, and what the hardware
can hold (a model folder: labs.model_folder). Each failure is one LabsError line that names the key or path.
"""
from __future__ import annotations

import difflib
import functools
import importlib.util
import math
import os
import sys

import torch

from labs import env, memory
from labs.errors import LabsError

# gloo ranks beyond two per core only thrash (measured on the 2-core CI machine: 4 ranks work, slowly).
CPU_RANKS_PER_CORE = 2
# Top-level keys labs itself reads (DeepSpeed ignores them): the FSDP2 engine's settings.
LABS_KEYS = ("fsdp",)
ZERO_STAGES = (0, 1, 2, 3)
# DeepSpeed's pydantic sections, by the class name its validation errors carry.
SECTIONS = {"DeepSpeedZeroConfig": "zero_optimization", "DeepSpeedZeroOffloadOptimizerConfig":
            "zero_optimization.offload_optimizer", "DeepSpeedZeroOffloadParamConfig": "zero_optimization.offload_param",
            "DeepSpeedBF16Config": "bf16", "DeepSpeedFP16Config": "fp16", "DeepSpeedActivationCheckpointingConfig":
            "activation_checkpointing", "DeepSpeedCommsConfig": "comms_logger", "DeepSpeedMonitorConfig": "monitor"}


def check_top_level_keys(raw: dict, source) -> None:
    """Every top-level key must be one DeepSpeed reads (or labs' own): a misspelt section would otherwise be
    ignored without a word, and the run would train without it."""
    known = deepspeed_top_level_keys()
    for key in raw:
        if key not in known and key not in LABS_KEYS:
            guess = difflib.get_close_matches(key, sorted(known | set(LABS_KEYS)), n=1)
            hint = f"did you mean '{guess[0]}'?" if guess else "DeepSpeed does not know it; remove it"
            raise LabsError(f"config key '{key}' in '{source}' is not a DeepSpeed setting: {hint}")


@functools.lru_cache(maxsize=1)
def deepspeed_top_level_keys() -> frozenset:
    """The top-level keys this DeepSpeed version reads: DeepSpeedConfig asks for each one it knows, present or not,
    so parsing a complete config while recording its lookups lists them."""
    env.name_deepspeed_accelerator()
    from deepspeed.runtime.config import DeepSpeedConfig

    recorder = _ReadRecorder(train_batch_size=1, train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1)
    DeepSpeedConfig(recorder)
    return frozenset(recorder.read)


def check_ds_config(resolved: dict, source) -> None:
    """Parse the resolved config with DeepSpeed's own DeepSpeedConfig: its pydantic sections refuse unknown or
    ill-typed keys, and every top-level key DeepSpeed never reads is refused with a "did you mean"."""
    env.name_deepspeed_accelerator()
    from deepspeed.runtime.config import DeepSpeedConfig
    from pydantic import ValidationError

    # Without a process group DeepSpeed assumes one rank: validate a one-rank twin (labs checked the batch sizes).
    twin = _ReadRecorder({key: value for key, value in resolved.items() if key not in LABS_KEYS})
    twin["train_batch_size"] = resolved["train_micro_batch_size_per_gpu"] * resolved["gradient_accumulation_steps"]
    try:
        DeepSpeedConfig(twin)
    except ValidationError as exc:
        error = exc.errors()[0]
        section = SECTIONS.get(exc.title, exc.title)
        key = ".".join([section] + [str(part) for part in error["loc"]])
        if key == "zero_optimization.stage":        # DeepSpeed's own words: "Input should be 0, 1, 2, 3 or 3"
            raise LabsError(f"config key '{key}' in '{source}' is {error.get('input')!r}; the ZeRO stages are "
                            f"{', '.join(map(str, ZERO_STAGES))} (0: plain data parallelism)") from None
        raise LabsError(f"config key '{key}' in '{source}': {error['msg']} (got {error.get('input')!r})") from None
    except (AssertionError, ValueError, TypeError, KeyError) as exc:
        raise LabsError(f"config '{source}' is refused by DeepSpeed: {str(exc).splitlines()[0]}") from None
    check_top_level_keys({key: None for key in twin if key not in twin.read}, source)
    _check_optimizer_and_schedule(resolved, source)


def _check_optimizer_and_schedule(resolved: dict, source) -> None:
    """What DeepSpeed only finds out inside every rank: an optimizer or scheduler it cannot build, a learning rate
    that is not a positive number."""
    from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS
    from deepspeed.runtime.lr_schedules import VALID_LR_SCHEDULES

    optimizer = resolved.get("optimizer") or {}
    name = optimizer.get("type")
    if optimizer and not (isinstance(name, str) and (name.lower() in DEEPSPEED_OPTIMIZERS or
                                                     getattr(torch.optim, name, None) is not None)):
        guess = difflib.get_close_matches(str(name), [n for n in dir(torch.optim) if n[0].isupper()], n=1)
        raise LabsError(f"config key 'optimizer.type' in '{source}' is {name!r}, which neither DeepSpeed nor "
                        f"torch.optim has" + (f": did you mean '{guess[0]}'?" if guess else ""))
    lr = (optimizer.get("params") or {}).get("lr")
    if optimizer and not (isinstance(lr, (int, float)) and not isinstance(lr, bool) and math.isfinite(lr) and lr > 0):
        raise LabsError(f"config key 'optimizer.params.lr' in '{source}' must be a positive number, not {lr!r}")
    scheduler = resolved.get("scheduler") or {}
    if scheduler and scheduler.get("type") not in VALID_LR_SCHEDULES and \
            getattr(torch.optim.lr_scheduler, str(scheduler.get("type")), None) is None:
        raise LabsError(f"config key 'scheduler.type' in '{source}' is {scheduler.get('type')!r}; DeepSpeed's "
                        f"schedules are {', '.join(VALID_LR_SCHEDULES)}")


class _ReadRecorder(dict):
    """A config dict that remembers which top-level keys DeepSpeed looked at (it reads each with get or [])."""
    read: set

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.read = set()

    def __copy__(self):        # DeepSpeedConfig works on a shallow copy: keep recording into the same set
        twin = _ReadRecorder(self)
        twin.read = self.read
        return twin

    def get(self, key, default=None):
        self.read.add(key)
        return super().get(key, default)

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        self.read.add(key)
        return super().__contains__(key)

    def keys(self):                 # DeepSpeed also asks `KEY in param_dict.keys()`
        return _RecordedKeys(self)


class _RecordedKeys:
    def __init__(self, config: _ReadRecorder):
        self.config = config

    def __contains__(self, key):
        return key in self.config

    def __iter__(self):
        return iter(dict.keys(self.config))

    def __len__(self):
        return len(self.config)


def check_liger(loss: str, kernels: str) -> None:
    """Liger's loss or kernels need the liger-kernel package, which only GPU hosts install (requirements-gpu.txt):
    checked here, where the ranks would fail only after building the model."""
    asked = [f"--{flag} liger" for flag, value in (("loss", loss), ("kernels", kernels)) if value == "liger"]
    if asked and importlib.util.find_spec("liger_kernel") is None:
        raise LabsError(f"{' and '.join(asked)}: Liger Kernel is not installed in this environment: "
                        f"`{sys.executable} -m pip install -r requirements-gpu.txt` (liger-kernel), or "
                        "--loss hf/chunked and --kernels stock")


def check_positive(name: str, value, kind=int):
    """A flag that must be a positive number (0 is refused, never read as 'not given')."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
    if not ok or (kind is int and not isinstance(value, int)):
        raise LabsError(f"{name} must be a positive {'integer' if kind is int else 'number'}, not {value!r}")
    return value


def ranks_that_fit(on_gpu: bool) -> int:
    """How many ranks labs starts on this host at most: one per GPU, or CPU_RANKS_PER_CORE per CPU core."""
    return torch.cuda.device_count() if on_gpu else CPU_RANKS_PER_CORE * env.usable_cores()


def check_hardware(nproc: int, on_gpu: bool, seq_len: int, dims: dict, estimate_kwargs: dict,
                   gpu_memory_bytes: int | None = None) -> None:
    """What is known before launching: ranks vs devices (one per GPU; on a CPU at most two per core: gloo ranks
    beyond that only thrash), sequence vs positions, and labs.memory's prediction against the memory each rank has (on
    a GPU the figure its fit weighs, `MemoryEstimate.fit_bytes_on` the card; on a CPU the peak plus this host's share).
    Refused when the prediction is 25% over: the model is within 10% on every recorded GPU run. On a GPU host, also
    the host memory of an offloaded optimizer, and of a ZeRO-1/2 start-up flatten DeepSpeed makes on the CPU because
    the card is too small for it (labs.memory.fit)."""
    devices = ranks_that_fit(on_gpu)
    if nproc > devices:
        what = f"{devices} GPU(s)" if on_gpu else \
            f"{env.usable_cores()} usable CPU core(s); labs starts at most {CPU_RANKS_PER_CORE} CPU ranks per core"
        raise LabsError(f"--nproc {nproc}: this machine has {what}")
    positions = dims.get("max_position_embeddings")
    if positions and seq_len > positions:
        raise LabsError(f"--seq-len {seq_len} is longer than the model's {positions} positions "
                        "(max_position_embeddings)")
    estimate = memory.estimate(**estimate_kwargs, host_pinning=host_pinning(on_gpu))
    if on_gpu:
        # the card's own memory, what DeepSpeed sees under a --gpu-memory cap too (None: the card is the cap's)
        whole = torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None
        have = gpu_memory_bytes or whole
        need, what = gpu_need(estimate, have, whole)
    else:
        have = host_memory_bytes() / nproc
        need = estimate.total_per_gpu_bytes + estimate.host_per_node_bytes / nproc
        what = f"a peak of {need / 2**30:,.1f} GiB per CPU rank"
    if need > 1.25 * have:
        raise LabsError(f"labs.memory predicts {what}, far above the "
                        f"{have / 2**30:,.1f} GiB there is; see `labs memory ... --gpu-memory` for what fits "
                        "(or pass --no-memory-check)")
    if on_gpu and need > memory.usable_bytes(have) - GPU_MARGIN and \
            "expandable_segments:True" not in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
        print(f"labs: note: labs.memory predicts {what}, within "
              f"{GPU_MARGIN / 2**30:.0f} GiB of the {memory.usable_bytes(have) / 2**30:,.1f} GiB PyTorch can use here; "
              "it counts allocated memory, and PyTorch's cache can hold GiBs more reserved but unallocated: if the run "
              "stops out of GPU memory saying so, set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
              file=sys.stderr, flush=True)
    # An offloaded optimizer's host memory, on a GPU host: the kernel's OOM killer ends a rank that runs out of it at
    # the first optimizer step, minutes in. The model is 2% under the one GPU record
    # (results/gpu/zenflow_1xh200/off20b), so more than the host's memory is refused outright.
    if not on_gpu:
        return
    host_bytes = host_memory_bytes()
    check_start_up_host(estimate, have, host_bytes, nproc, whole)
    if estimate.host_per_node_bytes > host_bytes:
        raise LabsError(f"labs.memory predicts {estimate.host_per_node_bytes / 2**30:,.1f} GiB of host memory for the "
                        f"offloaded optimizer of {nproc} rank(s), above the {host_bytes / 2**30:,.1f} GiB "
                        "this host has (PyTorch pins each buffer at a power of two; DS_PIN_MEMORY_BACKEND=native pins "
                        "it at its size): offload less, use more nodes, or pass --no-memory-check")
    if estimate.host_per_node_bytes > (1 - HOST_MARGIN) * host_bytes:
        print(f"labs: note: labs.memory predicts {estimate.host_per_node_bytes / 2**30:,.1f} GiB of host memory for "
              f"the offloaded optimizer, within {HOST_MARGIN:.0%} of the {host_bytes / 2**30:,.1f} GiB this host has; "
              "recorded runs held a few GiB more than predicted and the system needs its share: watch the host "
              "(tools/host_memory.sh) in the first steps", file=sys.stderr, flush=True)


def gpu_need(estimate, card_bytes, whole=None) -> tuple[int, str]:
    """The bytes a GPU must hold (the figure the fit weighs on this card; `whole`: the card's own memory where
    --gpu-memory caps it, which decides DeepSpeed's start-up flatten) and how check_hardware names them."""
    phase, need = estimate.fit_phase_on(card_bytes, whole), estimate.fit_bytes_on(card_bytes, whole)
    if phase == estimate.peak_phase:
        return need, f"a peak of {need / 2**30:,.1f} GiB per GPU"
    peak = estimate.total_per_gpu_bytes / 2**30
    return need, (f"{need / 2**30:,.1f} GiB per GPU at {phase} (the peak, its {peak:,.1f} GiB start-up flatten, is "
                  "made on the CPU on this card)")


def check_start_up_host(estimate, card_bytes, host_bytes, nproc: int, whole=None) -> None:
    """Refuse when ZeRO-1/2's start-up flatten, too large for the card, is made on the CPU (labs.memory.fit) and
    its ranks would hold more host memory at once than this host has: each holds its weights twice there."""
    need = estimate.start_up_host_per_node_bytes_on(card_bytes, whole)
    if need > host_bytes:
        raise LabsError(f"labs.memory predicts {need / 2**30:,.1f} GiB of host memory at start-up for {nproc} rank(s), "
                        f"above the {host_bytes / 2**30:,.1f} GiB this host has: ZeRO-{estimate.inputs['stage']}'s "
                        f"start-up flatten ({estimate.phases['init']['total'] / 2**30:,.1f} GiB per rank) is larger "
                        f"than the card's {(whole or card_bytes) / 2**30:,.1f} GiB, so DeepSpeed makes it on the CPU, "
                        "each rank holding its weights twice: use ZeRO-3, fewer ranks per host, or pass "
                        "--no-memory-check")


# Within this much of the card's usable memory (labs.memory.usable_bytes), a GPU run gets a note: on one H100 (74.7 GiB
# usable) stock's 4 x 2 predicted at 73.4 GiB ran out of memory with 11.2 GiB reserved but unallocated and ran with
# expandable segments (results/gpu/one_card_7b_1xh100/round42), and labs' 60.1% row at 74.1 ran out with 4.9 (round37).
GPU_MARGIN = 2 * 2**30

# Within this share of the host, an offload run that passes the check gets a note: the 7B at 70% offloaded held 107.4
# GiB against 104.8 predicted (results/gpu/one_card_7b_1xh200), sequential ZenFlow on the 3B 74.1 against 72.4
# (results/gpu/zenflow_finetune_1xh200/round23), and the system's own memory comes on top.
HOST_MARGIN = 0.10


def host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def host_pinning(on_gpu: bool) -> str:
    """How DeepSpeed will page-lock host buffers in this process's environment (labs.memory.estimate's host_pinning):
    on a CPU nothing is pinned; on a GPU, by PyTorch's allocator unless DeepSpeed's native backend is chosen."""
    return memory.host_pinning_of(on_gpu, os.environ.get("DS_PIN_MEMORY_BACKEND"))
