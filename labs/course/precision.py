"""Number formats for training, computed from torch rather than typed in: what fp32, fp16, bf16 and the two fp8
formats can hold (torch.finfo and the bit patterns themselves), real casts of real values, and the two ways a
16-bit format fails a training run:

- range: a value above the largest finite number becomes inf (or, in fp8 e4m3, saturates), one below the
  smallest subnormal becomes 0 (`cast`, `softmax_denominator`, `logits_gradient`, `range_shares`);
- precision: a change smaller than half the spacing of the numbers around a value is rounded away, which is
  why mixed precision keeps fp32 master weights and sums in fp32 (`update_lands`, `drift`, `running_total`).

    from labs.course import precision
    precision.format_rows()                    # one row per format: bits, largest, smallest, epsilon
    precision.cast([65504, 65520, 1e-8], "fp16")
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from labs import models
from labs.errors import LabsError, check_choice

FORMATS = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16,
           "fp8-e4m3": torch.float8_e4m3fn, "fp8-e5m2": torch.float8_e5m2}
# The integer type of the same width, to read and step a format's bit patterns.
_BITS = {32: torch.int32, 16: torch.int16, 8: torch.uint8}


def dtype(name: str) -> torch.dtype:
    """The torch dtype of a format name ('fp32', 'fp16', 'bf16', 'fp8-e4m3', 'fp8-e5m2')."""
    return FORMATS[check_choice("number format", name, FORMATS)]


def _count(what: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise LabsError(f"{what} must be a positive whole number, not {value!r}")
    return value


# ------------------------------------------------------------------------------------------ the formats
def smallest_subnormal(name: str) -> float:
    """The bit pattern 0...01 read as the format: the smallest positive number it can hold."""
    return torch.tensor(1, dtype=_BITS[torch.finfo(dtype(name)).bits]).view(dtype(name)).item()


def describe(name: str) -> dict:
    """Bits, exponent and mantissa widths, largest finite value, smallest normal and subnormal, epsilon (the
    spacing just above 1) and the decimal digits that epsilon allows, all read from torch."""
    info = torch.finfo(dtype(name))
    mantissa = round(-math.log2(info.eps))                    # eps = 2^-mantissa bits
    return dict(format=name, bits=info.bits, exponent_bits=info.bits - 1 - mantissa, mantissa_bits=mantissa,
                largest=float(info.max), smallest_normal=float(info.smallest_normal),
                smallest_subnormal=smallest_subnormal(name), epsilon=float(info.eps),
                decimal_digits=(mantissa + 1) * math.log10(2))


def format_rows(names=tuple(FORMATS)) -> list[dict]:
    return [describe(name) for name in names]


def cast(values, name: str) -> list[float]:
    """`values` rounded to the format and read back (inf where they overflow, 0 where they underflow)."""
    return torch.tensor(values, dtype=torch.float64).to(dtype(name)).double().tolist()


def cast_rows(values: dict, names=tuple(FORMATS)) -> list[dict]:
    """One row per labelled value: the value, then what each format stores for it."""
    rows = []
    for label, value in values.items():
        rows.append(dict(value_of=label, exact=float(value), **{n: cast([value], n)[0] for n in names}))
    return rows


def spacing(value: float, name: str) -> float:
    """The gap between the format's number at `value` and the next one up (one unit in the last place)."""
    here = torch.tensor([abs(value)], dtype=torch.float64).to(dtype(name))
    bits = here.view(_BITS[torch.finfo(here.dtype).bits])
    return float((bits + 1).view(here.dtype).double() - here.double())


def relative_error(name: str, low=-45.0, high=42.0, points=2000) -> tuple[list[float], list[float]]:
    """|cast(x) - x| / x for x from 10^low to 10^high: about epsilon / 2 in the normal range, rising below it
    (subnormals), 1 where x underflows to 0, inf where it overflows (nan where fp8 e4m3 has no inf)."""
    xs = torch.logspace(low, high, points, dtype=torch.float64)
    stored = xs.to(dtype(name)).double()
    return xs.tolist(), ((stored - xs).abs() / xs).tolist()


