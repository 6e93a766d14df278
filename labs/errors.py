"""One exception type for bad input: the CLI prints its message on one line and exits with code 2."""


class LabsError(Exception):
    """A problem the user can fix: the message names the bad key or path and what to do."""


class RankFailed(RuntimeError):
    """A training rank died; the message carries that rank's own traceback."""
