"""Model presets on the Qwen2 architecture, built at random or loaded from a local folder, plus the
training wrapper that computes the loss (stock HF, or chunked / fused so fp32 logits never fill memory)."""
from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from labs.errors import LabsError, check_choice

# Dimensions only. `tiny` keeps Qwen's real vocabulary (the real tokenizer emits ids up to 151,850), so
# its embedding dominates: 9.7 M of its 9.9 M parameters. That is also true in spirit of the 7B models,
# whose embeddings and head are 1.1-1.2 B parameters each.
PRESETS: dict[str, dict] = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=192, vocab_size=151936, tie_word_embeddings=True,
                 max_position_embeddings=2048),
    # Qwen-7B (the first Qwen release) has full multi-head attention and FFN width 11008.
    "qwen-7b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                    intermediate_size=11008, vocab_size=151936, tie_word_embeddings=False,
                    max_position_embeddings=32768),
    # Qwen2.5-3B: the size a 24 GB card can hold with offload; on one H200 its optimizer step on the CPU costs what a
    # 7B's does per parameter, with host memory to spare (a 7B's offloaded state does not fit a 128 GiB host).
    "qwen2.5-3b": dict(hidden_size=2048, num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2,
                       intermediate_size=11008, vocab_size=151936, tie_word_embeddings=True,
                       max_position_embeddings=32768),
    # Qwen2.5-7B: grouped-query attention (28 query heads share 4 key/value heads).
    "qwen2.5-7b": dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                       intermediate_size=18944, vocab_size=152064, tie_word_embeddings=False,
                       max_position_embeddings=32768),
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def check_preset(name: str) -> str:
    return check_choice("preset", name, PRESETS)


def check_model_path(path) -> Path:
    path = Path(path)
    if not (path / "config.json").is_file():
        what = "does not exist" if not path.exists() else "has no config.json"
        raise LabsError(f"--model-path '{path}' {what}; point it at a local Hugging Face model folder "
                        "(config.json + *.safetensors); nothing is downloaded")
    return path


def qwen2_config(preset: str):
    from transformers import Qwen2Config

    return Qwen2Config(**PRESETS[check_preset(preset)], rms_norm_eps=1e-6, attention_dropout=0.0,
                       use_cache=False)


def shape(preset_or_config) -> dict:
    """The dimensions the memory and FLOP formulas need, from a preset name or an HF config."""
    cfg = PRESETS[check_preset(preset_or_config)] if isinstance(preset_or_config, str) else \
        preset_or_config.to_dict()
    return {k: cfg[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                                "intermediate_size", "vocab_size", "tie_word_embeddings", "max_position_embeddings")}


def param_counts(dims: dict) -> dict:
    """Parameter counts by part, from dimensions alone (Qwen2: q/k/v have biases, RMSNorm has a weight)."""
    h, ffn, vocab, layers = dims["hidden_size"], dims["intermediate_size"], dims["vocab_size"], \
        dims["num_hidden_layers"]
    kv = h // dims["num_attention_heads"] * dims["num_key_value_heads"]
    attention = h * h + 2 * h * kv + (h + 2 * kv) + h * h     # q, k, v weights; their biases; o_proj
    mlp = 3 * h * ffn                                          # gate, up, down
    per_layer = attention + mlp + 2 * h                        # + two RMSNorm weights
    embedding = vocab * h
    head = 0 if dims["tie_word_embeddings"] else vocab * h
    total = embedding + layers * per_layer + h + head          # + final norm
    return dict(total=total, embedding=embedding, lm_head=head, per_layer=per_layer,
                non_embedding=total - embedding - head)


def decoder_layer_granularity(dims: dict) -> int:
    """DeepSpeed's 'granularity' of one Qwen2 decoder layer: its parameters over the modules it counts (the layer,
    attention with q/k/v/o, MLP with gate/up/down, two norms: 12). A `stage3_module_granularity_threshold` equal to
    it makes ZeRO-3 fetch each decoder layer as one unit (one hook pair per layer instead of twelve)."""
    return param_counts(dims)["per_layer"] // 12


