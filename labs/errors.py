"""One exception type for bad input: the CLI prints its message on one line and exits with code 2."""


class LabsError(Exception):
    """A problem the user can fix: the message names the bad key or path and what to do."""


class RankFailed(RuntimeError):
    """A training rank died; the message carries that rank's own traceback."""


def check_choice(what: str, value, choices):
    """`value` if it is one of `choices`, else a LabsError that lists them."""
    if value not in choices:
        raise LabsError(f"unknown {what} '{value}'; choose one of: {', '.join(map(str, choices))}")
    return value
