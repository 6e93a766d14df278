"""Activation checkpointing, measured: what a checkpointed layer stops keeping for backward, and what recomputing
it costs, on real HF Qwen2 layers (chapter 5), next to labs.memory's numbers for Qwen-7B.

    rows = recompute.measured_rows(recompute.stacked_dims("tiny", 8), micro_batch=2, seq_len=256)
    recompute.hf_switch_rows(...)      # config.gradient_checkpointing vs model.activation_checkpointing_enable()
    recompute.qwen7b_rows("qwen-7b", micro_batch=1, seq_len=4096, gpus=8)

Bytes are counted as autograd keeps them (`torch.autograd.graph.saved_tensors_hooks`, every storage once,
parameters excluded), FLOPs with `torch.utils.flop_counter.FlopCounterMode` over forward and backward. The CPU's
SDPA kernel has no FLOP formula in torch; it is given the one torch uses for the GPU kernels (no causal discount,
as labs.models.flops_per_token), so attention is counted too.
"""
from __future__ import annotations

import torch
from torch.utils import flop_counter

from labs import memory, models
from labs.memory import activations as act



def _as_registered(op):
    """torch's registered FLOP formula of `op`, usable as a custom mapping (it already reads shapes)."""
    def formula(*args, **kwargs):
        return flop_counter.flop_registry[op](*args, **kwargs)

    formula._get_raw = True
    return formula


aten = torch.ops.aten
SDPA_CPU = {aten._scaled_dot_product_flash_attention_for_cpu: _as_registered(aten._scaled_dot_product_flash_attention),
            aten._scaled_dot_product_flash_attention_for_cpu_backward:
                _as_registered(aten._scaled_dot_product_flash_attention_backward)}


def stacked_dims(preset="tiny", layers=8) -> dict:
    """A preset's layer shape, `layers` deep: the tiny model has 2 layers, too few to draw a curve."""
    return {**models.shape(preset), "num_hidden_layers": layers}