def flops_per_token(dims: dict, seq_len: int, causal: bool = False) -> float:
    """Training FLOPs per token: 6 per weight that multiplies (every weight except the input embedding
    lookup; the output projection counts even when tied) plus attention scores and values,
    12 * layers * hidden * seq over the full attention matrix (the convention of the shared reference figures and of
    most MFU tables), or 6 * layers * hidden * seq with `causal=True`: only the lower triangle, which is what causal
    attention kernels compute. Recomputation is not counted: model FLOPs, not hardware FLOPs."""
    counts = param_counts(dims)
    matmul_weights = counts["non_embedding"] + dims["vocab_size"] * dims["hidden_size"]
    attention = (6 if causal else 12) * dims["num_hidden_layers"] * dims["hidden_size"] * seq_len
    return 6 * matmul_weights + attention


# ---------------------------------------------------------------------------------------------- building
_hf_ds_config = None  # HF finds the DeepSpeed config through a live HfDeepSpeedConfig object


KERNELS = ("stock", "liger")


def use_kernels(kernels: str):
    """'liger': swap HF Qwen2's RMSNorm, SwiGLU MLP and rotary embedding for Liger Kernel's Triton versions
    (patched into the modeling module, so call before building). Fewer kernel launches, and the fused
    RMSNorm / SwiGLU save fewer activations for backward."""
    if check_choice("kernels", kernels, KERNELS) == "liger":
        from liger_kernel.transformers import apply_liger_kernel_to_qwen2

        apply_liger_kernel_to_qwen2(rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                    fused_linear_cross_entropy=False)


ATTENTION = ("default", "cudnn", "flash", "efficient")


def use_attention(backend: str):
    """Which kernel SDPA may use on a GPU: 'default' lets PyTorch choose (flash on Hopper for bf16), the others allow
    only that one (cuDNN's fused attention, FlashAttention-2, memory-efficient attention). No effect on a CPU."""
    check_choice("attention backend", backend, ATTENTION)
    if backend != "default" and torch.cuda.is_available():
        for name in ("cudnn", "flash", "efficient"):
            getattr(torch.backends.cuda, f"enable_{name if name != 'efficient' else 'mem_efficient'}_sdp")(
                name == backend)
        torch.backends.cuda.enable_math_sdp(False)


def compile_layers(model) -> int:
    """torch.compile each decoder layer in place (the unit DeepSpeed ZeRO-3 and FSDP2 gather): fused elementwise
    work, fewer kernel launches. Returns how many layers."""
    layers = decoder_layers(model)
    for layer in layers:
        layer.compile()
    return len(layers)


def build(preset: str, *, dtype: torch.dtype, device: torch.device, seed: int = 0, model_path=None,
          zero3_config: dict | None = None):
    """The HF Qwen2ForCausalLM for a run, the one way every engine gets its model. With `zero3_config` (a resolved
    ZeRO-3 DeepSpeed config) it is created inside `deepspeed.zero.Init` through HF's integration, so each rank only
    ever holds its own shard: a 7B model never materialises whole. Otherwise it is created on `device` in `dtype`
    (FSDP2 asks for fp32 and shards it afterwards). One seed gives the same weights either way."""
    global _hf_ds_config
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    if zero3_config is not None:
        from transformers.integrations import HfDeepSpeedConfig

        _hf_ds_config = HfDeepSpeedConfig(zero3_config)
        if model_path:
            return AutoModelForCausalLM.from_pretrained(check_model_path(model_path), dtype=dtype,
                                                        attn_implementation="sdpa")
        return AutoModelForCausalLM.from_config(qwen2_config(preset), dtype=dtype, attn_implementation="sdpa")
    if model_path:
        return AutoModelForCausalLM.from_pretrained(check_model_path(model_path), dtype=dtype,
                                                    attn_implementation="sdpa").to(device)
    # Initialise the way HF does under ZeRO-3 (skip torch's default init, then the model's own init in the
    # same module order), so one seed gives the same weights at every ZeRO stage and under FSDP2.
    with torch.device(device), _no_init_weights():
        model = AutoModelForCausalLM.from_config(qwen2_config(preset), dtype=dtype, attn_implementation="sdpa")
    model.init_weights()
    return model


def _no_init_weights():
    try:
        from transformers.initialization import no_init_weights
    except ImportError:          # transformers 4.x
        from transformers.modeling_utils import no_init_weights
    return no_init_weights()


def decoder_layers(model) -> nn.ModuleList:
    return model.model.layers


