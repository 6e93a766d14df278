"""Activation memory of the HF Qwen2 decoder, tensor by tensor, as autograd really saves it.

Every number here comes from reading `transformers/models/qwen2/modeling_qwen2.py` (the code labs trains)
and from listing what autograd keeps with `torch.autograd.graph.saved_tensors_hooks` on a real layer
(tests/test_activations.py does that listing and compares it with this module). Sizes are bytes per token
(one position of one sequence); multiply by micro_batch * seq_len.

Notation: h = hidden size, f = FFN width, Hq query heads, Hkv key/value heads, D = h / Hq head size,
kv = Hkv * D, d = bytes of the compute dtype (2 for bf16/fp16, 4 for fp32).

One decoder layer, stock HF code (SDPA attention; flash on GPU, its CPU twin on CPU):
- RMSNorm (x2 per layer) upcasts its input to fp32 first: `x.to(float32)` is saved by `pow` and by the
  multiply with `rsqrt` (one tensor, 4h), `rsqrt(variance)` is saved (4 bytes), the normalised value cast
  back to the input dtype is saved by `weight * x` (d*h), and its output is saved by the next Linear (d*h).
- Attention: q/k/v_proj share one input (the norm output above). SDPA saves q and k after RoPE, v, its
  output (which is also o_proj's input: flash writes it in the layout o_proj reads, so no copy) and the
  fp32 log-sum-exp per query head. With no padding mask transformers calls SDPA with `enable_gqa=True`,
  so k and v keep their Hkv heads (not repeated to Hq).
- SwiGLU MLP: gate output (saved by silu), silu output and up output (saved by the product), and the
  product (saved by down_proj): four tensors of d*f.
Residual adds and RoPE's cos/sin save nothing per layer (cos/sin are computed once for the model).

Liger kernels (`kernels="liger"`): LigerRMSNorm saves its input X (d*h) and rstd (4 bytes) instead of the
fp32 upcast + cast; LigerSiLUMul saves gate and up outputs and recomputes silu in backward (3 tensors of
d*f counting down_proj's input). Liger's RoPE saves only cos/sin: no change.
"""
from __future__ import annotations

from labs.errors import check_choice
from labs.models import CHUNK_TOKENS, KERNELS, LOSSES, checkpointed_layers


def _sizes(dims: dict) -> tuple[int, int, int, int, int]:
    h, f = dims["hidden_size"], dims["intermediate_size"]
    heads, kv_heads = dims["num_attention_heads"], dims["num_key_value_heads"]
    return h, f, heads, h // heads * kv_heads, dims["vocab_size"]


def layer_saved_tensors(dims: dict, kernels: str = "stock", dtype_bytes: int = 2) -> dict[str, int]:
    """Bytes per token of each tensor one Qwen2DecoderLayer keeps for backward, named by who saves it."""
    check_choice("kernels", kernels, KERNELS)
    h, f, heads, kv, _ = _sizes(dims)
    d = dtype_bytes
    saved = {}
    for norm in ("input_layernorm", "post_attention_layernorm"):
        if kernels == "stock":
            saved[f"{norm}: input upcast to fp32 (pow, mul)"] = 4 * h
            saved[f"{norm}: rsqrt(variance) fp32"] = 4
            saved[f"{norm}: normalised, cast back (weight * x)"] = d * h
        else:
            saved[f"{norm}: input X (LigerRMSNorm)"] = d * h
            saved[f"{norm}: rstd fp32 (LigerRMSNorm)"] = 4
        consumer = "q/k/v_proj input" if norm == "input_layernorm" else "gate/up_proj input"
        saved[f"{norm}: output = {consumer}"] = d * h
        if norm == "input_layernorm":
            saved["sdpa: query after RoPE"] = d * h
            saved["sdpa: key after RoPE (kv heads only)"] = d * kv
            saved["sdpa: value (kv heads only)"] = d * kv
            saved["sdpa: output = o_proj input"] = d * h
            saved["sdpa: log-sum-exp fp32"] = 4 * heads
    saved["mlp: gate_proj output"] = d * f
    if kernels == "stock":
        saved["mlp: silu output"] = d * f
    saved["mlp: up_proj output"] = d * f
    saved["mlp: silu(gate) * up = down_proj input"] = d * f
    return saved


def layer_bytes_per_token(dims: dict, kernels: str = "stock", dtype_bytes: int = 2) -> int:
    """Stock bf16: 20h + 4kv + 8f + 4Hq + 8 bytes per token (Qwen2.5-7B: 225,400 B, 1.85 GB per 8k tokens)."""
    return sum(layer_saved_tensors(dims, kernels, dtype_bytes).values())


def final_norm_bytes_per_token(dims: dict, kernels: str = "stock", dtype_bytes: int = 2) -> int:
    """The model's last RMSNorm: as a layer norm above, its output kept by lm_head (or by the loss)."""
    h = dims["hidden_size"]
    if kernels == "stock":
        return 4 * h + 4 + 2 * dtype_bytes * h
    return 2 * dtype_bytes * h + 4


