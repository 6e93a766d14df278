"""The cases `labs bench` runs: named ones (the recorded results in results/gpu use them) and composed ones.

Stock = what a user gets today from HF + DeepSpeed (or plain PyTorch FSDP2): the HF model and its loss (full logits
upcast to fp32), HF's gradient checkpointing on every layer, DeepSpeed's FusedAdam (torch's fused AdamW for FSDP2),
the stock configs (ds_configs/bench/stock_*). labs = the same model, data and precision (bf16 weights, fp32 master
weights and AdamW), with levers: Liger kernels and fused linear cross-entropy, checkpointing of only the first k
layers, torch's fused AdamW, larger buckets.

A composed case is `SIDE-ENGINE[-OPTION...]`:
    SIDE    stock | labs
    ENGINE  zero1 | zero2 | zero3 | fsdp2
    OPTION  ckfull | cknone | ckK (checkpoint the first K layers), mbN (micro-batch), gaN (accumulation steps),
            offload (optimizer to the CPU: DeepSpeed's CPU Adam), offloadhalf (ZeRO-3: half of the optimizer to
            the CPU, the other half stepped on the GPU: offload_optimizer.ratio 0.5), offloadall (ZeRO-3: the
            parameters to the CPU too, offload_param), nvme (ZeRO-3: the optimizer
            state on the disk under /tmp/labs-nvme, which must exist; swapped through CPU Adam), zenflow (ZeRO-2 offload with ZenFlow's overlapped,
            top-k selective CPU step), superoffload (ZeRO-3 offload with SuperOffload), stageonly (ZeRO-2/3 with
            the zero_optimization block cut to its stage, as DeepSpeed's autotuner runs its candidates), gpusN (ranks),
            compile (torch.compile of each decoder layer), sdpa-cudnn | sdpa-flash (attention backend),
            fp8 (torchao float8 training of the decoder layers' matmuls; FSDP2 only; a different numeric recipe)
e.g. `stock-zero3-ckfull-mb8`, `labs-fsdp2-ck14-mb4-ga2`. One option changes one lever, so a case differs from its
neighbour by exactly what its name says.
"""
from __future__ import annotations

import re

import torch

from labs import CONFIGS
from labs.errors import LabsError

