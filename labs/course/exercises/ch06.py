"""Chapter 06 (multi-node): exercises. Expected answers come from labs' launcher rules (labs.multinode, DeepSpeed's own
hostfile parser) and its communication model (labs.network), which the chapter checks against counted bytes."""
from __future__ import annotations

from labs import models, multinode, network
from labs.course.exercises.registry import exercise

QWEN25_PARAMS = models.param_counts(models.shape("qwen2.5-7b"))["total"]
HOSTFILE = "worker-1 slots=4\nworker-2 slots=4\n"
# Nominal link rates (specifications, not measurements): NVLink 4 sends 450 GB/s per GPU each way; a node with
# eight 400 Gb/s NICs sends 400 GB/s.
NVLINK_GBPS, EIGHT_NICS_GBPS = 450, 400


# The cluster of exercises 06.3-06.5, one the chapter never prints: 3 nodes of 4 GPUs.
NODES, GPUS_PER_NODE = 3, 4


def _node_out_gb(scheme):
    cluster = network.Cluster(GPUS_PER_NODE, NODES, intra_gbps=NVLINK_GBPS, inter_gbps=EIGHT_NICS_GBPS)
    return network.step_time(scheme, QWEN25_PARAMS, cluster, compute_s=1.0)["node_out_bytes"] / 1e9


@exercise("06.1", "A Slurm job of 4 nodes x 8 GPUs (labs train --slurm, torchrun's static rendezvous) fails with "
          "'rank 19 exited with code 1'. One node's labs train prints that rank's traceback: the one started with "
          "--node-rank K. What is K?", "", rel=0.0,
          hint="nodes are numbered first, then the processes within a node; node K's ranks are consecutive")
def _node_of_rank():
    node, = {n for n in range(4) for local in range(8) if multinode.global_rank(n, local, 8) == 19}
    return node


@exercise("06.2", f"DeepSpeed's launcher with the hostfile {HOSTFILE!r} and --exclude 'worker-1:3@worker-2:3': how "
          "many ranks does the job have?", "ranks", rel=0.0,
          hint="--exclude HOST:SLOT removes one slot of that host; @ separates hosts")
def _ranks_after_exclude():
    return sum(len(slots) for slots in multinode.hosts_in_use(HOSTFILE, exclude="worker-1:3@worker-2:3").values())


@exercise("06.3", f"Qwen2.5-7B, ZeRO-3, {NODES} nodes x {GPUS_PER_NODE} GPUs: how many GB does each node send to "
          "the other nodes per step (one micro-batch)?", "GB", rel=0.01,
          hint=f"three collectives over all {NODES * GPUS_PER_NODE} ranks, each with the bf16 model "
               f"({2 * QWEN25_PARAMS / 1e9:.2f} GB) as payload; a ring spanning nodes sends (N-1)/N of it out of "
               "each node, whatever the GPUs per node")
def _zero3_node_out():
    return _node_out_gb("ZeRO-3")


@exercise("06.4", "Same cluster: by what factor does ZeRO++ with hpZ, qwZ and qgZ cut those bytes?", "x",
          rel=0.01, hint="hpZ keeps the backward all-gather in the node, qwZ sends the forward one as int8 over all "
                         f"{NODES * GPUS_PER_NODE} ranks, qgZ sends int4 gradients across the {NODES} nodes (each "
                         "node's G groups together carry the whole int4 gradient once, (n-1)/n of it leaving)")
def _zeropp_factor():
    return _node_out_gb("ZeRO-3") / _node_out_gb("ZeRO++ hpZ+qwZ+qgZ")


@exercise("06.5", f"FSDP2 hybrid sharding (shard in the node, replicate across the {NODES} nodes, fp32 gradient "
          "reduction, labs' setting), same cluster: GB each node sends to the other nodes per step?", "GB",
          rel=0.01, hint="only the all-reduce of the fp32 gradient shards leaves the node: G groups of one rank per "
                         "node, each all-reducing 1/G of the gradients; an all-reduce sends twice (n-1)/n")
def _hsdp_node_out():
    return _node_out_gb("FSDP2 hybrid")
