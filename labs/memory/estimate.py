"""The memory model's entry point: how many bytes training needs on each GPU and each host.

    from labs import memory
    est = memory.estimate("qwen2.5-7b", stage=3, gpus_per_node=2, micro_batch=2, seq_len=4096)
    est.total_per_gpu_bytes / 2**30, est.fits(memory.gpu_bytes("H200")), est.peak_phase

Three accountings, each proven by a test, and the fit:
- `paper_model_states_per_gpu_bytes`: the ZeRO paper's Table 1 (labs.memory.accounting).
- `model_states_per_gpu_bytes`: DeepSpeed's own estimators, term by term (labs.memory.accounting). Stages 0 and 1
  have no DeepSpeed estimator; we apply the same rules (2 + 2 + 4 + 12 bytes, partitioned as the stage does).
- The peak (`total_per_gpu_bytes`): the live bytes at five moments of a step (`phases`, labs.memory.peak), from the
  code of DeepSpeed 0.19, transformers' Qwen2 and torch's autograd; the largest wins (`peak_phase`). Its parts
  (params, grads, optimizer, activations, buffers) are those live at that moment, so they add up to the total.
  `resident_per_rank` is what each rank holds after backward, before the optimizer step: what the state_bytes
  instrument measures on a real engine.
- The fit, for a card (`fits`, `fit_bytes_on`, labs.memory.fit): every moment counts but ZeRO-1/2's start-up flatten
  (`init`) where it exceeds the card's total memory, since DeepSpeed then makes it on the CPU, at a cost in host memory.

Every default (micro-batch, sequence length, precision, the DeepSpeed config and its "auto" values) comes from
labs.resolve, the resolver `labs train` uses: an estimate and a run with the same arguments describe the same run.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from labs import config as config_lib
from labs import fsdp, models, resolve
from labs.errors import LabsError, check_choice
from labs.memory import activations as act
from labs.memory import layout as zero_layout
from labs.memory import fit, host, peak
from labs.memory.accounting import OPTIMIZERS, deepspeed_estimator, optimizer_state_bytes, paper_model_states_bytes
from labs.memory.units import parse_bytes, usable_bytes
from labs.runfolder import Run

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
OFFLOAD_DEVICES = (None, "none", "cpu", "nvme")
ENGINES = ("deepspeed", "fsdp2")
HOST_PINNING = ("torch", "exact")


def host_pinning_of(on_gpu: bool, pin_memory_backend: str | None) -> str:
    """estimate()'s host_pinning for ranks on a GPU or not, under DeepSpeed's DS_PIN_MEMORY_BACKEND (None: unset):
    on a CPU nothing is pinned; on a GPU PyTorch's allocator pins, rounding up, unless the native backend is chosen."""
    native = (pin_memory_backend or "torch").strip().lower() == "native"
    return "torch" if on_gpu and not native else "exact"


# ------------------------------------------------------------------------------------------ the estimate
@dataclass
class MemoryEstimate:
    """Bytes per GPU (the worst rank) and per host node. See the module docstring for the accountings."""
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
    init_falls_back: bool = False       # DeepSpeed flattens at start-up on the CPU on a card too small for it

    def as_dict(self) -> dict:
        return asdict(self)

    def fit_phase_on(self, gpu_memory_bytes, total=None) -> str:
        """The moment a fit verdict on this card weighs: the peak's but for a flatten on the CPU (labs.memory.fit;
        `total`: the card's whole memory where a cap gives PyTorch less)."""
        return fit.phase_on(self, gpu_memory_bytes, total)

    def fit_bytes_on(self, gpu_memory_bytes, total=None) -> int:
        """The bytes the card must hold for the setting to fit (the peak but for a start-up flatten on the CPU)."""
        return self.phases[self.fit_phase_on(gpu_memory_bytes, total)]["total"]

    def start_up_host_per_node_bytes_on(self, gpu_memory_bytes, total=None) -> int:
        """Host memory per node a start-up flatten made on the CPU needs on this card (0 where it is not)."""
        return fit.start_up_host_per_node_bytes(self, gpu_memory_bytes, total)

    def fits(self, gpu_memory_bytes, reserve_bytes=None) -> bool:
        """Whether `fit_bytes_on` the card leaves it `reserve_bytes` free (labs.memory.usable_bytes: 1 GiB + 5%)."""
        return self.fit_bytes_on(gpu_memory_bytes) <= usable_bytes(gpu_memory_bytes, reserve_bytes)


