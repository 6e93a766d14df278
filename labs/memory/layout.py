"""How the parameters of a Qwen2 model sit in memory under DeepSpeed ZeRO: their order, the flat buffer
that ZeRO-1/2 slice into equal parts, and ZeRO-3's per-parameter partitions (stage_1_and_2.py, stage3.py)."""
from __future__ import annotations


def param_layout(dims: dict) -> list[tuple[str, int]]:
    """Qwen2ForCausalLM's parameters in registration order, which is the order DeepSpeed flattens them in
    (a tied lm_head is the embedding, listed once)."""
    h, f, vocab = dims["hidden_size"], dims["intermediate_size"], dims["vocab_size"]
    kv = h // dims["num_attention_heads"] * dims["num_key_value_heads"]
    layout = [("model.embed_tokens.weight", vocab * h)]
    for i in range(dims["num_hidden_layers"]):
        p = f"model.layers.{i}."
        layout += [(p + "self_attn.q_proj.weight", h * h), (p + "self_attn.q_proj.bias", h),
                   (p + "self_attn.k_proj.weight", kv * h), (p + "self_attn.k_proj.bias", kv),
                   (p + "self_attn.v_proj.weight", kv * h), (p + "self_attn.v_proj.bias", kv),
                   (p + "self_attn.o_proj.weight", h * h), (p + "mlp.gate_proj.weight", f * h),
                   (p + "mlp.up_proj.weight", f * h), (p + "mlp.down_proj.weight", h * f),
                   (p + "input_layernorm.weight", h), (p + "post_attention_layernorm.weight", h)]
    layout.append(("model.norm.weight", h))
    if not dims["tie_word_embeddings"]:
        layout.append(("lm_head.weight", vocab * h))
    return layout


def decoder_layer_params(dims: dict) -> int:
    """The parameters of one decoder layer (every layer is alike)."""
    return sum(n for name, n in param_layout(dims) if name.startswith("model.layers.0."))


def largest_layer_params(dims: dict) -> int:
    """DeepSpeed's `model_to_params`: the most parameters any one module owns directly (an embedding here)."""
    h, f, vocab = dims["hidden_size"], dims["intermediate_size"], dims["vocab_size"]
    return max(vocab * h, f * h, h * h + h)


def zero12_partition(params: int, world: int) -> int:
    """Elements of one rank's ZeRO-1/2 slice: the flat buffer padded to 2 * world elements, split evenly."""
    return -(-params // (2 * world)) * 2


def zero12_params_per_rank(layout, world: int) -> list[list[int]]:
    """Per rank, the element counts of the parameters that overlap its ZeRO-1/2 slice of the flat buffer
    (stage_1_and_2.py `params_in_partition`): a big embedding that straddles two slices belongs to both."""
    part = zero12_partition(sum(n for _, n in layout), world)
    per_rank, offset = [[] for _ in range(world)], 0
    for _, numel in layout:
        for r in range(offset // part, min(world, -(-(offset + numel) // part))):
            per_rank[r].append(numel)
        offset += numel
    return per_rank


def zero12_grad_elements(layout, world: int) -> list[int]:
    """ZeRO-1/2 keep, per rank, the gradient of every parameter that overlaps the rank's slice of the flat
    buffer, whole (stage_1_and_2.py `grads_in_partition` / `averaged_gradients`): a big embedding that
    straddles two slices is held whole by both ranks."""
    return [sum(numels) for numels in zero12_params_per_rank(layout, world)]


def zero3_partition(layout, world: int, persistence_threshold: float, sub_group_size: float) -> dict:
    """ZeRO-3 splits each parameter on its own (ceil(numel / world) per rank); parameters of at most
    `stage3_param_persistence_threshold` elements also stay whole on every rank. The optimizer steps in
    sub-groups of about `sub_group_size` partition elements: a parameter closes its sub-group once the sub-group holds
    that many, and the last parameter closes the last one (stage3.py `_create_fp16_sub_groups`), so no sub-group is
    empty. The count matters: partial offload keeps the first int((1 - ratio) x count) sub-groups on the GPU."""
    parts = [-(-n // world) for _, n in layout]
    groups, current = [], 0
    for p in parts:
        current += p
        if current >= sub_group_size:
            groups.append(current)
            current = 0
    if current or not groups:
        groups.append(current)
    return dict(partition=sum(parts), persistent=sum(n for _, n in layout if n <= persistence_threshold),
                largest_sub_group=max(groups), sub_groups=groups)


def zero3_gpu_sub_groups(z3: dict, knobs: dict) -> list[int]:
    """The optimizer sub-groups (elements) that ZeRO-3 steps on the GPU under partial offload: DeepSpeed 0.19.8
    (stage3.py, `subgroup_to_device`) keeps sub-group i on the GPU while i < int((1 - ratio) x sub-groups)."""
    groups = z3["sub_groups"]
    return groups[:int((1 - knobs["offload_ratio"]) * len(groups))]


def zero3_offloaded_share(dims: dict, ratio: float, sub_group_size: float, world: int = 1) -> float:
    """The share of the parameters whose optimizer state ZeRO-3 actually offloads at `offload_optimizer.ratio`: whole
    sub-groups, all but the first int((1 - ratio) x count), so the share moves in steps of a sub-group (on Qwen2.5-7B,
    ratio 0.65 of 5e8-element sub-groups offloads 71.4%, and 0.7 of DeepSpeed's default 1e9 offloads 73.2%)."""
    z3 = zero3_partition(param_layout(dims), world, 0, sub_group_size)
    return 1 - sum(zero3_gpu_sub_groups(z3, {"offload_ratio": ratio})) / z3["partition"]


def zenflow_selected_elements(dims: dict, topk_ratio: float) -> int:
    """Elements of the weights ZenFlow updates on the GPU between its full CPU updates: of each matrix
    ([out, in]) max(1, int(in x topk_ratio)) whole columns, and every vector (bias, norm) whole
    (runtime/zenflow/zenflow_stage_1_and_2.py `_num_selected_columns`). ZenFlow's GPU Adam keeps exp_avg and
    exp_avg_sq for them in the parameters' dtype (ops/adam/zenflow_torch_adam.py): at Qwen2.5-3B and ratio 0.1 the
    allocator record of round 15 (results/gpu/zenflow_1xh200/zf_alloc) holds 615,728,128 bytes for each, these
    elements x 2 bytes to the byte."""
    h, f = dims["hidden_size"], dims["intermediate_size"]
    selected = 0
    for name, numel in param_layout(dims):
        if name.endswith(".bias") or "norm" in name:
            selected += numel
        else:
            columns = f if "down_proj" in name else h          # every matrix reads the hidden size but down_proj
            selected += numel // columns * max(1, int(columns * topk_ratio))
    return selected
