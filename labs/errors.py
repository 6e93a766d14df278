"""The exceptions labs raises and the small checks that raise them. A LabsError is bad input: the CLI prints its
message on one line and exits with code 2."""


class LabsError(Exception):
    """A problem the user can fix: the message names the bad key or path and what to do."""


class RankFailed(RuntimeError):
    """A training rank died; the message carries that rank's own traceback."""


class RunStopped(BaseException):
    """SIGTERM or SIGHUP reached labs while a run was going: every process of the run was stopped."""

    def __init__(self, signum: int):
        import signal

        self.signum = signum
        super().__init__(f"stopped by {signal.Signals(signum).name}")


def check_choice(what: str, value, choices):
    """`value` if it is one of `choices`, else a LabsError that lists them."""
    if value not in choices:
        raise LabsError(f"unknown {what} '{value}'; choose one of: {', '.join(map(str, choices))}")
    return value


def positive_int(text: str) -> int:
    """An argparse type: a whole number of at least 1 (0 is refused, never read as 'not given')."""
    import argparse

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def positive_float(text: str) -> float:
    """An argparse type: a finite number above 0."""
    import argparse
    import math

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a number") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a positive number, not {text}")
    return value