def estimate(preset=None, *, params=None, dims=None, stage=None, gpus_per_node=1, nodes=1, precision=None,
             offload_optimizer=None, offload_param=None, micro_batch=None, grad_accum=None, seq_len=None,
             activation_checkpointing="none", loss="hf", kernels="stock", optimizer="adamw", ds_config=None,
             engine="deepspeed", largest_layer=None, zero_init=True, host_pinning="torch",
             zenflow_columns="labs", zenflow_moments="labs") -> MemoryEstimate:
    """Predict per-GPU and per-host bytes. Give a `preset` name, `dims` (labs.models.shape), or only
    `params` (then activations are unknown and reported as 0). `ds_config` (a DeepSpeed config dict, "auto"
    values allowed) supplies the stage, precision, micro-batch, offloads and buffer knobs; without one, the
    config a run would use (labs.resolve.default_config: zero3.json, or the lesson file of `stage`). Arguments
    given here override the config; the rest default as `labs train` would (labs.resolve).
    `engine="fsdp2"` approximates FSDP2 full sharding (fp32 sharded params, grads and Adam states, bf16 layers
    gathered one ahead; no DeepSpeed buffers).
    `host_pinning`: how an offloaded optimizer's `pin_memory: true` buffers are page-locked. "torch" (a GPU host,
    DeepSpeed's default): PyTorch's pinned allocator rounds each up to a power of two; "exact": DeepSpeed's CPU
    accelerator (nothing is pinned) or `DS_PIN_MEMORY_BACKEND=native` (page-locked at their own size).
    `zenflow_columns`: how ZenFlow (ZeRO-1/2) keeps the columns it updates on the GPU. "labs" (labs.zenflow_columns,
    every labs run since round 18): an fp32 master and fp32 moments. "deepspeed" (DeepSpeed 0.19.8 alone, and labs
    runs recorded before): two bf16 moments. `zenflow_moments`: how many sets of Adam moments ZenFlow's overlapped
    optimizer process keeps on the host. "labs" (labs.zenflow_moments): one; "deepspeed" (DeepSpeed alone, and labs
    runs recorded before it): two."""
    inputs = dict(preset=preset, params=params, dims=dims, stage=stage, gpus_per_node=gpus_per_node, nodes=nodes,
                  precision=precision, offload_optimizer=offload_optimizer, offload_param=offload_param,
                  micro_batch=micro_batch, grad_accum=grad_accum, seq_len=seq_len,
                  activation_checkpointing=activation_checkpointing, loss=loss, kernels=kernels, optimizer=optimizer,
                  ds_config=ds_config, engine=engine, largest_layer=largest_layer, zero_init=zero_init,
                  host_pinning=host_pinning, zenflow_columns=zenflow_columns, zenflow_moments=zenflow_moments)
    if preset is not None:
        dims = models.shape(models.check_preset(preset))
    if dims is not None:
        layout = zero_layout.param_layout(dims)
        params = sum(n for _, n in layout)
    elif params is None:
        raise LabsError(f"give a preset ({', '.join(models.PRESETS)}), dims, or params (e.g. --params 7.5e9)")
    else:
        params = _count(params)
        layout = [("all parameters", params)]
    check_choice("optimizer", optimizer, OPTIMIZERS)
    check_choice("engine", engine, ENGINES)
    check_choice("loss", loss, act.LOSSES)
    check_choice("kernels", kernels, act.KERNELS)
    check_choice("host_pinning", host_pinning, HOST_PINNING)
    for name, value in (("gpus_per_node", gpus_per_node), ("nodes", nodes), ("micro_batch", micro_batch),
                        ("grad_accum", grad_accum), ("seq_len", seq_len)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise LabsError(f"{name} must be a positive integer, not {value!r}")
    world = gpus_per_node * nodes
    resolved = _resolved_config(ds_config, stage, world, dims, preset, micro_batch, grad_accum, precision)
    stage, precision = config_lib.stage(resolved), config_lib.precision(resolved)
    micro_batch, grad_accum = resolved["train_micro_batch_size_per_gpu"], resolved["gradient_accumulation_steps"]
    seq_len = seq_len or resolve.run_defaults(preset)["seq_len"]
    zero = resolved.get("zero_optimization") or {}
    offload_optimizer = _offload(offload_optimizer, zero, "optimizer")
    offload_param = _offload(offload_param, zero, "param")
    if offload_param and stage != 3:
        raise LabsError(f"offload_param needs ZeRO stage 3 (got stage {stage}); offload the optimizer instead")
    if offload_optimizer and stage == 0:
        raise LabsError("offload_optimizer needs ZeRO stage 1, 2 or 3 (got stage 0)")
    if offload_optimizer == "nvme" and stage != 3:      # DeepSpeed 0.19's ZeRO-1/2 offload only to the CPU
        raise LabsError(f"offload_optimizer \"nvme\" needs ZeRO stage 3 (got stage {stage}); use \"cpu\"")
    knobs = resolve.zero_knobs(resolved)
    inputs.update(stage=stage, precision=precision, micro_batch=micro_batch, grad_accum=grad_accum, seq_len=seq_len,
                  offload_optimizer=offload_optimizer, offload_param=offload_param)
    if dims is not None:
        models.checkpointed_layers(activation_checkpointing, dims["num_hidden_layers"])   # validates
    largest = largest_layer if largest_layer is not None else (zero_layout.largest_layer_params(dims) if dims else 0)

    d = DTYPE_BYTES[precision]
    mixed = precision != "fp32"
    state_bytes = optimizer_state_bytes(optimizer, layout, dims)        # Adam: 8 per parameter
    k = (4 if mixed else 0) + state_bytes / params                       # the paper's K (12 for Adam)
    paper = paper_model_states_bytes(params, stage, world, k=k, param_bytes=d, grad_bytes=d)
    ds = deepspeed_estimator(params, stage, gpus_per_node, nodes, largest, offload_optimizer, offload_param,
                             zero_init=zero_init, k=k)
    acts = _activations(dims, micro_batch, seq_len, activation_checkpointing, loss, kernels, d)
    args = dict(params=params, layout=layout, dims=dims, stage=stage, world=world, d=d, mixed=mixed,
                state_bytes=state_bytes, offload_optimizer=offload_optimizer, offload_param=offload_param,
                knobs=knobs, acts=acts)
    # FSDP2 reads its own block of the config: replicas, offload, reshard_after_forward
    fsdp_settings = fsdp.settings(resolved, world) if engine == "fsdp2" else None
    if fsdp_settings:
        phases, resident, host_rank, nvme_rank = peak.fsdp2(**args, settings=fsdp_settings,
                                                            accumulation=resolved["gradient_accumulation_steps"])
        # FSDP2's offload is its own block's (params, grads and states together); `inputs` stay estimate()'s
        # keyword arguments, so that advise(**est.inputs) re-runs the same estimate
        offload = "cpu" if fsdp_settings["offload"] == "cpu" else None
        inputs.update(offload_optimizer=offload, offload_param=offload)
    else:
        pinned = host_pinning == "torch" and bool((zero.get("offload_optimizer") or {}).get("pin_memory"))
        moment_sets = 1 if zenflow_moments == "labs" else 2
        phases, resident, host_rank, nvme_rank = peak.deepspeed(**args,
                                                                accumulation=resolved["gradient_accumulation_steps"],
                                                                pinned_rounding=pinned, zenflow=zero.get("zenflow"),
                                                                zenflow_columns=zenflow_columns,
                                                                zenflow_moment_sets=moment_sets)
    for p in phases.values():
        p["total"] = sum(p.values())
        for key in p:
            p[key] = int(p[key])
    peak_phase = max(phases, key=lambda name: phases[name]["total"])
    top = phases[peak_phase]
    notes = []
    if dims is None:
        notes.append("only a parameter count was given: activations, the loss and layer-sized buffers are 0")
    if host.overlaps_its_step(zero.get("zenflow")) and stage in (1, 2):
        sets = "one set" if zenflow_moments == "labs" else "two sets"
        notes.append("ZenFlow's overlapped step: the host figure counts the four fp32 buffers it shares with its "
                     f"optimizer process, that process's moments ({sets}) and the gradients kept between updates "
                     "(labs.memory.host)")
    elif zero.get("zenflow") and stage in (1, 2):
        notes.append("ZenFlow without its overlap: the host figure is plain offload's plus the gradients kept "
                     "between updates")
    elif zero.get("zenflow"):
        notes.append("ZenFlow at ZeRO-3: the host figure is plain offload's (ZenFlow's own buffers are not modelled)")
    if "liger" in (loss, kernels):
        notes.append("Liger's Triton kernels need a GPU")
    if engine == "fsdp2":
        notes.append("fsdp2 is approximated: fp32 sharded params/grads/Adam states over world / replicas ranks, "
                     "bf16 layers gathered one ahead, embedding and head gathered by the root; model_states_* are "
                     "DeepSpeed's numbers")
    breakdown = dict(activations=acts["parts"], loss=acts["loss_parts"], per_layer_bytes=acts["layer"],
                     checkpointed_layers=acts["checkpointed"], tokens_per_gpu=micro_batch * seq_len, knobs=knobs,
                     optimizer_state_bytes_per_param=state_bytes / params, k=k,
                     fsdp=fsdp_settings)
    est = MemoryEstimate(
        params=params, params_per_gpu_bytes=top["params"], grads_per_gpu_bytes=top["grads"],
        optimizer_per_gpu_bytes=top["optimizer"], activations_per_gpu_bytes=top["activations"],
        buffers_per_gpu_bytes=top["buffers"], total_per_gpu_bytes=top["total"],
        model_states_per_gpu_bytes=int(ds["gpu"]), paper_model_states_per_gpu_bytes=int(paper),
        host_per_node_bytes=int(host_rank * gpus_per_node), nvme_per_node_bytes=int(nvme_rank * gpus_per_node),
        peak_phase=peak_phase, phases=phases, resident_per_rank=resident, deepspeed_estimator=ds,
        breakdown=breakdown, inputs=inputs, notes=notes,
        init_falls_back=fit.init_falls_back(stage, precision, offload_optimizer, resolved.get("data_types"),
                                            "fsdp2" if fsdp_settings else "deepspeed"))
    notes.extend(filter(None, [fit.note(est)]))
    return est


def from_run(run, **overrides) -> MemoryEstimate:
    """The estimate for a labs run folder (a Run or its path): same model, ranks, config and flags."""
    run = run if isinstance(run, Run) else Run(run)
    spec = run.spec
    kwargs = dict(dims=spec["dims"], gpus_per_node=spec["nproc"], nodes=spec.get("nodes", {}).get("nnodes", 1),
                  seq_len=spec["seq_len"], loss=spec["loss"],
                  activation_checkpointing=spec["activation_checkpointing"], ds_config=run.ds_config,
                  engine=spec["engine"], kernels=spec.get("kernels", "stock"),
                  host_pinning=host_pinning_of(spec.get("device") == "cuda",
                                               run.environment.get("DS_PIN_MEMORY_BACKEND")))
    kwargs.update(overrides)
    return estimate(**kwargs)


# ------------------------------------------------------------------------------------------ helpers
def _resolved_config(ds_config, stage, world, dims, preset, micro_batch, grad_accum, precision) -> dict:
    """The DeepSpeed config this estimate describes, resolved by the resolver a run uses. The global batch does not
    matter to memory, so train_batch_size is always re-derived for this many GPUs; an explicit micro_batch or
    grad_accum wins over the file's (the calculator varies them)."""
    raw = resolve.default_config(stage) if ds_config is None else ds_config
    changes = {"train_batch_size": "auto"}
    if stage is not None:
        changes["zero_optimization.stage"] = stage
    if micro_batch is not None:
        changes["train_micro_batch_size_per_gpu"] = micro_batch
    if grad_accum is not None:
        changes["gradient_accumulation_steps"] = grad_accum
    raw = config_lib.variant(raw, changes)
    if config_lib.stage(raw) not in resolve.STAGE_FILES:
        raise LabsError(f"ZeRO stage must be 0, 1, 2 or 3, not {config_lib.stage(raw)}")
    return resolve.ds_config(raw, world_size=world, dims=dims, steps=100, on_gpu=True, preset=preset,
                             precision=precision)


def _count(params) -> int:
    try:
        count = float(params)
    except (TypeError, ValueError):
        raise LabsError(f"params '{params}' is not a number; write e.g. 7.5e9") from None
    if not count >= 1 or count == float("inf"):          # also refuses nan
        raise LabsError(f"params must be a positive, finite number, not {params!r}")
    return int(count)


def _offload(given, zero: dict, part: str):
    check_choice(f"offload_{part} device", given, OFFLOAD_DEVICES)
    if given is None:
        given = (zero.get(f"offload_{part}") or {}).get("device")
    return None if given in (None, "none") else given


def _activations(dims, micro_batch, seq_len, checkpointing, loss, kernels, d) -> dict:
    if dims is None:
        return dict(parts={}, loss_parts={}, saved=0, final_norm=0, layer=0, layer_input=0, temporaries=0, loss=0,
                    checkpointed=0, layers=0, head=0, layer_params=0)
    parts = act.activation_bytes(dims, micro_batch, seq_len, checkpointing, kernels, d)
    tokens = micro_batch * seq_len
    loss_parts = act.loss_bytes(dims, loss, micro_batch, seq_len, d)
    head = dims["vocab_size"] * dims["hidden_size"]
    layer_params = zero_layout.decoder_layer_params(dims)
    return dict(parts=parts, loss_parts=loss_parts,
                saved=parts["layers kept whole"] + parts["checkpointed layer inputs"] + parts["token ids"],
                final_norm=parts["final norm"], layer=act.layer_bytes_per_token(dims, kernels, d) * tokens,
                layer_input=act.checkpointed_layer_bytes_per_token(dims, d) * tokens,
                temporaries=act.backward_temporaries_bytes_per_token(dims, kernels, d) * tokens,
                loss=sum(loss_parts.values()), loss_kind=loss,
                checkpointed=models.checkpointed_layers(checkpointing, dims["num_hidden_layers"]),
                layers=dims["num_hidden_layers"], head=head, layer_params=layer_params)
