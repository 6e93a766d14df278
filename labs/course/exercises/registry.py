"""The exercise registry: each chapter module registers its questions with `@exercise`, whose function computes the
expected answer with labs itself (the code the chapter proves against DeepSpeed, the paper or a measurement),
never a typed-in literal. `check` compares a reader's answer with it and says why when it is off."""
from __future__ import annotations

import textwrap
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
        return fn
    return register


def check(id: str, answer) -> bool:
    if id not in EXERCISES:
        raise LabsError(f"unknown exercise '{id}'; known: {', '.join(EXERCISES)}")
    ex = EXERCISES[id]
    if answer is None:
        # no hint before a prediction: the hint would give away the reasoning the exercise asks for
        print(f"{id} not answered yet: put your prediction in `answer` and run the cell again")
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


def show(chapter: str, width: int | None = None):
    """Every exercise of a chapter ("09"), or one exercise ("09.1"); each on one line, or wrapped to `width`
    columns with the lines after the first indented."""
    for ex in EXERCISES.values():
        if ex.id == chapter or ex.id.startswith(chapter + "."):
            line = f"{ex.id}  {ex.question}  [answer in {ex.unit}]"
            print(line if width is None else textwrap.fill(line, width, subsequent_indent=" " * (len(ex.id) + 2)))


def _fmt(x: float) -> str:
    return f"{x:,.0f}" if abs(x) >= 1000 else f"{x:,.3g}"
