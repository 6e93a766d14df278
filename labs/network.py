"""How long a training step's collectives take once the ranks span nodes: a small model to change and sweep.

    cluster = network.Cluster(gpus_per_node=8, nodes=4, intra_gbps=450, inter_gbps=400)
    network.collectives("ZeRO++ hpZ", params=7.6e9, cluster=cluster)     # what moves, over which group
    network.step_time("ZeRO-3", 7.6e9, cluster, compute_s=0.8)          # compute_s: the step without waiting

The schemes (bf16 parameters; fp32 master weights and Adam states stay on each rank's shard):
- ZeRO-3: every step all-gathers the parameters for forward and again for backward, and reduce-scatters the bf16
  gradients, each over all ranks.
- ZeRO++ hpZ: a secondary bf16 copy of the parameters, sharded within the node, serves every fetch after a
  parameter's first one of the step: the backward all-gather stays inside the node.
- ZeRO++ qwZ: the forward all-gather carries int8 weights (1 byte instead of 2; block scales neglected).
- ZeRO++ qgZ: gradients as int4 in two all-to-alls: within the node, then across nodes on 1/G of the gradient.
- FSDP2 hybrid (HSDP): shard within the node, replicate across nodes: all-gathers and the gradient reduce-scatter
  stay in the node; the gradient shards are all-reduced across nodes (one rank per node in each group). Gradients
  are reduced in `reduce_bytes` per element: fp32 by default (labs' MixedPrecisionPolicy, reduce_dtype=fp32), bf16
  halves both reductions (a setting: FSDP2 then sums in bf16, as ZeRO-3 does).

Bandwidths: `intra_gbps` is what one GPU sends within the node (GB/s, one direction: NVLink); `inter_gbps` is what one
node sends to the others (GB/s, the sum of its NICs: 8 x 400 Gb/s is 400 GB/s). The algorithms are rings (NCCL's),
one per NIC, ranks numbered node by node: a ring over every rank puts (N-1)/N of its payload on each GPU's link and,
summed over the node's NICs, the same amount on the node's way out, whatever the number of GPUs per node. A group
with one rank per node sends everything over the NICs, G such groups sharing them. A collective takes the longer of
its node's inter-node bytes / inter_gbps and a GPU's intra-node bytes / intra_gbps; latency is neglected (large
messages). The payloads are what labs.instruments.comm counts, so a run checks them (chapter 6).
"""
from __future__ import annotations

from dataclasses import dataclass

SCHEMES = ("ZeRO-3", "ZeRO++ hpZ", "ZeRO++ hpZ+qwZ", "ZeRO++ hpZ+qwZ+qgZ", "FSDP2 hybrid")
BF16, FP32, INT8, INT4 = 2, 4, 1, 0.5          # bytes per element


@dataclass(frozen=True)
class Cluster:
    gpus_per_node: int
    nodes: int
    intra_gbps: float                  # per GPU, within a node, one direction
    inter_gbps: float                  # per node, to the other nodes, one direction

    @property
    def world(self) -> int:
        return self.gpus_per_node * self.nodes


@dataclass(frozen=True)
class Collective:
    """One collective of a step, as one rank sees it."""
    what: str
    kind: str                          # all_gather | reduce_scatter | all_reduce | all_to_all
    payload_bytes: float               # the whole tensor it works on (what the comm counter counts)
    group: int                         # ranks in its group
    per_node: int                      # of those, ranks on one node
    gpus_per_node: int

    @property
    def across_nodes(self) -> bool:
        return self.group > self.per_node

    @property
    def gpu_bytes(self) -> float:
        """What one rank sends: (n-1)/n of the payload, twice for an all-reduce (reduce-scatter + all-gather)."""
        return (2 if self.kind == "all_reduce" else 1) * self.payload_bytes * (self.group - 1) / self.group

    @property
    def node_out_bytes(self) -> float:
        """What one node sends to other nodes: a ring spanning nodes sends what one rank sends, once per group
        running on the node (G / ranks of the group per node)."""
        return self.gpu_bytes * self.gpus_per_node / self.per_node if self.across_nodes else 0.0

    def seconds(self, cluster: Cluster) -> float:
        inter = self.node_out_bytes / (cluster.inter_gbps * 1e9)
        intra = self.gpu_bytes / (cluster.intra_gbps * 1e9) if self.per_node > 1 else 0.0
        return max(inter, intra)


