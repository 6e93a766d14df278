"""bf16 matrix products on a CPU without native bf16 arithmetic, at fp32 speed and with bf16's result.

A CPU with AVX-512 BF16 or AMX runs a bf16 matmul in oneDNN. One without (AVX2 only: many cloud VMs, among them
the AMD EPYC VM this course was developed on, 2026-12-03) falls back to PyTorch's reference GEMM,
`cpublas_gemm_impl`, which widens each pair of bf16 values to fp32 one dot product at a time. There the tiny
preset's tied 151,936 x 64 embedding made its LM head's backward 67x slower in bf16 than in fp32 (6.9 s against
0.10 s for 128 tokens on one core), and a ZeRO-3 step of 2 x 64 tokens per rank took 7-9 s, nearly all of it in that
GEMM (perf: 91% of a rank's time); with this mode, 1.0 s.

`Bf16MatmulsInFp32` computes the same product the reference GEMM computes: the bf16 operands widened to fp32
(exactly: every bf16 value is an fp32 value), products summed in fp32, the result rounded once to bf16. Only the
order of the sums differs (MKL's blocked fp32 kernel instead of one dot product at a time), as it differs between
oneDNN and the reference GEMM. The bytes a run holds do not change: parameters, gradients, optimizer state and
everything DeepSpeed or FSDP2 sends stay bf16, and so does everything autograd saves; the fp32 copies are
temporaries of one product. GPUs are untouched: their bf16 GEMMs run on tensor cores.

It is a TorchDispatchMode, entered for the whole life of a CPU rank.
"""
from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
# The ATen products nn.Linear, matmul and SDPA's math path reach on a CPU, forward and backward.
PRODUCTS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default}


def native_bf16_matmul() -> bool:
    """True where PyTorch runs bf16 matmuls in oneDNN on this CPU (AVX-512 BF16, AMX or AVX-NE-CONVERT)."""
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(check and torch.backends.mkldnn.is_available() and check())


def _widened(value):
    if isinstance(value, torch.Tensor) and value.dtype == torch.bfloat16:
        return value.float()
    return value


class Bf16MatmulsInFp32(TorchDispatchMode):
    """Inside this mode, a product whose tensor operands are all bf16 CPU tensors runs in fp32 and is rounded to bf16.
    A dispatch mode works below autograd: the graph, what it saves and what a recomputed layer records are unchanged,
    and the backward's products (run by the autograd engine, which carries the mode over) are caught as well."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in PRODUCTS:
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            if all(t.dtype == torch.bfloat16 and t.device.type == "cpu" for t in tensors):
                return func(*map(_widened, args), **kwargs).to(torch.bfloat16)
        return func(*args, **kwargs)


def enter_if_needed(device: torch.device) -> bool:
    """Enter Bf16MatmulsInFp32 for the rest of this process when `device` is a CPU without native bf16 matmuls.
    Returns whether it did."""
    mode = as_a_rank(device)
    mode.__enter__()
    return isinstance(mode, Bf16MatmulsInFp32)


def as_a_rank(device: torch.device):
    """A context with the products a CPU rank computes (Bf16MatmulsInFp32 where enter_if_needed would enter it), for
    recomputing a rank's forward in this process bit for bit."""
    if torch.device(device).type != "cpu" or native_bf16_matmul():
        return contextlib.nullcontext()
    return Bf16MatmulsInFp32()
