"""Chapter exercises, checked when run: `exercises.check("01.2", 28.6)` (or `exercises.check_01_2(28.6)`)
prints a clear verdict and returns True or False. The expected answers are computed by labs itself (the
same code the chapter proves against DeepSpeed, the paper and measurement), never typed in.

    from labs import exercises
    exercises.show("01")          # the questions of chapter 01
    exercises.check("01.1", 16)   # -> "01.1 correct: ..."
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from labs.errors import LabsError


@dataclass
class Exercise:
    id: str
    question: str
    expected: Callable[[], float | str]   # computes the answer: a number, or a word/key for a choice
    unit: str
    rel: float = 0.01                 # relative tolerance
    hint: str = ""


EXERCISES: dict[str, Exercise] = {}


def exercise(id, question, unit, rel=0.01, hint=""):
    def register(fn):
        EXERCISES[id] = Exercise(id, question, fn, unit, rel, hint)
        globals()[f"check_{id.replace('.', '_')}"] = lambda answer, _id=id: check(_id, answer)
        return fn
    return register


def check(id: str, answer) -> bool:
    if id not in EXERCISES:
        raise LabsError(f"unknown exercise '{id}'; known: {', '.join(EXERCISES)}")
    ex = EXERCISES[id]
    if answer is None:
        print(f"{id} not answered yet. Hint: {ex.hint}")
        return False
    want = ex.expected()
    if isinstance(want, str):      # a choice: compare words, ignoring case, quotes and a trailing ': value'
        ok = str(answer).strip().strip('"').split(":")[0].strip().lower() == want.lower()
        print(f"{id} correct: {want}" if ok else f"{id} not yet: '{answer}' is not it. Hint: {ex.hint}")
        return ok
    try:
        given = float(answer)
    except (TypeError, ValueError):
        print(f"{id} not a number: give your answer in {ex.unit} as a number, e.g. check('{id}', 12.5)")
        return False
    ok = abs(given - want) <= ex.rel * abs(want)
    if ok:
        print(f"{id} correct: {_fmt(want)} {ex.unit}")
    else:
        direction = "too high" if given > want else "too low"
        print(f"{id} not yet: {_fmt(given)} {ex.unit} is {direction} (within {ex.rel:.0%} counts). Hint: {ex.hint}")
    return ok


def show(chapter: str):
    for ex in EXERCISES.values():
        if ex.id.startswith(chapter + "."):
            print(f"{ex.id}  {ex.question}  [answer in {ex.unit}]")


def _fmt(x: float) -> str:
    return f"{x:,.0f}" if abs(x) >= 1000 else f"{x:,.3g}"


# ------------------------------------------------------------------------------------------ chapter 01
def _mem():
    from labs import memory

    return memory


@exercise("01.1", "Mixed-precision AdamW without ZeRO, paper accounting: bytes of model states per parameter?",
          "bytes", rel=0, hint="bf16 params and grads, plus K = fp32 master + momentum + variance")
def _bytes_per_param():
    m = _mem()
    return m.estimate(params=1e9, stage=0).paper_model_states_per_gpu_bytes / 1e9


@exercise("01.2", "Qwen2.5-7B, ZeRO-2 on 8 GPUs: model states per GPU by the paper's accounting, in GB (1e9 B)?",
          "GB", hint="2 Psi + (2 + K) Psi / N_d; Psi is the model's real parameter count, not 7e9")
def _zero2_states():
    return _mem().estimate("qwen2.5-7b", stage=2, gpus_per_node=8).paper_model_states_per_gpu_bytes / 1e9


@exercise("01.3", "Same setup: how many GB more does DeepSpeed's own estimator count than the paper, and why?",
          "GB", hint="DeepSpeed copies each gradient partition to fp32 for the update: 4 bytes per parameter / N")
def _deepspeed_extra():
    est = _mem().estimate("qwen2.5-7b", stage=2, gpus_per_node=8)
    return (est.model_states_per_gpu_bytes - est.paper_model_states_per_gpu_bytes) / 1e9


@exercise("01.4", "Stock HF loss, Qwen2.5-7B, micro-batch 2 x 4096 tokens: GiB of the three fp32 [tokens, vocab] "
          "tensors alive in log_softmax's backward?", "GiB",
          hint="12 bytes per logit: tokens = 2 * 4096 (labels are padded, not cut), vocab = 152,064")
def _loss_gib():
    from labs import activations, models

    return sum(activations.loss_bytes(models.shape("qwen2.5-7b"), "hf", 2, 4096).values()) / 2 ** 30


@exercise("01.5", "Fewest GPUs (one node, ZeRO-3, no offload) for Qwen2.5-7B, micro-batch 2 x 4096, full "
          "checkpointing, Liger loss, to fit 80 GiB cards by the labs peak (est.fits)?", "GPUs", rel=0,
          hint="try memory.estimate(..., gpus_per_node=n).fits(memory.parse_bytes('80GiB')) for n = 1, 2, ...")
def _fewest_gpus():
    m = _mem()
    for gpus in range(1, 65):
        est = m.estimate("qwen2.5-7b", stage=3, gpus_per_node=gpus, micro_batch=2, activation_checkpointing="full",
                         loss="liger")
        if est.fits(m.parse_bytes("80GiB")):
            return gpus
    raise AssertionError("no GPU count up to 64 fits")


from labs import exercises_gpu, exercises_zero  # noqa: E402,F401  (register chapters 02, 03 and 09)