def backward_temporaries_bytes_per_token(dims: dict, kernels: str = "stock", dtype_bytes: int = 2) -> int:
    """Gradients alive inside one layer's backward (beyond what is saved): the MLP's backward holds the grad
    of down_proj's input and, from the product's backward, the grads of silu output and of up output (3 d*f;
    Liger's SwiGLU writes its grads in place: 1 d*f), plus the residual stream's grad and one more d*h."""
    h, f = dims["hidden_size"], dims["intermediate_size"]
    return (3 if kernels == "stock" else 1) * dtype_bytes * f + 2 * dtype_bytes * h


def checkpointed_layer_bytes_per_token(dims: dict, dtype_bytes: int = 2) -> int:
    """A layer under (non-reentrant) activation checkpointing keeps only its input hidden states."""
    return dtype_bytes * dims["hidden_size"]


def loss_bytes(dims: dict, loss: str, micro_batch: int, seq_len: int, dtype_bytes: int = 2) -> dict[str, int]:
    """What the loss holds at its worst moment, by the loss implementation (labs.models.CausalLM).

    - 'hf' (stock): lm_head makes [tokens, vocab] logits, ForCausalLMLoss upcasts them to fp32 and
      cross_entropy runs log_softmax (its fp32 output is saved) + nll_loss over all micro_batch*seq_len
      positions (labels are padded, not cut). Worst moment: log_softmax's backward, where its saved output,
      the incoming grad (from nll_loss) and the grad it returns are three fp32 [tokens, vocab] tensors:
      12 * tokens * vocab bytes (Qwen2.5-7B, 8192 tokens: 14.9 GB). Forward peaks lower (bf16 logits +
      fp32 copy + log_softmax output = 10 bytes per logit).
    - 'chunked': the same three fp32 tensors but for one chunk of 4096 tokens at a time (recomputed in
      backward under checkpointing), plus the flattened hidden states it saves (d*h per token).
    - 'liger': fused linear cross-entropy never makes full logits. It computes in forward, and keeps until
      backward, the grad of the hidden states ([tokens, h]) and of the head weight ([vocab, h], in the
      weight's dtype, full size even under ZeRO-3); logits exist only for a chunk of
      next_pow2(tokens / ceil(vocab / h)) rows.
    """
    check_choice("loss", loss, LOSSES)
    h, _, _, _, vocab = _sizes(dims)
    tokens, shifted = micro_batch * seq_len, micro_batch * (seq_len - 1)
    if loss == "hf":
        return {"fp32 log-softmax output + its grad + grad of logits": 12 * tokens * vocab}
    if loss == "chunked":
        chunk = min(CHUNK_TOKENS, shifted)
        return {"flattened hidden states (checkpoint input)": dtype_bytes * h * shifted,
                "one chunk: fp32 log-softmax output + its grad + grad of logits": 12 * chunk * vocab}
    chunk = min(_next_pow2(-(-shifted // -(-vocab // h))), shifted)
    return {"grad of hidden states (computed in forward)": dtype_bytes * h * shifted,
            "grad of lm_head weight (computed in forward)": dtype_bytes * vocab * h,
            "one chunk of logits": dtype_bytes * chunk * vocab}


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def activation_bytes(dims: dict, micro_batch: int, seq_len: int, checkpointing="none", kernels="stock",
                     dtype_bytes: int = 2) -> dict[str, int]:
    """Saved activations of the whole decoder at the end of forward (the loss excluded), per part."""
    tokens = micro_batch * seq_len
    layers = dims["num_hidden_layers"]
    kept = checkpointed_layers(checkpointing, layers)
    return {"layers kept whole": (layers - kept) * layer_bytes_per_token(dims, kernels, dtype_bytes) * tokens,
            "checkpointed layer inputs": kept * checkpointed_layer_bytes_per_token(dims, dtype_bytes) * tokens,
            "final norm": final_norm_bytes_per_token(dims, kernels, dtype_bytes) * tokens,
            "token ids": 8 * tokens}


def measure_saved(dims: dict, micro_batch: int, seq_len: int, device="cpu", dtype_bytes: int = 2) -> dict:
    """Build the HF Qwen2 model for `dims` (use few layers: every layer is alike) on `device`, run one stock
    forward + loss, and add up every storage autograd keeps for backward (parameters excluded), next to what
    this module predicts for the same run. On a GPU host this checks the CUDA kernels' choices (flash SDPA,
    GQA without repeated k/v) in seconds, without DeepSpeed."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    dtype = {2: torch.bfloat16, 4: torch.float32}[dtype_bytes]
    torch.manual_seed(0)
    config = Qwen2Config(**dims, use_cache=False, attention_dropout=0.0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa").to(device)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    ids = torch.randint(0, dims["vocab_size"], (micro_batch, seq_len), device=device)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, labels=ids).loss
    tokens = micro_batch * seq_len
    head_dim = dims["hidden_size"] // dims["num_attention_heads"]
    predicted = (sum(activation_bytes(dims, micro_batch, seq_len, "none", "stock", dtype_bytes).values())
                 + 4 * tokens * dims["vocab_size"]       # log_softmax's fp32 output, saved for its backward
                 + 8 * (tokens + (micro_batch == 1)) + 4   # int64 targets (labels padded by one, a view when
                                                           # micro_batch is 1, else a copy), total weight
                 + 2 * seq_len * head_dim * dtype_bytes)   # RoPE cos and sin, shared by every layer
    return dict(measured_bytes=sum(saved.values()), predicted_bytes=predicted, device=str(device))
