"""labs.activations against what autograd really saves in the HF Qwen2 model (saved-tensor hooks, CPU)."""
import pytest

from labs import models
from labs.memory import activations as act

DIMS = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=320, vocab_size=1000, tie_word_embeddings=False)


@pytest.mark.parametrize("dtype_bytes,micro_batch", [(2, 2), (4, 2), (2, 1)])
def test_saved_tensors_match_the_per_tensor_account(dtype_bytes, micro_batch):
    """Every storage autograd keeps in one stock forward + loss (bf16 and fp32), to the byte."""
    result = act.measure_saved(DIMS, micro_batch=micro_batch, seq_len=48, dtype_bytes=dtype_bytes)
    assert result["measured_bytes"] == result["predicted_bytes"]


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