def build(dims: dict, dtype=torch.bfloat16, seed=0, **config):
    """The HF Qwen2 model for `dims`, in training mode (`config`: extra Qwen2Config keys)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(seed)
    hf_config = Qwen2Config(**dims, use_cache=False, attention_dropout=0.0, **config)
    return AutoModelForCausalLM.from_config(hf_config, dtype=dtype, attn_implementation="sdpa").train()


def measure(model, micro_batch: int, seq_len: int, seed=0) -> dict:
    """One forward and backward of the decoder (the loss left out: a plain sum of the last hidden states, which
    saves nothing): the bytes autograd keeps at the end of forward and the FLOPs of forward and of the whole step."""
    torch.manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (micro_batch, seq_len))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            kept[storage.data_ptr()] = storage.nbytes()
        return tensor

    with flop_counter.FlopCounterMode(display=False, custom_mapping=SDPA_CPU) as counter:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            hidden = model.model(input_ids=ids).last_hidden_state
        forward = counter.get_total_flops()
        hidden.float().sum().backward()
    return dict(saved_bytes=sum(kept.values()), forward_flops=forward, step_flops=counter.get_total_flops(),
                checkpointing=models.hf_checkpointing_on(model))


def predicted_bytes(dims: dict, micro_batch: int, seq_len: int, layers, dtype_bytes=2) -> int:
    """labs.memory.activations for the same decoder-only step: its parts, less what the head would keep (the final
    norm's output, kept by lm_head), plus RoPE's cos and sin, computed once and kept while any layer keeps its
    attention (every checkpointed layer recomputes them from its inputs)."""
    tokens = micro_batch * seq_len
    parts = act.activation_bytes(dims, micro_batch, seq_len, layers, "stock", dtype_bytes)
    head = dims["hidden_size"] // dims["num_attention_heads"]
    kept_whole = dims["num_hidden_layers"] - models.checkpointed_layers(layers, dims["num_hidden_layers"])
    rope = 2 * seq_len * head * dtype_bytes if kept_whole else 0
    return sum(parts.values()) - dtype_bytes * dims["hidden_size"] * tokens + rope


# The chapter's FLOP convention, for the tiny layers and the 7B model alike: labs.models.flops_per_token (6 FLOPs per
# weight per token, 2 forward and 4 backward; the input embedding not counted; attention over the full score
# matrix, 12 x layers x hidden x seq, no causal discount), with the output layer (lm_head, 6 x vocab x hidden per
# token) counted in the whole step and left out of the decoder's.
def head_flops_per_token(dims: dict) -> int:
    """The output layer's training FLOPs per token: one [hidden, vocab] matmul, forward and backward."""
    return 6 * dims["vocab_size"] * dims["hidden_size"]


def decoder_flops_per_token(dims: dict, seq_len: int) -> float:
    """The decoder layers' training FLOPs per token (the whole step less the output layer): what measure() counts."""
    return models.flops_per_token(dims, seq_len) - head_flops_per_token(dims)


def recompute_flops_per_token(dims: dict, seq_len: int) -> int:
    """FLOPs one checkpointed layer adds per token: its forward again, counted as labs.models.flops_per_token
    counts it (2 per weight, 4 h s of attention), less the last matmul (down_proj): torch's non-reentrant
    checkpoint stops recomputing once the tensors backward needs are back, and nothing needs down_proj's output."""
    h = dims["hidden_size"]
    return 2 * models.param_counts(dims)["per_layer"] + 4 * h * seq_len - 2 * h * dims["intermediate_size"]


def measured_rows(dims: dict, micro_batch: int, seq_len: int, ks=None) -> list[dict]:
    """For k = 0 .. all layers checkpointed (labs checkpoints the first k): measured bytes and FLOPs, and
    labs' predictions of both."""
    rows = []
    layers = dims["num_hidden_layers"]
    for k in ks if ks is not None else range(layers + 1):
        model = build(dims)
        models.checkpoint_layers(model, k)
        found = measure(model, micro_batch, seq_len)
        rows.append(dict(k=k, saved_bytes=found["saved_bytes"],
                         predicted_bytes=predicted_bytes(dims, micro_batch, seq_len, k),
                         step_flops=found["step_flops"], forward_flops=found["forward_flops"]))
    base = rows[0]["step_flops"]
    for row in rows:
        row["recompute_flops"] = row["step_flops"] - base
        row["predicted_recompute_flops"] = row["k"] * recompute_flops_per_token(dims, seq_len) * micro_batch * seq_len
        row["saved_fraction"] = row["saved_bytes"] / rows[0]["saved_bytes"]
        row["extra_compute"] = row["recompute_flops"] / base
    return rows


def hf_switch_rows(dims: dict, micro_batch: int, seq_len: int) -> list[dict]:
    """Hugging Face's switches, measured: the config key the seed tutorial sets, set before the model is built and
    after; `activation_checkpointing_enable()` (transformers 5's name: `gradient_checkpointing_enable()` is its
    deprecated alias, to be removed in v6); each in training and in eval mode (what `from_pretrained` returns).
    `checkpointing`: what the model's `is_activation_checkpointing` reads."""
    cases = []
    plain = build(dims)
    before = build(dims, gradient_checkpointing=True)    # what from_pretrained(..., config=config) does
    after = build(dims)
    after.config.gradient_checkpointing = True
    enabled = build(dims)
    enabled.activation_checkpointing_enable()
    for label, model in (("nothing set", plain), ("config.gradient_checkpointing = True, then build", before),
                         ("build, then model.config.gradient_checkpointing = True", after),
                         ("model.activation_checkpointing_enable()", enabled)):
        for mode in ("train", "eval"):
            model.train(mode == "train")
            cases.append(dict(setup=label, mode=mode, **measure(model, micro_batch, seq_len)))
    base = cases[0]["saved_bytes"]
    for case in cases:
        case["saved_fraction"] = case["saved_bytes"] / base
    return cases


# ---------------------------------------------------------------------------------------------- Qwen-7B
def qwen7b_rows(preset="qwen-7b", micro_batch=1, seq_len=4096, gpus=8, ks=(0, 4, 8, 16, 24, 32)) -> list[dict]:
    """labs.memory for a 7B model under ZeRO-3: the decoder's saved activations, the whole activation peak (the
    stock loss's fp32 logits included) and the peak per GPU, with the first k layers checkpointed; and the
    recompute FLOPs as a share of the decoder's FLOPs (as measured_rows counts them) and of the whole step's."""
    dims = models.shape(preset)
    layers = dims["num_hidden_layers"]
    decoder_flops, whole_flops = decoder_flops_per_token(dims, seq_len), models.flops_per_token(dims, seq_len)
    rows = []
    for k in ks:
        k = min(k, layers)
        estimate = memory.estimate(preset, stage=3, gpus_per_node=gpus, micro_batch=micro_batch, seq_len=seq_len,
                                   activation_checkpointing=k)
        decoder = act.activation_bytes(dims, micro_batch, seq_len, k)
        rows.append(dict(k=k, decoder_bytes=decoder["layers kept whole"] + decoder["checkpointed layer inputs"],
                         activation_peak_bytes=activation_peak(dims, micro_batch, seq_len, k),
                         total_per_gpu_bytes=estimate.total_per_gpu_bytes, peak_phase=estimate.peak_phase,
                         extra_compute=k * recompute_flops_per_token(dims, seq_len) / decoder_flops,
                         extra_compute_whole_step=k * recompute_flops_per_token(dims, seq_len) / whole_flops))
    return rows


def activation_peak(dims: dict, micro_batch: int, seq_len: int, layers, loss="hf") -> int:
    """Activations at their worst moment, the loss's backward: everything forward saved, plus what the stock loss
    holds there (three fp32 [tokens, vocab] tensors)."""
    return sum(act.activation_bytes(dims, micro_batch, seq_len, layers).values()) + \
        sum(act.loss_bytes(dims, loss, micro_batch, seq_len).values())


def claims(preset="qwen-7b", micro_batch=1, seq_len=2048) -> list[dict]:
    """The seed tutorial's two claims on checkpointing, with the numbers that decide them (labs.memory)."""
    dims = models.shape(preset)
    whole = sum(act.activation_bytes(dims, micro_batch, seq_len, "none").values())
    saved = 1 - sum(act.activation_bytes(dims, micro_batch, seq_len, "full").values()) / whole
    peak_saved = 1 - activation_peak(dims, micro_batch, seq_len, "full") / activation_peak(dims, micro_batch, seq_len,
                                                                                           "none")
    no_zero = memory.estimate(preset, stage=0, gpus_per_node=4, precision="fp16", micro_batch=micro_batch,
                              seq_len=seq_len, activation_checkpointing="full")
    paper = no_zero.paper_model_states_per_gpu_bytes
    return [
        dict(claim="activation checkpointing saves 30-50% of activation memory", preset=preset,
             decoder_saved=saved, peak_saved=peak_saved, verdict="false",
             reason=f"it saves more than that: what forward keeps shrinks by {saved:.0%} (each layer keeps only its "
                    f"input); at the step's activation peak, the loss's backward, the stock loss's fp32 logits stay, "
                    f"and it shrinks by {peak_saved:.0%}"),
        dict(claim="4 x RTX 3090 train a 7B model in fp16 with gradient checkpointing at 22 GB per GPU (the row names "
                   "no ZeRO stage, where the rows below it name ZeRO-3 Offload; read here as: without ZeRO)",
             preset=preset, total_per_gpu=no_zero.total_per_gpu_bytes, paper_model_states_per_gpu=paper,
             bytes_per_param=paper / no_zero.params, fits=no_zero.fits(memory.GPUS["RTX3090"]), verdict="false",
             reason=f"without ZeRO every GPU holds every model state, {paper / no_zero.params:.0f} bytes per "
                    f"parameter by the ZeRO paper's count ({paper / memory.GiB:.0f} GiB) before any activation; "
                    "checkpointing shrinks only activations"),
    ]