# name -> (what it is, launch options). nproc None = every GPU (or 2 CPU ranks).
CASES: dict[str, tuple[str, dict]] = {
    "stock-zero3": ("stock HF + DeepSpeed ZeRO-3, full activation checkpointing",
                    dict(config="bench/stock_zero3.json", stock=True, activation_checkpointing="full")),
    "stock-zero2": ("stock HF + DeepSpeed ZeRO-2, full activation checkpointing",
                    dict(config="bench/stock_zero2.json", stock=True, activation_checkpointing="full")),
    "stock-zero3-offload": ("stock ZeRO-3 + optimizer offload to CPU (DeepSpeedCPUAdam), full checkpointing, 1 GPU",
                            dict(config="bench/stock_zero3_offload.json", stock=True,
                                 activation_checkpointing="full", nproc=1)),
    "labs-zero3": ("labs ZeRO-3: Liger kernels + fused linear CE, no activation checkpointing, fused AdamW, "
                   "1e9 buckets", dict(config="bench/labs_zero3.json", fast=True, activation_checkpointing="none")),
    "labs-zero3-granular": ("labs-zero3 fetching each decoder layer as one unit (stage3_module_granularity_threshold); "
                            "REJECTED: its loss stopped tracking stock on H200", dict(
                                config="bench/labs_zero3_granular.json", fast=True, activation_checkpointing="none")),
    "labs-zero3-mb3": ("labs-zero3 at micro-batch 3 (more tokens per gather and per optimizer step)",
                       dict(config="bench/labs_zero3.json", fast=True, activation_checkpointing="none",
                            micro_batch=3)),
    "labs-zero3-mb4-sel8": ("labs-zero3 at micro-batch 4, checkpointing 8 of 28 layers to fit",
                            dict(config="bench/labs_zero3.json", fast=True, activation_checkpointing="8",
                                 micro_batch=4)),
    "labs-zero3-subgroup": ("labs-zero3 with one optimizer sub-group per rank (sub_group_size 1e10)",
                            dict(config="bench/labs_zero3_subgroup.json", fast=True, activation_checkpointing="none")),
    "labs-zero2": ("labs ZeRO-2 (levers of labs-zero3)",
                   dict(config="bench/labs_zero2.json", fast=True, activation_checkpointing="none")),
    "labs-zero1": ("labs ZeRO-1 (levers of labs-zero3)",
                   dict(config="bench/labs_zero1.json", fast=True, activation_checkpointing="none")),
    "labs-fsdp2": ("FSDP2 (fully_shard per layer), same levers", dict(config="bench/labs_zero3.json", fast=True,
                                                                       engine="fsdp2", activation_checkpointing="none")),
    "labs-zero3-fp16": ("labs-zero3 in fp16 with dynamic loss scaling",
                        dict(config="bench/labs_zero3_fp16.json", fast=True, activation_checkpointing="none")),
    "labs-zero3-ckpt": ("labs-zero3 with full activation checkpointing (isolates the recompute lever)",
                        dict(config="bench/labs_zero3.json", fast=True, activation_checkpointing="full")),
    "lever-liger": ("stock-zero3 + Liger kernels and fused linear CE only (checkpointing kept)",
                    dict(config="bench/stock_zero3.json", fast=True, activation_checkpointing="full")),
    "lever-nockpt": ("stock-zero3 without activation checkpointing only (stock kernels and loss)",
                     dict(config="bench/stock_zero3.json", stock=True, activation_checkpointing="none")),
    "labs-zero3-offload": ("labs ZeRO-3 + full optimizer offload: Liger, no checkpointing, micro-batch 4, 1 GPU",
                           dict(config="bench/labs_zero3_offload.json", fast=True, activation_checkpointing="none",
                                micro_batch=4, nproc=1)),
    "labs-zero3-offload-ga4": ("labs-zero3-offload with 4 micro-batches per optimizer step (amortises the CPU step)",
                               dict(config="bench/labs_zero3_offload.json", fast=True, activation_checkpointing="none",
                                    micro_batch=4, grad_accum=4, nproc=1)),
    "labs-zero3-offload-half": ("labs-zero3-offload keeping half of the optimizer on the GPU (offload ratio 0.5)",
                                dict(config="bench/labs_zero3_offload_half.json", fast=True,
                                     activation_checkpointing="none", micro_batch=4, nproc=1)),
}
PAIRS = [("labs-zero3", "stock-zero3"), ("labs-zero3-mb3", "stock-zero3"), ("labs-zero3-mb4-sel8", "stock-zero3"),
         ("labs-zero3-subgroup", "stock-zero3"), ("labs-zero3-granular", "labs-zero3"), ("labs-zero3-offload", "stock-zero3-offload"),
         ("labs-zero3-offload-ga4", "stock-zero3-offload"), ("labs-zero3-offload-half", "stock-zero3-offload"),
         ("lever-liger", "stock-zero3"), ("lever-nockpt", "stock-zero3"), ("labs-zero3-ckpt", "stock-zero3"),
         ("labs-zero2", "stock-zero2"), ("labs-fsdp2", "labs-zero3"), ("labs-zero3-fp16", "labs-zero3")]

SIDES = {
    "stock": dict(stock=True, fast=False, checkpointing="full",
                  configs={"zero2": "bench/stock_zero2.json", "zero3": "bench/stock_zero3.json",
                           "fsdp2": "bench/stock_zero3.json"},
                  offload={"zero2": "bench/stock_zero2_offload.json", "zero3": "bench/stock_zero3_offload.json"},
                  offloadall={"zero3": "bench/stock_zero3_offload_all.json"},
                  stageonly={"zero2": "bench/stock_zero2_stage_only.json"}),
    "labs": dict(stock=False, fast=True, checkpointing="none",
                 configs={"zero1": "bench/labs_zero1.json", "zero2": "bench/labs_zero2.json",
                          "zero3": "bench/labs_zero3.json", "fsdp2": "bench/labs_zero3.json"},
                 offload={"zero2": "bench/labs_zero2_offload.json", "zero3": "bench/labs_zero3_offload.json"},
                 offloadhalf={"zero3": "bench/labs_zero3_offload_half.json"},
                 offloadall={"zero3": "bench/labs_zero3_offload_all.json"},
                 nvme={"zero3": "bench/labs_zero3_offload_nvme.json"},
                 zenflow={"zero2": "bench/labs_zero2_offload_zenflow.json"},
                 superoffload={"zero3": "bench/labs_zero3_offload_super.json"},
                 stageonly={"zero2": "bench/labs_zero2_stage_only.json", "zero3": "bench/labs_zero3_stage_only.json"}),
}
_OPTION = re.compile(r"ck(full|none|\d+)|mb(\d+)|ga(\d+)|gpus(\d+)|compile|fp8|offloadhalf|offloadall|offload|nvme|zenflow"
                     r"|superoffload|stageonly"
                     r"|sdpa-(cudnn|flash|efficient)")