# ------------------------------------------------------------------------------------------ precision
def qwen_weight(preset="qwen2.5-7b", seed=0) -> torch.Tensor:
    """A [hidden, hidden] fp32 weight (the shape of Qwen2.5-7B's q_proj and o_proj) drawn as HF initialises
    Qwen2: normal with the config's `initializer_range`."""
    config = models.qwen2_config(preset)
    generator = torch.Generator().manual_seed(seed)
    return torch.empty(config.hidden_size, config.hidden_size).normal_(0, config.initializer_range,
                                                                        generator=generator)


def update_lands(weights: torch.Tensor, update: float, name: str) -> float:
    """The fraction of `weights` whose copy in the format changes when `update` is added to the fp32 value:
    the rest of the update is rounded away (it is smaller than half the spacing around those weights)."""
    before = weights.to(dtype(name))
    after = (weights.double() + update).to(dtype(name))
    return float((after != before).double().mean())


def drift(start: float, update: float, steps: int, name: str) -> dict:
    """A weight that receives the same small update each step, kept three ways: exact (float64), in the format
    alone (each new value rounded to it), and as an fp32 master whose copy in the format the forward pass uses."""
    _count("steps", steps)
    alone = torch.tensor(start, dtype=torch.float64).to(dtype(name))
    master = torch.tensor(start, dtype=torch.float32)
    rows = []
    for step in range(steps + 1):
        rows.append(dict(step=step, exact=start + step * update, alone=float(alone),
                         master=float(master), copy=float(master.to(dtype(name)))))
        alone = (alone.double() + update).to(dtype(name))
        master = master + update
    return dict(format=name, update=update, rows=rows)


# ------------------------------------------------------------------------------------------ Qwen-scale range
def softmax_denominator(vocab: int, name: str) -> dict:
    """All-zero logits for one token over a `vocab`-sized vocabulary: the softmax's denominator is then
    sum(exp(0)) = vocab, and the loss ln(vocab). Computed with torch's own ops in the format: the sum, and
    cross_entropy. Torch's CPU kernels accumulate fp16/bf16 sums in fp32 (`sum_of_ones`), but both results are
    stored in the format: a denominator above the format's largest number is inf, and so is the loss."""
    logits = torch.zeros(1, _count("vocab", vocab), dtype=dtype(name))
    target = torch.zeros(1, dtype=torch.long)
    return dict(format=name, vocab=vocab, denominator=float(logits.exp().sum()),
                loss=float(F.cross_entropy(logits, target)), exact_loss=math.log(vocab))


def sum_of_ones(count: int, name: str) -> float:
    """torch's own sum of `count` ones held in the format: the kernel accumulates in fp32 and stores the result
    in the format, so it is exact wherever the result is representable."""
    return float(torch.ones(_count("count", count), dtype=dtype(name)).sum())


def running_total(name: str, limit=1_000_000) -> float:
    """A total that adds 1.0 at a time, every partial sum stored in the format (as a gradient accumulated in a
    16-bit buffer would be): the value where adding 1 no longer changes it (the spacing there has reached 2)."""
    total, one = torch.zeros((), dtype=dtype(name)), torch.ones((), dtype=dtype(name))
    for _ in range(_count("limit", limit)):
        grown = total + one
        if grown == total:
            return float(total)
        total = grown
    return float(total)


def initial_logit_std(preset="qwen2.5-7b") -> float:
    """The spread of an untrained model's logits: the final RMSNorm leaves hidden states of RMS 1, and each logit
    is a dot product of `hidden` of them with lm_head weights drawn N(0, initializer_range^2)."""
    config = models.qwen2_config(preset)
    return config.initializer_range * math.sqrt(config.hidden_size)


def expected_initial_loss(vocab: int, logit_std: float) -> float:
    """The mean cross-entropy of logits drawn N(0, std^2), independently, over a large vocabulary:
    E[log sum exp] = ln(vocab) + std^2 / 2, and the target's logit is 0 on average."""
    return math.log(_count("vocab", vocab)) + logit_std ** 2 / 2


def logits_gradient(vocab: int, targets: int, rows=4, std=0.0, seed=0) -> torch.Tensor:
    """The gradient of the mean cross-entropy over `targets` predicted tokens with respect to `rows` rows of logits over
    `vocab` words: all 0 (std 0), or drawn N(0, std^2) as an untrained model's are; by autograd in fp32 (the stock
    loss upcasts logits to fp32; backward casts this gradient down to the compute format). Rows are independent,
    so these rows get exactly what they would in a full batch."""
    generator = torch.Generator().manual_seed(seed)
    logits = (torch.randn(_count("rows", rows), _count("vocab", vocab), generator=generator) * std).requires_grad_()
    labels = torch.arange(rows) % vocab
    (F.cross_entropy(logits, labels, reduction="sum") / _count("targets", targets)).backward()
    return logits.grad


