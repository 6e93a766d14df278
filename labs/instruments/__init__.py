"""Chapter instruments: measurements the rank loop (labs.train) runs only when a chapter asks for them, through
the `labs.train.Instrument` hooks. Each one's findings land in summary.json under its name, one entry per rank.

    launch.run(..., instruments=("state_bytes", "comm", "zero_buffers"))

- state_bytes (state.py): the bytes of parameters, gradients and optimizer states the engine holds, by device,
  after the last backward (on by default: it runs once per run).
- comm (comm.py): calls and payload bytes of every collective, per step.
- zero_buffers (buffers.py): ZeRO's gradient buckets, persistent and gathered parameters. It walks every parameter
  after each ZeRO-3 fetch, so it costs time in the hot path: chapters 2 and 3 turn it on, benchmarks do not.
- state_dict (checkpoints.py): a real checkpoint at the end of the run (FSDP2: DCP; DeepSpeed: its ZeRO files),
  described (files, tensor types, shapes, placements) and deleted. Chapter 7 turns it on.
- probe_logits (logits.py): the engine's logits on a fixed probe once it is ready (in a resumed run: loaded from
  its checkpoint), written to RUN_DIR/probe_logits.pt; chapter 5 checks exported models against them.
- rank_env (environment.py): the variables a launcher set for each rank (RANK, LOCAL_RANK, TORCHELASTIC_*, NCCL_*).
- peak_allocations (allocations.py): the GPU blocks alive at the run's peak, grouped by the code that allocated
  them, from PyTorch's allocator record (GPU only; it slows the run: for finding what a memory prediction missed).
"""
from labs.errors import check_choice
from labs.instruments.allocations import PeakAllocations
from labs.instruments.buffers import ZeroBuffers
from labs.instruments.checkpoints import StateDict
from labs.instruments.comm import Comm
from labs.instruments.environment import RankEnv
from labs.instruments.logits import ProbeLogits
from labs.instruments.state import StateBytes

INSTRUMENTS = {cls.name: cls for cls in (StateBytes, Comm, ZeroBuffers, StateDict, ProbeLogits, RankEnv, PeakAllocations)}


def build(names, run_dir=None, spec=None) -> list:
    """Fresh instruments for one run, by name; each may read the run's spec and write into its folder."""
    built = [INSTRUMENTS[check_choice("instrument", name, INSTRUMENTS)]() for name in names]
    for instrument in built:
        instrument.run_dir, instrument.spec = run_dir, spec
    return built