def compose(name: str) -> tuple[str, dict]:
    """(description, launch options) of a composed case name; LabsError naming what is wrong."""
    side, _, rest = name.partition("-")
    engine, *options = rest.split("-") if rest else [""]
    if side not in SIDES or engine not in SIDES[side]["configs"]:
        raise LabsError(f"unknown bench case '{name}'; use a named case ({', '.join(CASES)}) or SIDE-ENGINE[-OPTION...] "
                        f"with SIDE stock|labs and ENGINE {'|'.join(SIDES['labs']['configs'])} (labs.bench.cases)")
    spec = SIDES[side]
    launch = dict(config=spec["configs"][engine], stock=spec["stock"], fast=spec["fast"],
                  activation_checkpointing=spec["checkpointing"], engine="fsdp2" if engine == "fsdp2" else "deepspeed")
    words = []
    for option in _join_sdpa(options):
        match = _OPTION.fullmatch(option)
        if not match:
            raise LabsError(f"bench case '{name}': unknown option '{option}' (ckfull, cknone, ckK, mbN, gaN, gpusN, "
                            "compile, fp8, offload, offloadhalf, offloadall, nvme, zenflow, superoffload, stageonly, "
                            "sdpa-cudnn, sdpa-flash)")
        if match.group(1):
            launch["activation_checkpointing"] = match.group(1)
        elif match.group(2):
            launch["micro_batch"] = int(match.group(2))
        elif match.group(3):
            launch["grad_accum"] = int(match.group(3))
        elif match.group(4):
            launch["nproc"] = int(match.group(4))
        elif option in ("compile", "fp8"):
            launch[option] = True
        elif option in ("offload", "offloadhalf", "offloadall", "nvme", "zenflow", "superoffload", "stageonly"):
            if engine not in spec.get(option, {}):
                raise LabsError(f"bench case '{name}': {option} is defined for {side} with "
                                f"{', '.join(spec.get(option, {})) or 'no engine'}")
            launch["config"] = spec[option][engine]
        else:
            launch["sdpa"] = match.group(5)
        words.append(option)
    return f"{side} {engine}" + (f" ({', '.join(words)})" if words else ""), launch


def _join_sdpa(options):
    joined, skip = [], False
    for i, option in enumerate(options):
        if skip:
            skip = False
        elif option == "sdpa" and i + 1 < len(options):
            joined.append(f"sdpa-{options[i + 1]}")
            skip = True
        else:
            joined.append(option)
    return joined


def describe(name: str) -> str:
    return CASES[name][0] if name in CASES else compose(name)[0]


def _liger_available() -> bool:
    try:
        import liger_kernel  # noqa: F401
        return torch.cuda.is_available()
    except ImportError:
        return False


def case_options(name: str, preset: str, steps: int, seq_len, micro_batch, on_gpu: bool | None = None) -> dict:
    """The keyword arguments of labs.launch.run for one case. `on_gpu` (default: this machine) picks the fast path's
    loss: Liger needs Triton on a GPU, so on a CPU the fast path falls back to labs' chunked loss."""
    options = dict(CASES[name][1]) if name in CASES else compose(name)[1]
    fast = options.pop("fast", False)
    liger = _liger_available() if on_gpu is None else on_gpu
    options.update(loss=("liger" if liger else "chunked") if fast else "hf", kernels="liger" if fast and liger else "stock")
    options["config"] = CONFIGS / options["config"]
    options.update(preset=preset, steps=steps, seq_len=seq_len, warmup_steps=2)
    if micro_batch and "micro_batch" not in options:
        options["micro_batch"] = micro_batch
    return options


def train_line(options: dict, nproc: int, inputs: str = "") -> str:
    """A `labs train` line from a run's options (a bench case's, or a run.json with its resolved batch), with
    `inputs` (such as "--model-path ... --data ...") after the config."""
    flags = [f"--preset {options['preset']}", f"--config bench/{options['config'].rsplit('/', 1)[-1]}"]
    flags += [inputs] if inputs else []
    flags += [f"--{key.replace('_', '-')} {options[key]}" for key in ("engine", "loss", "kernels",
              "activation_checkpointing", "micro_batch", "grad_accum") if options.get(key) not in (None, "None")]
    return " ".join(["labs train", *flags, f"--nproc {nproc}"])
