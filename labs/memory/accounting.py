"""Model states by the book: the ZeRO paper's accounting and DeepSpeed's own estimators, term by term.

- `paper_model_states_bytes`: Rajbhandari et al. (2019), Table 1: fp16 params 2 Psi, fp16 grads 2 Psi, K Psi of
  optimizer states (K = 12 for mixed-precision Adam: fp32 master, momentum, variance), divided by N_d for the parts
  each stage partitions.
- `deepspeed_estimator`: what `estimate_zero2_model_states_mem_needs` / `estimate_zero3_model_states_mem_needs`
  return. They add what the paper leaves out: the fp32 copy of the gradient partition made inside the optimizer
  step (4 bytes, so 18 instead of 14 per partitioned parameter at ZeRO-2) and, at ZeRO-3, the largest layer
  gathered whole with its gradient (4 bytes per parameter of that layer).
"""
from __future__ import annotations

from decimal import ROUND_HALF_UP, Decimal

OPTIMIZERS = {"adamw": 8, "adam": 8, "adamw8bit": 2, "adafactor": None, "lion": 4, "sgd": 4}  # state bytes/param

# Published reference values, typed as printed, not computed: Rajbhandari et al. 2019, "ZeRO: Memory Optimizations
# Toward Training Trillion Parameter Models" (arXiv:1910.02054), Table 1: model-state memory per device in GB (10^9
# bytes), K = 12, for Psi = 7.5e9, 128e9 and 1e12 parameters and the data-parallel degrees N_d of PAPER_TABLE1_ND; by
# stage, 1 = P_os, 2 = P_os+g, 3 = P_os+g+p. `paper_model_states_bytes` reproduces them (tests/test_memory.py: the 7.5B
# column rounded half-up, the larger ones truncated).
PAPER_TABLE1_ND = (1, 4, 16, 64, 256, 1024)
PAPER_TABLE1 = {
    7.5e9: {1: ("120", "52.5", "35.6", "31.4", "30.4", "30.1"),
            2: ("120", "41.3", "21.6", "16.6", "15.4", "15.1"),
            3: ("120", "30", "7.5", "1.88", "0.47", "0.12")},
    128e9: {1: ("2048", "896", "608", "536", "518", "513"),
            2: ("2048", "704", "368", "284", "263", "257"),
            3: ("2048", "512", "128", "32", "8", "2")},
    1e12: {1: ("16000", "7000", "4750", "4187", "4046", "4011"),
           2: ("16000", "5500", "2875", "2218", "2054", "2013"),
           3: ("16000", "4000", "1000", "250", "62.5", "15.6")},
}


def paper_model_states_bytes(params, stage: int, world: int, k: float = 12, param_bytes=2, grad_bytes=2) -> float:
    """ZeRO paper, section 5: model states per device. Baseline (stage 0) (2 + 2 + K) Psi; P_os (stage 1)
    (2 + 2) Psi + K Psi / N_d; P_os+g (stage 2) 2 Psi + (2 + K) Psi / N_d; P_os+g+p (stage 3)
    (2 + 2 + K) Psi / N_d. No offload: the paper keeps everything on the device."""
    psi, n = params, world
    p, g = param_bytes * psi, grad_bytes * psi
    return {0: p + g + k * psi, 1: p + g + k * psi / n, 2: p + (g + k * psi) / n, 3: (p + g + k * psi) / n}[stage]


def paper_table1_rows() -> list[dict]:
    """Table 1's 7.5B columns, by N_d: `paper_model_states_bytes` in GB beside the paper's printed value ("... paper"),
    and whether ours, rounded as the paper prints it (half up, to its last printed digit), is that value
    ("... agrees")."""
    rows = []
    for i, nd in enumerate(PAPER_TABLE1_ND):
        row = dict(N_d=nd, baseline=paper_model_states_bytes(7.5e9, 0, nd) / 1e9)
        for stage, name in ((1, "P_os"), (2, "P_os+g"), (3, "P_os+g+p")):
            ours, printed = paper_model_states_bytes(7.5e9, stage, nd) / 1e9, PAPER_TABLE1[7.5e9][stage][i]
            rounded = Decimal(repr(ours)).quantize(Decimal(printed), rounding=ROUND_HALF_UP)
            row.update({name: ours, f"{name} paper": printed, f"{name} agrees": rounded == Decimal(printed)})
        rows.append(row)
    return rows


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


def optimizer_state_bytes(optimizer: str, layout, dims) -> float:
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
