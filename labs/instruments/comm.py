"""What ranks send each other: a counter on torch.distributed's collectives, and the ZeRO paper's
per-step volumes to compare it with.

    counter = CollectiveCounter().install()   # before deepspeed.init_distributed: DeepSpeed keeps references
    ...one training step...
    counter.take()   # {"all_gather": {"calls": 12, "bytes": 39291136}, "reduce_scatter": {...}, ...}

In a run, the `Comm` instrument does this on every rank: each step's counts land in metrics.jsonl (rank 0's, as
record["comm"]) and the totals over all steps in summary["comm"] (one entry per rank).

Every collective is counted by its payload: the bytes of the whole (unsharded) tensor it works on, whatever
the algorithm underneath. The ZeRO paper's communication volume per rank then counts an all-reduce twice
(a reduce-scatter followed by an all-gather) and every other collective once; a ring algorithm puts
(N-1)/N of that volume on each rank's wire. A collective whose group holds ranks of more than one node (nodes of
LOCAL_WORLD_SIZE consecutive ranks, as torchrun and DeepSpeed's launcher number them) also counts its payload
in "bytes_across_nodes": the traffic that leaves the node (the key appears once some does).
"""
from __future__ import annotations

import functools
import inspect
import threading

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from labs import peers
from labs.memory import layout as zero_layout
from labs.train import Instrument

# torch.distributed function -> (the kind it is counted as, how to find its full payload in its arguments).
# Payload arguments: a tensor, or a list of tensors that together make the whole.
COLLECTIVES = {
    "all_reduce": ("all_reduce", "tensor"),
    "all_reduce_coalesced": ("all_reduce", "tensors"),
    "reduce": ("reduce", "tensor"),
    "broadcast": ("broadcast", "tensor"),
    "all_gather": ("all_gather", "tensor_list"),
    "all_gather_into_tensor": ("all_gather", "output_tensor"),
    "_all_gather_base": ("all_gather", "output_tensor"),
    "all_gather_coalesced": ("all_gather", "output_tensor_lists"),
    "all_gather_single": ("all_gather", "output_tensor"),          # torch 2.13's names, what FSDP2 calls
    "reduce_scatter_single": ("reduce_scatter", "input"),
    "reduce_scatter": ("reduce_scatter", "input_list"),
    "reduce_scatter_tensor": ("reduce_scatter", "input"),
    "_reduce_scatter_base": ("reduce_scatter", "input"),
    "all_to_all_single": ("all_to_all", "input"),
    "all_to_all": ("all_to_all", "input_tensor_list"),
}
# ZeRO paper accounting: an all-reduce is a reduce-scatter plus an all-gather of the same payload.
VOLUME_FACTOR = {"all_reduce": 2, "reduce_scatter": 1, "all_gather": 1, "reduce": 1, "broadcast": 1, "all_to_all": 1}


def payload_bytes(value) -> int:
    """Bytes of a tensor, or of every tensor in a (nested) list."""
    if isinstance(value, (list, tuple)):
        return sum(payload_bytes(v) for v in value)
    return value.numel() * value.element_size() if value is not None else 0


class CollectiveCounter:
    """Counts calls and payload bytes of torch.distributed collectives in this process, by kind.
    Only the outermost call counts: torch's own wrappers (e.g. _all_gather_base) call other collectives."""

    def __init__(self):
        self.pending: dict[str, dict] = {}
        self.totals: dict[str, dict] = {}
        self._originals: dict[str, object] = {}
        self._depth = threading.local()
        self._spans: dict[int, bool] = {}        # id(group) -> does it span nodes?

    def install(self) -> "CollectiveCounter":
        for name, (kind, argument) in COLLECTIVES.items():
            original = getattr(dist, name, None)
            if original is None or name in self._originals:
                continue
            self._originals[name] = original
            wrapper = self._wrap(original, kind, argument)
            for namespace in (dist, c10d):
                if getattr(namespace, name, None) is original:
                    setattr(namespace, name, wrapper)
        return self

    def uninstall(self):
        for name, original in self._originals.items():
            for namespace in (dist, c10d):
                if getattr(getattr(namespace, name, None), "__wrapped__", None) is original:
                    setattr(namespace, name, original)
        self._originals.clear()

    def _wrap(self, original, kind, argument):
        signature = inspect.signature(original)

        @functools.wraps(original)
        def counted(*args, **kwargs):
            depth = getattr(self._depth, "value", 0)
            if depth == 0:
                bound = signature.bind(*args, **kwargs)
                entry = self.pending.setdefault(kind, {"calls": 0, "bytes": 0})
                entry["calls"] += 1
                entry["bytes"] += payload_bytes(bound.arguments.get(argument))
                if self._across_nodes(bound.arguments.get("group")):
                    entry["bytes_across_nodes"] = (entry.get("bytes_across_nodes", 0)
                                                   + payload_bytes(bound.arguments.get(argument)))
            self._depth.value = depth + 1
            try:
                return original(*args, **kwargs)
            finally:
                self._depth.value = depth

        return counted

    def _across_nodes(self, group) -> bool:
        if id(group) not in self._spans:
            self._spans[id(group)] = spans_nodes(dist.get_process_group_ranks(group or dist.group.WORLD),
                                                 peers.local_world_size())
        return self._spans[id(group)]

    def take(self) -> dict:
        """What was counted since the last take() or drop(); it also adds to `totals`."""
        taken, self.pending = self.pending, {}
        for kind, entry in taken.items():
            total = self.totals.setdefault(kind, {"calls": 0, "bytes": 0})
            for field, value in entry.items():
                total[field] = total.get(field, 0) + value
        return taken

    def drop(self):
        """Forget what was counted since the last take(): labs' own bookkeeping, not training."""
        self.pending = {}


