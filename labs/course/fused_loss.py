"""What a fused loss that computes its gradients during forward stores before the loss scale applies.

Liger Kernel's fused linear cross-entropy (`LigerFusedLinearCrossEntropyLoss`, labs' `--loss liger` and run e's
loss) does all its work in its *forward* pass (liger_kernel/ops/fused_linear_cross_entropy.py, version 0.8.5),
chunk by chunk: the logits, in the hidden states' dtype; the loss, in fp32; and, written over the logits, their
gradient (softmax - one-hot) / targets, in that same dtype; from it the gradients of the hidden states
(`grad_input`, in their dtype) and of the output head. Its backward only multiplies those by the gradient that
arrives from the loss, which under DeepSpeed's fp16 engine is the loss scale. In fp16 the loss scale therefore
never reaches these gradients: they are rounded to fp16 at scale 1 and multiplied afterwards.

`gradients_before_the_scale` repeats that arithmetic on a CPU for a few tokens of an untrained model: hidden
states of RMS 1 (the final RMSNorm's output) and an output head drawn as HF initialises it, both held in the
format, for each (format, scale at which the gradients are stored), against the same gradients computed without
rounding.

    from labs.course import fused_loss
    fused_loss.gradients_before_the_scale("qwen2.5-7b", targets=8190, stored=(("fp16", 1.0), ("fp16", 2.0 ** 16)))
"""
from __future__ import annotations

import torch

from labs import models
from labs.course import precision
from labs.errors import LabsError

CHUNK = 16384         # output-head rows drawn at a time: the head is kept only in the 16-bit formats asked for


def _rounded(values: torch.Tensor, name: str) -> torch.Tensor:
    return values.to(precision.dtype(name)).float()


def _gradient(logits: torch.Tensor, labels: torch.Tensor, targets: int) -> torch.Tensor:
    """(softmax - one-hot) / targets, in fp32: the mean cross-entropy's gradient, as Liger's kernel computes it."""
    grad = torch.softmax(logits, dim=-1)
    grad[torch.arange(len(labels)), labels] -= 1
    return grad / targets


def gradients_before_the_scale(preset="qwen2.5-7b", targets=8190, rows=4, stored=(("fp16", 1.0),), seed=0) -> dict:
    """For `rows` tokens of the mean cross-entropy over `targets` predicted tokens, what Liger's kernel stores for each
    (format, scale) in `stored`: the logits in the format (fp32 accumulation, rounded once), the softmax in fp32,
    the logits' gradient x scale rounded to the format, the hidden states' gradient (that times the head, rounded
    once). Compared with the same computation without any rounding, from the same weights and hidden states (held
    in the format, as the forward pass holds them). Returns {(format, scale): the shares of the non-target logits'
    gradients that are flushed to 0, subnormal or normal, how many of them per token are kept, the share of the
    hidden states' gradient entries that are subnormal, and its RMS error relative to the exact one}."""
    if isinstance(rows, bool) or not isinstance(rows, int) or not 1 <= rows <= targets:
        raise LabsError(f"need a whole number of rows from 1 to targets ({targets}), not {rows!r}")
    for name, scale in stored:
        precision.dtype(name)
        if not scale > 0:
            raise LabsError(f"a loss scale must be positive, not {scale!r}")
    config = models.qwen2_config(preset)
    vocab, hidden = config.vocab_size, config.hidden_size
    generator = torch.Generator().manual_seed(seed)
    states = torch.randn(rows, hidden, generator=generator)
    labels = torch.randint(vocab, (rows,), generator=generator)
    names = sorted({name for name, _ in stored})
    heads = {name: [] for name in names}
    logits = {name: torch.empty(rows, vocab) for name in names}
    exact_logits = {name: torch.empty(rows, vocab) for name in names}
    for start in range(0, vocab, CHUNK):
        chunk = torch.Generator().manual_seed(seed + 1 + start)               # never the hidden states' seed
        head = torch.empty(min(CHUNK, vocab - start), hidden).normal_(0, config.initializer_range, generator=chunk)
        part = slice(start, start + len(head))
        for name in names:
            heads[name].append(head.to(precision.dtype(name)))
            exact_logits[name][:, part] = _rounded(states, name) @ heads[name][-1].float().T
            logits[name][:, part] = _rounded(exact_logits[name][:, part], name)
    others = torch.ones(rows, vocab, dtype=torch.bool)
    others[torch.arange(rows), labels] = False
    found = {}
    for name, scale in stored:
        exact = _gradient(exact_logits[name], labels, targets)
        kept = _rounded(_gradient(logits[name], labels, targets) * scale, name)
        exact_dh, dh = torch.zeros(rows, hidden), torch.zeros(rows, hidden)
        start = 0
        for head in heads[name]:
            part = slice(start, start + len(head))
            exact_dh += exact[:, part] @ head.float()
            dh += kept[:, part] @ head.float()
            start += len(head)
        dh = _rounded(dh, name)                                               # grad_input, rounded once
        shares = precision.range_shares(exact[others], name, scale)
        found[(name, scale)] = dict(
            format=name, scale=scale, flushed=shares["flushed"], subnormal=shares["subnormal"],
            normal=shares["normal"], kept_per_token=float((kept[others] != 0).double().sum()) / rows,
            hidden_subnormal=float(((dh != 0) & (dh.abs() < torch.finfo(precision.dtype(name)).smallest_normal))
                                   .double().mean()),
            hidden_error=float((dh / scale - exact_dh).pow(2).mean().sqrt() / exact_dh.pow(2).mean().sqrt()))
    return found