def collectives(scheme: str, params: float, cluster: Cluster, regathered: float | None = None,
                reduce_bytes: float = FP32) -> list[Collective]:
    """The collectives of one optimizer step (one micro-batch) under `scheme`. `regathered`: parameters fetched
    again after their first fetch of the step (default `params`: every parameter once more for backward, as when
    a large model releases each layer after use; a tied embedding adds its second use). `reduce_bytes`: bytes per
    gradient element FSDP2 hybrid reduces in (FP32, labs' setting, or BF16)."""
    if scheme not in SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}; choose one of {', '.join(SCHEMES)}")
    g, world = cluster.gpus_per_node, cluster.world
    regathered = params if regathered is None else regathered

    def make(what, kind, payload, group, per_node):
        return Collective(what, kind, payload, group, per_node, g)

    if scheme == "FSDP2 hybrid":
        dtype = {FP32: "fp32", BF16: "bf16"}[reduce_bytes]
        return [make("all-gather bf16 parameters (first fetch)", "all_gather", BF16 * params, g, g),
                make("all-gather bf16 parameters (again)", "all_gather", BF16 * regathered, g, g),
                make(f"reduce-scatter {dtype} gradients", "reduce_scatter", reduce_bytes * params, g, g),
                make(f"all-reduce {dtype} gradient shards across nodes", "all_reduce", reduce_bytes * params / g,
                     cluster.nodes, 1)]
    hpz, qwz, qgz = "hpZ" in scheme, "qwZ" in scheme, "qgZ" in scheme
    found = [make("all-gather int8 parameters (first fetch)" if qwz else "all-gather bf16 parameters (first fetch)",
                  "all_gather", (INT8 if qwz else BF16) * params, world, g)]
    if hpz:
        found.append(make("all-gather bf16 from the node's secondary copy", "all_gather", BF16 * regathered, g, g))
    else:
        found.append(make("all-gather bf16 parameters (again)", "all_gather", BF16 * regathered, world, g))
    if qgz:
        found += [make("all-to-all int4 gradients within the node", "all_to_all", INT4 * params, g, g),
                  make("all-to-all int4 gradient shards across nodes", "all_to_all", INT4 * params / g,
                       cluster.nodes, 1)]
    else:
        found.append(make("reduce-scatter bf16 gradients", "reduce_scatter", BF16 * params, world, g))
    return [c for c in found if c.payload_bytes > 0 and c.group > 1]


def counted(found: list[Collective]) -> dict:
    """The collectives as labs.instruments.comm counts them: {kind: {"bytes", "bytes_across_nodes"}} per step."""
    kinds = {}
    for c in found:
        entry = kinds.setdefault(c.kind, {"bytes": 0.0, "bytes_across_nodes": 0.0})
        entry["bytes"] += c.payload_bytes
        entry["bytes_across_nodes"] += c.payload_bytes if c.across_nodes else 0.0
    return kinds


def step_time(scheme: str, params: float, cluster: Cluster, compute_s: float,
              regathered: float | None = None, reduce_bytes: float = FP32) -> dict:
    """Communication of one step per GPU, and the step time between perfect overlap with the `compute_s` seconds
    of computing (the longer of the two) and none (their sum)."""
    found = collectives(scheme, params, cluster, regathered, reduce_bytes)
    comm_s = sum(c.seconds(cluster) for c in found)
    return dict(scheme=scheme, nodes=cluster.nodes, gpus_per_node=cluster.gpus_per_node, comm_s=comm_s,
                compute_s=compute_s, overlapped_s=max(comm_s, compute_s), serial_s=comm_s + compute_s,
                node_out_bytes=sum(c.node_out_bytes for c in found), gpu_bytes=sum(c.gpu_bytes for c in found))


def sweep(params: float, gpus_per_node: int, nodes: list[int], intra_gbps: float, inter_gbps: float,
          compute_s: float, schemes=SCHEMES) -> list[dict]:
    """step_time for every scheme at every node count."""
    return [step_time(s, params, Cluster(gpus_per_node, n, intra_gbps, inter_gbps), compute_s)
            for s in schemes for n in nodes]
