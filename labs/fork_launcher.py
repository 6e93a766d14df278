"""torchrun, with each CPU rank forked from one process that has already imported what every rank imports.

    python -m labs.fork_launcher TORCHRUN_ARGS... -m labs.rank RUN_DIR     # what labs.launch runs for CPU ranks

A CPU rank started as a fresh interpreter spends about 6.9 s of CPU importing torch, DeepSpeed and transformers' Qwen2
before it trains (2-core VM, 2026-12-07); a 2-rank, 1-step run of the tiny preset cost 20 s of CPU in all, 14 s with
its ranks forked from here. This module is torchrun otherwise: torch.distributed.run's own argument parsing,
rendezvous and elastic agent (which restarts nothing and stops every rank when one fails, as there), started with
the one difference torchrun offers for a function as entry point: its processes are forked ("fork" start method).
GPU runs never come here: a process must not fork once CUDA may be initialised, and there start-up is a sliver of a
7B step (labs.launch.launcher_command).
"""
import gc

if __name__ == "__main__":
    gc.disable()    # as labs.rank does: the imports make ~570,000 objects and next to no garbage

import signal
import sys

from labs import prefork_server

prefork_server.preload()    # torch, DeepSpeed's engine and ZeRO, transformers' Qwen2: what every rank imports

import torch.distributed.run as torchrun  # noqa: E402
import torch.multiprocessing as torch_mp  # noqa: E402
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError  # noqa: E402
from torch.distributed.launcher.api import elastic_launch  # noqa: E402

from labs import data, rank  # noqa: E402

RANK_MODULE = ("-m", "labs.rank")


def forked_launch(config, entrypoint):
    """Stands in for torchrun's elastic_launch: the command torchrun would start in each new interpreter
    (`python -u -m labs.rank RUN_DIR`) becomes labs.rank.forked(RUN_DIR) in a forked process."""
    def launch(*command_args):
        assert tuple(command_args[-3:-1]) == RANK_MODULE, f"labs.fork_launcher runs labs.rank only: {command_args}"
        config.start_method = "fork"
        try:
            return elastic_launch(config=config, entrypoint=rank.forked)(command_args[-1])
        except ChildFailedError as failed:
            report_other_failures(failed)
            raise
    return launch


_started = []     # the agent's process groups (torch.multiprocessing contexts), kept to read every exit code


def _keep(start_processes):
    def started(*args, **kwargs):
        _started.append(start_processes(*args, **kwargs))
        return _started[-1]
    return started


def report_other_failures(failed: ChildFailedError):
    """torchrun's subprocesses report every rank that failed; a forked group reports the first it finds, and when one
    rank is killed its peer's broken collective often comes first (tests/test_checkpoint.py). Print the other ranks
    that died by a signal in torchrun's own words, so that labs.supervisor.failure_message names the killed one."""
    if not _started:
        return
    reported = {f.local_rank for f in failed.failures.values()}
    offset = min(failed.failures) - min(f.local_rank for f in failed.failures.values())   # this node's first rank
    for local_rank, process in enumerate(_started[-1].processes):
        code = process.exitcode
        if local_rank not in reported and code is not None and code < 0 and -code != signal.SIGTERM:
            print(f"  rank      : {offset + local_rank} (local_rank: {local_rank})\n"
                  f"  exitcode  : {code} (pid: {process.pid})", file=sys.stderr, flush=True)


def main(argv: list[str]) -> int:
    """torchrun's main with forked ranks; returns 0 or raises as torchrun does (a rank's failure: ChildFailedError)."""
    data.tokenizer()    # every rank reads qwen.tiktoken into 151,643 BPE ranks (0.3 s of CPU): forked, they share one
    gc.freeze()         # out of every rank's collections (labs.train freezes what the rank adds on top)
    torchrun.elastic_launch = forked_launch
    torch_mp.start_processes = _keep(torch_mp.start_processes)
    torchrun.main(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
