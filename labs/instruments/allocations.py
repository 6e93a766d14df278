"""What is alive on the GPU at the run's peak, and which line of code allocated it.

`labs.memory` predicts a peak by adding up categories (parameters, gradients, optimizer states, activations,
buffers). When a measured peak and the prediction disagree, the question is which tensors the model forgot. This
instrument answers it from PyTorch's own record: it turns on the CUDA caching allocator's history
(`torch.cuda.memory._record_memory_history`, Python stacks) before the engine is built, and when training is over
it replays every allocation and free of the run to find the moment the allocated bytes peaked, then groups the
blocks alive at that moment by where they were allocated.

    labs train ... --instruments peak_allocations

Each rank writes RUN_DIR/peak_allocations_rankN.json (every group, and each live block with its stack) and puts the
largest groups in summary.json, beside `torch.cuda.max_memory_allocated()`: in round 8 the replayed peak was at
most 0.31% below it (chapter 1), a difference not traced. The record keeps the last `MAX_ENTRIES` events; when it
is full, older events were lost and the file says `record_complete: false`. Blocks that the autograd engine's thread allocated during backward have no Python frame at all (on a
GPU backward runs on that thread): they share one label.

Not with DeepSpeed ZeRO-3 and activation checkpointing on torch 2.11 (round 8, tools/gpu_round8.jobs): with the
record on, the first recompute that meets ZeRO-3's custom Linear Function fails ("SystemError: ... returned NULL
without setting an exception", pytorch/pytorch#179536: the record and checkpointing's early stop); with early stop
off as well, ZeRO-3's recompute finds a released parameter ("The size of tensor a (0) must match ..."). FSDP2 and
ZeRO-3 without checkpointing are not affected.

GPU only: the CPU has no caching allocator to record. On a CPU run the instrument records nothing and says why.
"""
from __future__ import annotations

import json

import torch

from labs.train import Instrument

MAX_ENTRIES = 2_000_000       # a 7B step under full checkpointing makes ~10^4 events: room for many steps
TOP_GROUPS = 25
# Where a block's label comes from: the innermost frames in code a reader can act on (not torch's module plumbing).
INTERESTING = ("labs/", "liger_kernel/", "transformers/", "deepspeed/", "torch/distributed/", "torch/utils/checkpoint",
               "torch/optim/")
LABEL_FRAMES = 3
NO_FRAMES = "(no Python frame: the autograd engine's thread, a gradient or temporary of backward)"


class PeakAllocations(Instrument):
    name = "peak_allocations"

    def __init__(self):
        self.found = None
        self.recording = False

    def before_engine(self):
        if not torch.cuda.is_available():
            self.found = {"skipped": "no CUDA device: the CPU has no caching allocator to record"}
            return
        self.before_bytes = torch.cuda.memory_allocated()
        torch.cuda.memory._record_memory_history(max_entries=MAX_ENTRIES, stacks="python")
        self.recording = True

    def finished(self, engine):
        if not self.recording:
            return
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        events = snapshot["device_traces"][torch.cuda.current_device()]
        found = peak_groups(events, self.before_bytes)
        found["max_memory_allocated_bytes"] = torch.cuda.max_memory_allocated()
        found["record_complete"] = len(events) < MAX_ENTRIES
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        if self.run_dir is not None:
            (self.run_dir / f"peak_allocations_rank{rank}.json").write_text(json.dumps(found, indent=1))
        self.found = {key: value for key, value in found.items() if key != "blocks"}
        self.found["groups"] = found["groups"][:TOP_GROUPS]

    def summary(self) -> dict:
        return self.found


def peak_groups(events: list[dict], before_bytes: int = 0) -> dict:
    """Replay the allocator's events (dicts with "action", "addr", "size", "frames"): the moment the allocated bytes
    peaked, and the blocks alive then, grouped by label and largest first. `before_bytes` were allocated before the
    record started (they appear as one group). A block counts from "alloc" until "free_completed": a free that
    waits for another stream's use ("free_requested") still holds its memory, as the allocator's own counters do.
    A free of a block the record never saw allocated (older than the record) is counted apart, not subtracted."""
    live, peak, peak_at, unmatched = {}, before_bytes, -1, 0
    allocated = before_bytes
    for i, event in enumerate(events):
        allocated, unmatched = _apply(event, live, allocated, unmatched)
        if allocated > peak:
            peak, peak_at = allocated, i
    live, allocated = {}, before_bytes
    for event in events[:peak_at + 1]:
        allocated, _ = _apply(event, live, allocated, 0)
    groups = {}
    if before_bytes:
        groups["(allocated before the record started)"] = {"bytes": before_bytes, "blocks": 1}
    for event in live.values():
        group = groups.setdefault(label(event.get("frames", [])), {"bytes": 0, "blocks": 0})
        group["bytes"] += event["size"]
        group["blocks"] += 1
    assert sum(g["bytes"] for g in groups.values()) == peak == allocated, "the live blocks add up to the peak"
    ordered = sorted(({"label": name, **g} for name, g in groups.items()), key=lambda g: -g["bytes"])
    moment = events[peak_at] if peak_at >= 0 else {}
    return {"peak_bytes": peak, "peak_event": peak_at, "events": len(events), "unmatched_free_bytes": unmatched,
            "peak_moment": label(moment.get("frames", [])), "groups": ordered,
            "blocks": [{"size": e["size"], "frames": [_frame(f) for f in e.get("frames", [])[:12]]}
                       for e in sorted(live.values(), key=lambda e: -e["size"])]}


def label(frames: list[dict]) -> str:
    """The innermost `LABEL_FRAMES` frames in interesting code, innermost first. On a GPU the autograd engine runs
    backward on its own thread, which has no Python frames: its gradients and temporaries get one label. A block
    allocated by the engine on the calling thread (its innermost frame is torch.autograd's call into it) is marked
    "(autograd engine)" before the code that started backward."""
    if not frames:
        return NO_FRAMES
    picked = [_frame(f) for f in frames if any(part in f["filename"] for part in INTERESTING)][:LABEL_FRAMES]
    text = " < ".join(picked) or "(no frame in labs, torch.distributed, transformers, Liger or DeepSpeed)"
    return "(autograd engine) " + text if "torch/autograd/" in frames[0]["filename"] else text


def _apply(event: dict, live: dict, allocated: int, unmatched: int) -> tuple[int, int]:
    if event["action"] == "alloc":
        live[event["addr"]] = event
        return allocated + event["size"], unmatched
    if event["action"] == "free_completed":
        freed = live.pop(event["addr"], None)
        return (allocated - freed["size"], unmatched) if freed else (allocated, unmatched + event["size"])
    return allocated, unmatched


def _frame(frame: dict) -> str:
    path = frame["filename"]
    for root in ("site-packages/", "/labs/"):
        if root in path:
            path = ("labs/" if root == "/labs/" else "") + path.split(root, 1)[1]
    return f"{path}:{frame['line']} {frame['name']}"