def range_shares(values: torch.Tensor, name: str, scale: float = 1.0) -> dict:
    """Where the nonzero `values`, multiplied by `scale` (the loss scale multiplies every gradient before it is
    stored), land when stored in the format. Four shares that add up to 1: flushed to 0; subnormal (kept, with
    fewer significant bits); normal; overflowed to inf (or nan)."""
    stored = (values[values != 0].double() * scale).to(dtype(name)).double().abs()
    zero, finite = stored == 0, torch.isfinite(stored)
    subnormal = ~zero & finite & (stored < torch.finfo(dtype(name)).smallest_normal)
    shares = dict(flushed=zero, subnormal=subnormal, normal=finite & ~zero & ~subnormal, overflowed=~finite)
    return {key: float(mask.double().mean()) for key, mask in shares.items()}


def flushed_to_zero(values: torch.Tensor, name: str, scale: float = 1.0) -> float:
    """The fraction of the nonzero `values` that become exactly 0 when scaled and stored in the format."""
    return range_shares(values, name, scale)["flushed"]


def matmul_ms(name: str, size=256, repeats=7, seed=0) -> float:
    """Milliseconds one [size, size] x [size, size] matrix product takes in the format on one CPU thread of this
    machine: the fastest of `repeats`, after one warm-up (one thread and the minimum, so that other work on the
    machine slows the figure as little as possible). A CPU without arithmetic for the format runs a slow fallback."""
    import time

    generator = torch.Generator().manual_seed(seed)
    a, b = (torch.randn(_count("size", size), size, generator=generator).to(dtype(name)) for _ in range(2))
    threads, times = torch.get_num_threads(), []
    torch.set_num_threads(1)
    try:
        a @ b
        for _ in range(_count("repeats", repeats)):
            start = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    return 1000 * min(times)


# ------------------------------------------------------------------------------------------ one real layer
def qwen_layer_update_errors(preset="qwen2.5-7b", tokens=8, names=("fp16", "bf16"), seed=0) -> dict:
    """One decoder layer of the preset's shape (HF's Qwen2DecoderLayer, initialised as HF does), run on the same
    input in fp32 and in each format. A layer adds its update to the residual stream; the update's relative error
    against fp32 is what the format costs. Returns {format: RMS of the error / RMS of the fp32 update}."""
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RotaryEmbedding

    config = models.qwen2_config(preset)
    config._attn_implementation = "sdpa"
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(1, _count("tokens", tokens), config.hidden_size, generator=generator)
    positions = torch.arange(tokens)[None]
    cos, sin = Qwen2RotaryEmbedding(config)(x, positions)
    weights = {}
    for pname, shape in _layer_shapes(config, Qwen2DecoderLayer).items():   # HF's init: normal weights,
        weights[pname] = (torch.empty(shape).normal_(0, config.initializer_range, generator=generator)   # zero
                          if len(shape) == 2 else torch.full(shape, 1.0 if "norm" in pname else 0.0))   # biases

    def update(name):                                    # the layer's output minus its input, in the format
        with torch.device("meta"):
            layer = Qwen2DecoderLayer(config, 0).to(dtype(name))
        layer = layer.to_empty(device="cpu")
        layer.load_state_dict({k: v.to(dtype(name)) for k, v in weights.items()})
        with torch.no_grad():
            out = layer(x.to(dtype(name)), attention_mask=None, position_ids=positions,
                        position_embeddings=(cos.to(dtype(name)), sin.to(dtype(name))))
        out = out[0] if isinstance(out, tuple) else out
        return out.double() - x.to(dtype(name)).double()

    reference = update("fp32")
    return {name: float((update(name) - reference).pow(2).mean().sqrt() / reference.pow(2).mean().sqrt())
            for name in names}


def _layer_shapes(config, layer_class) -> dict:
    with torch.device("meta"):
        return {name: tuple(p.shape) for name, p in layer_class(config, 0).named_parameters()}
