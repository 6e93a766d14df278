"""`labs ...` (the console script) and `python -m labs ...`: labs.cli, which imports torch, then its main."""
import gc
import os
import signal
import sys

STARTING = "labs: interrupted while starting: nothing was started\n"


def run() -> int:
    """A Ctrl-C while labs.cli imports torch (1-3 s, before anything has started) ends as one later would: one line
    and exit code 130. Left to Python it was a KeyboardInterrupt traceback from deep inside torch's import; caught
    around the import, it was at times swallowed on the way (under pytest, `python -m labs env` interrupted 0.4 s in
    printed its report and exited 0, 4 times in 5, 2026-12-07). So until the imports are done SIGINT ends the
    process at once: there is nothing to stop yet. A SIGINT this process was started ignoring stays ignored."""
    previous = signal.getsignal(signal.SIGINT)
    if previous is signal.default_int_handler:
        signal.signal(signal.SIGINT, _interrupted_while_starting)
    gc.disable()    # as in labs.rank: the imports make many objects and next to no garbage, a wasted collector pass
    try:
        from labs.cli import main
    finally:
        signal.signal(signal.SIGINT, previous)
    gc.freeze()
    gc.enable()
    return main()


def _interrupted_while_starting(signum, frame):
    os.write(2, STARTING.encode())
    os._exit(130)


if __name__ == "__main__":
    sys.exit(run())
