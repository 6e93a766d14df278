"""How many bytes training needs on each GPU and each host: the ZeRO paper's accounting, DeepSpeed's own
accounting, and a model of the real peak of `torch.cuda.max_memory_allocated`.

    from labs import memory
    est = memory.estimate("qwen2.5-7b", stage=3, gpus_per_node=2, micro_batch=2, seq_len=4096)
    est.total_per_gpu_bytes / 2**30, est.fits(memory.gpu_bytes("H200")), est.peak_phase

Three accountings, each proven by a test:
- `paper_model_states_per_gpu_bytes`: Rajbhandari et al. (2019), Table 1: fp16 params 2 Psi, fp16 grads 2 Psi,
  K Psi of optimizer states (K = 12 for mixed-precision Adam: fp32 master, momentum, variance), divided
  by N_d for the parts each stage partitions.
- `model_states_per_gpu_bytes`: what DeepSpeed's own estimators return
  (`estimate_zero2_model_states_mem_needs`, `estimate_zero3_model_states_mem_needs`). They add what the
  paper leaves out: the fp32 copy of the gradient partition made inside the optimizer step (4 bytes, so
  18 instead of 14 per partitioned parameter at ZeRO-2) and, at ZeRO-3, the largest layer gathered whole
  with its gradient (4 bytes per parameter of that layer). Stages 0 and 1 have no DeepSpeed estimator;
  we apply the same rules (2 + 2 + 4 + 12 bytes, partitioned as the stage does).
- The peak (`total_per_gpu_bytes`): the live bytes at five moments of a step (`phases`), from the code of
  DeepSpeed 0.19 (stage_1_and_2.py, stage3.py, partitioned_param_coordinator.py), transformers' Qwen2 and
  torch's autograd; the largest wins (`peak_phase`). Its parts (params, grads, optimizer, activations,
  buffers) are those live at that moment, so they add up to the total. `resident_per_rank` is what each
  rank holds after backward, before the optimizer step: what labs.probe measures on a real engine.
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field

from labs import activations as act
from labs import layout as zero_layout
from labs import models, peak
from labs.errors import LabsError

GiB, GB = 2 ** 30, 10 ** 9
OPTIMIZERS = {"adamw": 8, "adam": 8, "adamw8bit": 2, "adafactor": None, "lion": 4, "sgd": 4}  # state bytes/param
PRECISIONS = {"bf16": 2, "fp16": 2, "fp32": 4}
OFFLOADS = (None, "none", "cpu", "nvme")
# DeepSpeed's defaults (deepspeed/runtime/zero/config.py) and the values labs.config gives "auto" keys.
DS_DEFAULTS = dict(reduce_bucket_size=5e8, allgather_bucket_size=5e8, overlap_comm=False, contiguous_gradients=True,
                   stage3_prefetch_bucket_size=5e7, stage3_param_persistence_threshold=1e5,
                   stage3_max_live_parameters=1e9, stage3_max_reuse_distance=1e9, sub_group_size=1e9)
# Where the parameter layout lives now (labs.layout); the old names keep working.
param_layout, largest_layer_params = zero_layout.param_layout, zero_layout.largest_layer_params
zero12_grad_elements, zero3_partition = zero_layout.zero12_grad_elements, zero_layout.zero3_partition
# Memory as nvidia-smi reports it (MiB); the H200 figure was read on this project's machines.
GPUS = {"H200": 143771 * 2 ** 20, "H100": 81559 * 2 ** 20, "A100-80GB": 81920 * 2 ** 20,
        "A100-40GB": 40960 * 2 ** 20, "RTX4090": 24564 * 2 ** 20, "RTX3090": 24576 * 2 ** 20, "V100-32GB": 32768 * 2 ** 20}


# ------------------------------------------------------------------------------------------ the estimate
@dataclass
class MemoryEstimate:
    """Bytes per GPU (the worst rank) and per host node. See the module docstring for the three accountings."""
    params: int
    params_per_gpu_bytes: int
    grads_per_gpu_bytes: int
    optimizer_per_gpu_bytes: int
    activations_per_gpu_bytes: int
    buffers_per_gpu_bytes: int
    total_per_gpu_bytes: int
    model_states_per_gpu_bytes: int
    paper_model_states_per_gpu_bytes: int
    host_per_node_bytes: int
    nvme_per_node_bytes: int
    peak_phase: str
    phases: dict
    resident_per_rank: list
    deepspeed_estimator: dict
    breakdown: dict
    inputs: dict
    notes: list = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)

    def fits(self, gpu_memory_bytes, reserve_bytes=None) -> bool:
        """Whether the peak fits, leaving `reserve_bytes` (default 1 GiB + 5%: CUDA context, NCCL and
        cuBLAS workspaces, allocator fragmentation) of the card free."""
        return self.total_per_gpu_bytes <= usable_bytes(gpu_memory_bytes, reserve_bytes)

    def advise(self, gpu_memory_bytes, reserve_bytes=None):
        from labs.advise import advise

        return advise(gpu_memory_bytes, reserve_bytes=reserve_bytes, **self.inputs)


def usable_bytes(gpu_memory_bytes, reserve_bytes=None) -> int:
    gpu_memory_bytes = parse_bytes(gpu_memory_bytes)
    reserve = GiB + 0.05 * gpu_memory_bytes if reserve_bytes is None else parse_bytes(reserve_bytes)
    return int(gpu_memory_bytes - reserve)


def estimate(preset=None, *, params=None, dims=None, stage=None, gpus_per_node=1, nodes=1, precision=None,
             offload_optimizer=None, offload_param=None, micro_batch=None, seq_len=4096,
             activation_checkpointing="none", loss="hf", kernels="stock", optimizer="adamw", ds_config=None,
             engine="deepspeed", largest_layer=None, zero_init=True) -> MemoryEstimate:
    """Predict per-GPU and per-host bytes. Give a `preset` name, `dims` (labs.models.shape), or only
    `params` (then activations are unknown and reported as 0). `stage` defaults to the ds_config's or 3,
    `precision` to the ds_config's or "bf16", `micro_batch` to the ds_config's or 1; offloads given as None
    come from the ds_config (or are off). `ds_config` (a resolved DeepSpeed config dict) supplies bucket
    sizes, prefetch, persistence threshold, live-parameter limits and sub-group size; without it DeepSpeed's
    defaults apply, with labs' "auto" rules (bucket h^2, prefetch 0.9 h^2, persistence 10 h) when dims are
    known. `engine="fsdp2"` approximates FSDP2 full sharding (fp32 sharded params, grads and Adam states,
    bf16 layers gathered one ahead; no DeepSpeed buffers)."""
    cfg = ds_config or {}
    zero = dict(cfg.get("zero_optimization") or {})
    inputs = dict(preset=preset, params=params, dims=dims, stage=stage, gpus_per_node=gpus_per_node, nodes=nodes,
                  precision=precision, offload_optimizer=offload_optimizer, offload_param=offload_param,
                  micro_batch=micro_batch, seq_len=seq_len, activation_checkpointing=activation_checkpointing,
                  loss=loss, kernels=kernels, optimizer=optimizer, ds_config=ds_config, engine=engine,
                  largest_layer=largest_layer, zero_init=zero_init)
    if preset is not None:
        dims = models.shape(models.check_preset(preset))
    if dims is not None:
        layout = zero_layout.param_layout(dims)
        params = sum(n for _, n in layout)
    elif params is None:
        raise LabsError("give a preset (tiny, qwen-7b, qwen2.5-7b), dims, or params (e.g. --params 7.5e9)")
    else:
        params = int(float(params))
        layout = [("all parameters", params)]
    if params <= 0:
        raise LabsError(f"params must be positive, not {params}")
    stage = int(zero.get("stage", 3) if stage is None else stage)
    if stage not in (0, 1, 2, 3):
        raise LabsError(f"ZeRO stage must be 0, 1, 2 or 3, not {stage}")
    precision = precision or ("bf16" if cfg.get("bf16", {}).get("enabled") is True or not cfg else
                              "fp16" if cfg.get("fp16", {}).get("enabled") is True else "fp32")
    if precision not in PRECISIONS:
        raise LabsError(f"unknown precision '{precision}'; choose one of: {', '.join(PRECISIONS)}")
    offload_optimizer = _offload(offload_optimizer, zero, "optimizer")
    offload_param = _offload(offload_param, zero, "param")
    if offload_param and stage != 3:
        raise LabsError(f"offload_param needs ZeRO stage 3 (got stage {stage}); offload the optimizer instead")
    if offload_optimizer and stage == 0:
        raise LabsError("offload_optimizer needs ZeRO stage 1, 2 or 3 (got stage 0)")
    if optimizer not in OPTIMIZERS:
        raise LabsError(f"unknown optimizer '{optimizer}'; choose one of: {', '.join(OPTIMIZERS)}")
    if engine not in ("deepspeed", "fsdp2"):
        raise LabsError(f"unknown engine '{engine}'; choose deepspeed or fsdp2")
    if loss not in act.LOSSES:
        raise LabsError(f"unknown loss '{loss}'; choose one of: {', '.join(act.LOSSES)}")
    if kernels not in act.KERNELS:
        raise LabsError(f"unknown kernels '{kernels}'; choose one of: {', '.join(act.KERNELS)}")
    micro_batch = int(micro_batch or (cfg.get("train_micro_batch_size_per_gpu") if
                                      isinstance(cfg.get("train_micro_batch_size_per_gpu"), int) else 1))
    for name, value in (("gpus_per_node", gpus_per_node), ("nodes", nodes), ("micro_batch", micro_batch),
                        ("seq_len", seq_len)):
        if not isinstance(value, int) or value < 1:
            raise LabsError(f"{name} must be a positive integer, not {value!r}")
    world = gpus_per_node * nodes
    knobs = _zero_knobs(zero, dims, stage)
    inputs.update(stage=stage, precision=precision, micro_batch=micro_batch, offload_optimizer=offload_optimizer,
                  offload_param=offload_param)
    if dims is not None:
        act.checkpointed_layers(activation_checkpointing, dims["num_hidden_layers"])   # validates
    largest = largest_layer if largest_layer is not None else (zero_layout.largest_layer_params(dims) if dims else 0)

    d = PRECISIONS[precision]
    mixed = precision != "fp32"
    state_bytes = _optimizer_state_bytes(optimizer, layout, dims)       # Adam: 8 per parameter
    k = (4 if mixed else 0) + state_bytes / params                       # the paper's K (12 for Adam)
    paper = paper_model_states_bytes(params, stage, world, k=k, param_bytes=d, grad_bytes=d)
    ds = deepspeed_estimator(params, stage, gpus_per_node, nodes, largest, offload_optimizer, offload_param,
                             zero_init=zero_init, k=k)
    acts = _activations(dims, micro_batch, seq_len, activation_checkpointing, loss, kernels, d)
    args = dict(params=params, layout=layout, dims=dims, stage=stage, world=world, d=d, mixed=mixed,
                state_bytes=state_bytes, offload_optimizer=offload_optimizer, offload_param=offload_param,
                knobs=knobs, acts=acts)
    phases, resident, host_rank, nvme_rank = (peak.fsdp2 if engine == "fsdp2" else peak.deepspeed)(**args)
    for p in phases.values():
        p["total"] = sum(p.values())
        for key in p:
            p[key] = int(p[key])
    peak_phase = max(phases, key=lambda name: phases[name]["total"])
    top = phases[peak_phase]
    notes = []
    if dims is None:
        notes.append("only a parameter count was given: activations, the loss and layer-sized buffers are 0")
    if "liger" in (loss, kernels):
        notes.append("Liger's Triton kernels need a GPU")
    if engine == "fsdp2":
        notes.append("fsdp2 is approximated: fp32 sharded params/grads/Adam states, bf16 layers gathered one "
                     "ahead, embedding and head gathered by the root; model_states_* are DeepSpeed's numbers")
    breakdown = dict(activations=acts["parts"], loss=acts["loss_parts"], per_layer_bytes=acts["layer"],
                     checkpointed_layers=acts["checkpointed"], tokens_per_gpu=micro_batch * seq_len, knobs=knobs,
                     optimizer_state_bytes_per_param=state_bytes / params, k=k)
    return MemoryEstimate(
        params=params, params_per_gpu_bytes=top["params"], grads_per_gpu_bytes=top["grads"],
        optimizer_per_gpu_bytes=top["optimizer"], activations_per_gpu_bytes=top["activations"],
        buffers_per_gpu_bytes=top["buffers"], total_per_gpu_bytes=top["total"],
        model_states_per_gpu_bytes=int(ds["gpu"]), paper_model_states_per_gpu_bytes=int(paper),
        host_per_node_bytes=int(host_rank * gpus_per_node), nvme_per_node_bytes=int(nvme_rank * gpus_per_node),
        peak_phase=peak_phase, phases=phases, resident_per_rank=resident, deepspeed_estimator=ds,
        breakdown=breakdown, inputs=inputs, notes=notes)


# ------------------------------------------------------------------------------------------ accountings
def paper_model_states_bytes(params, stage: int, world: int, k: float = 12, param_bytes=2, grad_bytes=2) -> float:
    """ZeRO paper, section 5: model states per device. Baseline (stage 0) (2 + 2 + K) Psi; P_os (stage 1)
    (2 + 2) Psi + K Psi / N_d; P_os+g (stage 2) 2 Psi + (2 + K) Psi / N_d; P_os+g+p (stage 3)
    (2 + 2 + K) Psi / N_d. No offload: the paper keeps everything on the device."""
    psi, n = params, world
    p, g = param_bytes * psi, grad_bytes * psi
    return {0: p + g + k * psi, 1: p + g + k * psi / n, 2: p + (g + k * psi) / n, 3: (p + g + k * psi) / n}[stage]


def deepspeed_estimator(params, stage, gpus_per_node, nodes, largest_layer, offload_optimizer, offload_param,
                        zero_init=True, additional_buffer_factor=1.5, k=12) -> dict:
    """DeepSpeed's returning estimators, term by term (deepspeed/runtime/zero/stage_1_and_2.py and stage3.py,
    `estimate_zero{2,3}_model_states_mem_needs`): {'gpu': bytes per GPU, 'cpu': bytes per node}.
    ZeRO-2: 2 Psi of fp16 params on every GPU + 18 Psi / N, where 18 = 2 fp16 grads + 4 fp32 grads + 4 fp32
    params + 8 Adam states; with the optimizer offloaded only the 2 Psi stay. ZeRO-3: 4 bytes per parameter
    of the largest layer (its fp16 params and grads, gathered whole) + 18 Psi / N, less with offload.
    Host numbers are DeepSpeed's own rules, with its 1.5x `additional_buffer_factor`.
    Stages 0 and 1 have no estimator upstream: the same rules, with nothing (0) or only the optimizer (1)
    partitioned. Other optimizers change the 4 + 8 = 12 (the paper's K) in the 18."""
    total_gpus = gpus_per_node * nodes
    partitioned = 2 + 4 + k                              # 18 for Adam
    partitioned = int(partitioned) if float(partitioned).is_integer() else partitioned
    if stage == 3:
        gpus_factor = 1 / nodes
        largest_layer_memory = 4 * largest_layer
        if offload_optimizer and offload_param:
            gpu = largest_layer_memory
            cpu = params * (18 * gpus_factor if zero_init else max(4 * gpus_per_node, 18 * gpus_factor)) \
                * additional_buffer_factor
        elif offload_optimizer:
            gpu = largest_layer_memory + int(2 * params / total_gpus)
            cpu = params * (16 * gpus_factor if zero_init else max(4 * gpus_per_node, 16 * gpus_factor)) \
                * additional_buffer_factor
        else:                                            # (upstream ignores offload_param without offload_optimizer)
            gpu = largest_layer_memory + int(partitioned * params / total_gpus)
            cpu = (largest_layer if zero_init else params) * 4 * gpus_per_node * additional_buffer_factor
        return dict(gpu=int(gpu), cpu=int(cpu), source="estimate_zero3_model_states_mem_needs")
    full_grads = 2 * params if stage < 2 else 0          # ZeRO-0/1 keep every fp16 gradient
    if stage == 0:
        gpu = 2 * params + full_grads + partitioned * params - 2 * params
        return dict(gpu=int(gpu), cpu=int(params * 4 * gpus_per_node * additional_buffer_factor),
                    source="zero2 rules, nothing partitioned")
    if offload_optimizer:
        gpu = 2 * params + full_grads
        cpu = params * max(4 * total_gpus, 16) * additional_buffer_factor
    else:
        gpu = 2 * params + full_grads + int((partitioned - (2 if stage < 2 else 0)) * params / total_gpus)
        cpu = params * 4 * gpus_per_node * additional_buffer_factor
    source = "estimate_zero2_model_states_mem_needs" if stage == 2 else "zero2 rules, gradients not partitioned"
    return dict(gpu=int(gpu), cpu=int(cpu), source=source)


# ------------------------------------------------------------------------------------------ helpers
def _offload(given, zero: dict, part: str):
    if given not in OFFLOADS:
        raise LabsError(f"offload_{part} '{given}': use none, cpu or nvme")
    if given is None:
        given = (zero.get(f"offload_{part}") or {}).get("device")
    return None if given in (None, "none") else given


def _zero_knobs(zero: dict, dims, stage: int) -> dict:
    """DeepSpeed's buffer settings. No config at all: labs' ds_configs/zero3.json ("auto" keys, overlap_comm
    on). A config: its values; "auto" resolved with labs' rules (bucket h^2, prefetch 0.9 h^2, persistence
    10 h); missing keys take DeepSpeed's defaults (overlap_comm defaults to on at stage 3 only)."""
    h = dims["hidden_size"] if dims else None
    auto = dict(reduce_bucket_size=h * h, stage3_prefetch_bucket_size=int(0.9 * h * h),
                stage3_param_persistence_threshold=10 * h) if h else {}
    if not zero:
        zero = dict(auto, overlap_comm=True)
    knobs = {}
    for key, default in DS_DEFAULTS.items():
        value = zero.get(key, default)
        knobs[key] = auto.get(key, default) if value == "auto" else value
    if "overlap_comm" not in zero:
        knobs["overlap_comm"] = stage == 3
    return knobs


def _optimizer_state_bytes(optimizer: str, layout, dims) -> float:
    """Optimizer state bytes in total (fp32 master weights excluded). Adam/AdamW: momentum + variance, 8 per
    parameter. 8-bit Adam: 2 (block-wise quantisation statistics are <1% more). Lion, SGD with momentum: 4.
    Adafactor (no momentum, factored variance): a row and a column vector per matrix, a full vector per
    bias/norm vector."""
    per_param = OPTIMIZERS[optimizer]
    total = sum(n for _, n in layout)
    if per_param is not None:
        return per_param * total
    if dims is None:
        return 0.0
    h, f, vocab = dims["hidden_size"], dims["intermediate_size"], dims["vocab_size"]
    kv = h // dims["num_attention_heads"] * dims["num_key_value_heads"]
    shapes = {h * h: (h, h), kv * h: (kv, h), f * h: (f, h), vocab * h: (vocab, h)}
    state = 0
    for name, numel in layout:
        rows_cols = shapes.get(numel) if name.endswith("weight") and "norm" not in name else None
        state += 4 * (sum(rows_cols) if rows_cols else numel)
    return float(state)


def _activations(dims, micro_batch, seq_len, checkpointing, loss, kernels, d) -> dict:
    if dims is None:
        return dict(parts={}, loss_parts={}, saved=0, final_norm=0, layer=0, temporaries=0, loss=0,
                    checkpointed=0, layers=0, head=0, layer_params=0)
    parts = act.activation_bytes(dims, micro_batch, seq_len, checkpointing, kernels, d)
    tokens = micro_batch * seq_len
    loss_parts = act.loss_bytes(dims, loss, micro_batch, seq_len, d)
    head = dims["vocab_size"] * dims["hidden_size"]
    layer_params = sum(n for name, n in zero_layout.param_layout(dims) if name.startswith("model.layers.0."))
    return dict(parts=parts, loss_parts=loss_parts,
                saved=parts["layers kept whole"] + parts["checkpointed layer inputs"] + parts["token ids"],
                final_norm=parts["final norm"], layer=act.layer_bytes_per_token(dims, kernels, d) * tokens,
                temporaries=act.backward_temporaries_bytes_per_token(dims, kernels, d) * tokens,
                loss=sum(loss_parts.values()), loss_kind=loss,
                checkpointed=act.checkpointed_layers(checkpointing, dims["num_hidden_layers"]),
                layers=dims["num_hidden_layers"], head=head, layer_params=layer_params)


_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2 ** 10, "mib": 2 ** 20,
          "gib": 2 ** 30, "tib": 2 ** 40}


def parse_bytes(value) -> int:
    """80GiB, 80 GB, 141e9, 'H200' (a GPU in GPUS) or a number of bytes."""
    if isinstance(value, (int, float)):
        return int(value)
    text = str(value).strip()
    if text in GPUS:
        return GPUS[text]
    match = re.fullmatch(r"([0-9.]+(?:e[0-9]+)?)\s*([a-zA-Z]*)", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise LabsError(f"memory size '{value}': write e.g. 80GiB, 141GB, 24e9 or a GPU name "
                        f"({', '.join(GPUS)})")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def gpu_bytes(name: str) -> int:
    return parse_bytes(name)


def from_run(run, **overrides) -> MemoryEstimate:
    """The estimate for a labs run folder (a launch.Run or its path): same preset, ranks, config and flags."""
    from labs.launch import Run

    run = run if isinstance(run, Run) else Run(__import__("pathlib").Path(run))
    spec = run.spec
    kwargs = dict(dims=spec["dims"], gpus_per_node=spec["nproc"], seq_len=spec["seq_len"], loss=spec["loss"],
                  activation_checkpointing=spec["activation_checkpointing"], ds_config=run.ds_config,
                  engine=spec["engine"])
    kwargs.update(overrides)
    return estimate(**kwargs)
