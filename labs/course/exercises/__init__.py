"""Chapter exercises, checked when run: `exercises.check("01.2", 28.6)` prints a clear verdict and returns True or
False. One registry (registry.py); each chapter registers its questions in its own module.

    from labs.course import exercises
    exercises.show("01")          # the questions of chapter 01
    exercises.check("01.1", 16)   # -> "01.1 correct: ..."
"""
# each chapter's module registers its questions when imported
from labs.course.exercises import ch00, ch01, ch02, ch03, ch04, ch05, ch06, ch07, ch08, ch09, ch10  # noqa: F401
from labs.course.exercises.registry import EXERCISES, check, show

__all__ = ["EXERCISES", "check", "show"]