class Comm(Instrument):
    """Counts every collective of the run's steps; set-up traffic (the initial weights broadcast or partitioned)
    and labs' own per-step bookkeeping gather fall between steps and are dropped."""
    name = "comm"

    def __init__(self):
        self.counter = CollectiveCounter()

    def before_engine(self):
        self.counter.install()

    def step_begin(self):
        self.counter.drop()

    def step_end(self, record: dict):
        record["comm"] = self.counter.take()

    def summary(self) -> dict:
        return self.counter.totals


def spans_nodes(ranks, ranks_per_node: int) -> bool:
    """Do these global ranks sit on more than one node (node = rank // ranks_per_node)?"""
    return len({rank // ranks_per_node for rank in ranks}) > 1


# ---------------------------------------------------------------------------------------------- accounting
def volume_bytes(counts: dict) -> int:
    """The ZeRO paper's communication volume of some counted collectives (all-reduce counted twice)."""
    return sum(VOLUME_FACTOR[kind] * entry["bytes"] for kind, entry in counts.items())


def wire_bytes(counts: dict, world_size: int) -> float:
    """Bytes each rank sends with ring algorithms: (N-1)/N of the volume."""
    return volume_bytes(counts) * (world_size - 1) / world_size


def paper_volume_elements(stage: int, params: int) -> int:
    """Per rank per step, in elements (ZeRO paper, section 7): data parallelism all-reduces the gradients
    (2 Psi); ZeRO-1 and -2 reduce-scatter gradients and all-gather updated parameters (Psi + Psi); ZeRO-3
    all-gathers parameters for forward and again for backward and reduce-scatters gradients (3 Psi)."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, not {stage!r}")
    return (3 if stage == 3 else 2) * params


def per_step(records: list[dict], skip: int = 1) -> dict:
    """Mean counts per step from metrics records that carry "comm" (the first `skip` steps left out:
    the first ZeRO-3 step also records the order in which parameters are fetched)."""
    kept = [r["comm"] for r in records if "comm" in r][skip:] or [r["comm"] for r in records if "comm" in r]
    kinds = sorted({kind for counts in kept for kind in counts})
    fields = ("calls", "bytes") + (("bytes_across_nodes",) if any("bytes_across_nodes" in e for c in kept
                                                                    for e in c.values()) else ())
    return {kind: {field: sum(c.get(kind, {}).get(field, 0) for c in kept) / len(kept) for field in fields}
            for kind in kinds}


# ---------------------------------------------------------------------------------------------- ZeRO-3's gathers
def zero3_module_trace(dims: dict) -> list[list[tuple[str, int]]]:
    """The modules of a Qwen2 model that own parameters, in the order forward calls them and then backward (the
    reverse): DeepSpeed's ZeRO-3 trace of one step. Each module is its list of (parameter, elements); the tied
    head uses the embedding's parameter."""
    sizes = dict(zero_layout.param_layout(dims))
    forward = [["model.embed_tokens.weight"]]
    for i in range(dims["num_hidden_layers"]):
        p = f"model.layers.{i}."
        attention = [[p + f"self_attn.{x}_proj.weight", p + f"self_attn.{x}_proj.bias"] for x in "qkv"]
        forward += [[p + "input_layernorm.weight"], *attention, [p + "self_attn.o_proj.weight"],
                    [p + "post_attention_layernorm.weight"], [p + "mlp.gate_proj.weight"], [p + "mlp.up_proj.weight"],
                    [p + "mlp.down_proj.weight"]]
    forward += [["model.norm.weight"], ["model.embed_tokens.weight" if dims["tie_word_embeddings"] else "lm_head.weight"]]
    return [[(name, sizes[name]) for name in module] for module in forward + forward[::-1]]


def zero3_gathered_elements(dims: dict, reuse_distance: float, persistence_threshold: float) -> int:
    """Elements a ZeRO-3 rank all-gathers per step once DeepSpeed knows its trace, prefetching left out. A module's
    parameters are gathered when it runs unless still there; after it runs they are released unless a module
    within `reuse_distance` elements further down the trace uses them again (DeepSpeed 0.19's
    `PartitionedParameterCoordinator.__params_to_release`). Parameters of at most `persistence_threshold` elements
    are never released, but re-gathered once after every optimizer step (stage3.py `_post_step`). Chapter 2 checks
    this against the counted collectives of real runs."""
    trace = zero3_module_trace(dims)
    persistent = {name: n for module in trace for name, n in module if n <= persistence_threshold}
    available, gathered = set(), 0
    for i, module in enumerate(trace):
        for name, numel in module:
            if name not in persistent and name not in available:
                available.add(name)
                gathered += numel
        used_again, traversed = set(), 0
        for later in trace[i + 1:]:
            if traversed >= reuse_distance:
                break
            for name, numel in later:
                used_again.add(name)
                traversed += numel
        available -= {name for name, _ in module} - used_again
    return gathered + sum(persistent.values())