def hf_checkpointing(model) -> None:
    """HF's own activation checkpointing (non-reentrant), as a user writes it: the stock reference's. transformers 5
    renamed gradient_checkpointing_enable to activation_checkpointing_enable (the old name warns, and goes in v6);
    an older transformers, as on the GPU hosts, has only the old one."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def hf_checkpointing_on(model) -> bool:
    """Whether HF's own activation checkpointing is on, read by the name the installed transformers offers (the
    GPU hosts' older transformers has only `is_gradient_checkpointing`, which newer ones keep as a warning alias)."""
    name = "is_activation_checkpointing" if hasattr(type(model), "is_activation_checkpointing") else \
        "is_gradient_checkpointing"
    return bool(getattr(model, name, False))


def checkpointed_layers(how, num_layers: int) -> int:
    """How many decoder layers activation checkpointing covers: 'none' -> 0, 'full' -> all, a number k (int or
    string) -> the first k. The one parser of the setting: training, the memory model and the advisor use it."""
    if how in (None, "none"):
        return 0
    if how == "full":
        return num_layers
    if isinstance(how, bool) or not str(how).isdigit() or int(how) > num_layers:
        raise LabsError(f"activation checkpointing '{how}': use none, full, or a number of layers from 0 to "
                        f"{num_layers}")
    return int(how)


def checkpoint_layers(model, how) -> int:
    """Activation checkpointing on decoder layers: 'none', 'full' (every layer) or a number k (the first k
    layers: selective checkpointing, spend memory on the rest to skip their recompute). Each chosen
    layer keeps only its input and recomputes its forward during backward. Returns how many layers."""
    layers = decoder_layers(model)
    count = checkpointed_layers(how, len(layers))
    for layer in list(layers)[:count]:
        forward = layer.forward

        def checkpointed(*args, _forward=forward, **kwargs):
            # Non-reentrant: works with keyword arguments and with ZeRO-3's module hooks, which stay outside.
            return checkpoint(_forward, *args, use_reentrant=False, **kwargs)

        layer.forward = checkpointed
    return count


# ---------------------------------------------------------------------------------------------- the loss
LOSSES = ("hf", "chunked", "liger")
CHUNK_TOKENS = 4096      # loss="chunked": logits made and dropped this many tokens at a time


class CausalLM(nn.Module):
    """Wraps the HF model so the loss is ours to choose.
    - 'hf': the stock path, `model(input_ids, labels=...)`: the full [tokens, vocab] logits are made in the
      compute dtype and upcast to fp32 for the loss (Qwen2.5-7B, 8k tokens: 1.25 G logits, ~7.5 GB).
    - 'chunked': plain PyTorch; logits are made and dropped chunk by chunk, recomputed in backward.
    - 'liger': Liger Kernel's fused linear cross-entropy (Triton, GPU): never materialises logits and
      computes the head's gradient during forward.
    The head weight is used outside `lm_head.forward` by the last two, so under ZeRO-3 it is registered as
    an external parameter of this module: DeepSpeed then gathers it for our forward and reduces its grad."""

    def __init__(self, hf_model, loss: str = "hf", chunk_tokens: int = CHUNK_TOKENS):
        super().__init__()
        check_choice("loss", loss, LOSSES)
        self.hf, self.loss, self.chunk_tokens = hf_model, loss, chunk_tokens
        weight = hf_model.lm_head.weight
        if loss != "hf" and hasattr(weight, "ds_id"):
            import deepspeed

            deepspeed.zero.register_external_parameter(self, weight)
        if loss == "liger":
            from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

            self.liger_loss = LigerFusedLinearCrossEntropyLoss()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.loss == "hf":
            return self.hf(input_ids=input_ids, labels=input_ids).loss
        hidden = self.hf.model(input_ids=input_ids).last_hidden_state[:, :-1].flatten(0, 1)
        targets = input_ids[:, 1:].flatten()
        weight = self.hf.lm_head.weight
        if self.loss == "liger":
            return self.liger_loss(weight, hidden, targets)
        total = hidden.new_zeros((), dtype=torch.float32)
        for start in range(0, targets.numel(), self.chunk_tokens):
            part = slice(start, start + self.chunk_tokens)
            total = total + checkpoint(_summed_ce, hidden[part], weight, targets[part], use_reentrant=False)
        return total / targets.numel()


def _summed_ce(hidden, weight, targets):
    logits = (hidden @ weight.t()).float()
    return nn.functional.cross_entropy(logits, targets, reduction="sum")


def expected_initial_loss(vocab_size: int) -> float:
    """A freshly initialised model predicts nearly uniformly: loss about ln(vocab)."""
    return math.log(vocab_size)
