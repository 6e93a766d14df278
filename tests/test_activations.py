"""labs.activations against what autograd really saves in the HF Qwen2 model (saved-tensor hooks, CPU)."""
import pytest
import torch

from labs import activations as act
from labs import models

DIMS = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=320, vocab_size=1000, tie_word_embeddings=False)


def _saved_bytes(model, input_ids):
    """Every storage autograd keeps for backward during one stock forward + loss, parameters excluded."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=input_ids, labels=input_ids).loss
    return sum(saved.values()), loss


@pytest.mark.parametrize("dtype,dtype_bytes", [(torch.bfloat16, 2), (torch.float32, 4)])
def test_saved_tensors_match_the_per_tensor_account(dtype, dtype_bytes):
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    config = Qwen2Config(**DIMS, use_cache=False, attention_dropout=0.0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    batch, seq = 2, 48
    measured, _ = _saved_bytes(model, torch.randint(0, DIMS["vocab_size"], (batch, seq)))
    tokens = batch * seq
    head_dim = DIMS["hidden_size"] // DIMS["num_attention_heads"]
    parts = act.activation_bytes(DIMS, batch, seq, "none", "stock", dtype_bytes)
    expected = (sum(parts.values())                          # layers, final norm, token ids
                + 4 * tokens * DIMS["vocab_size"]              # log_softmax's fp32 output (saved by its backward)
                + 8 * tokens + 4                               # cross-entropy's int64 targets, its total weight
                + 2 * seq * head_dim * dtype_bytes)            # RoPE cos and sin, shared by all layers
    assert measured == expected


def test_layer_formula_for_qwen2p5_7b():
    """20h + 4kv + 8f + 4Hq + 8 bytes per token in bf16: 225,400 B for Qwen2.5-7B (h 3584, kv 512, f 18944)."""
    dims = models.shape("qwen2.5-7b")
    assert act.layer_bytes_per_token(dims) == 20 * 3584 + 4 * 512 + 8 * 18944 + 4 * 28 + 8 == 225_400
    assert act.layer_bytes_per_token(dims, kernels="liger") == 12 * 3584 + 4 * 512 + 6 * 18944 + 4 * 28 + 8


def test_checkpointing_keeps_one_input_per_layer_and_liger_loss_is_small():
    dims = models.shape("qwen2.5-7b")
    full = act.activation_bytes(dims, 2, 4096, "full")
    assert full["layers kept whole"] == 0 and full["checkpointed layer inputs"] == 28 * 2 * 3584 * 8192
    liger = act.loss_bytes(dims, "liger", 2, 4096)
    assert sum(liger.values()) < act.loss_bytes(dims, "hf", 2, 4096)["fp32 log-softmax output + its grad + grad of logits"] / 5
