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


def _cluster(nodes=4):
    return network.Cluster(gpus_per_node=8, nodes=nodes, intra_gbps=NVLINK_GBPS, inter_gbps=EIGHT_NICS_GBPS)


def _node_out_gb(scheme, nodes=4):
    return network.step_time(scheme, QWEN25_PARAMS, _cluster(nodes), compute_s=1.0)["node_out_bytes"] / 1e9


@exercise("06.1", "2 nodes x 8 GPUs, torchrun's static rendezvous: the RANK of the process with LOCAL_RANK 3 on "
          "the node started with --node-rank 1?", "", rel=0.0,
          hint="nodes are numbered first, then the processes within a node")
def _global_rank():
    return multinode.global_rank(node_rank=1, local_rank=3, nproc_per_node=8)


@exercise("06.2", f"DeepSpeed's launcher with the hostfile {HOSTFILE!r} and --exclude 'worker-1:3@worker-2:3': how "
          "many ranks does the job have?", "ranks", rel=0.0,
          hint="--exclude HOST:SLOT removes one slot of that host; @ separates hosts")
def _ranks_after_exclude():
    return sum(len(slots) for slots in multinode.hosts_in_use(HOSTFILE, exclude="worker-1:3@worker-2:3").values())


@exercise("06.3", "Qwen2.5-7B, ZeRO-3, 4 nodes x 8 GPUs: how many GB does each node send to the other nodes per "
          "step (one micro-batch)?", "GB", rel=0.05,
          hint="three collectives over all 32 ranks, each with the bf16 model as payload; a ring sends (N-1)/N "
               "of it out of each node")
def _zero3_node_out():
    return _node_out_gb("ZeRO-3")


@exercise("06.4", "Same cluster: by what factor does ZeRO++ with hpZ, qwZ and qgZ cut those bytes?", "x",
          rel=0.05, hint="hpZ keeps the backward all-gather in the node, qwZ halves the forward one (int8), qgZ "
                         "sends int4 gradients across nodes on 1/8 of the gradient per GPU")
def _zeropp_factor():
    return _node_out_gb("ZeRO-3") / _node_out_gb("ZeRO++ hpZ+qwZ+qgZ")


@exercise("06.5", "FSDP2 hybrid sharding (shard in the node, replicate across 4 nodes, fp32 gradient reduction): GB "
          "each node sends to the other nodes per step?", "GB", rel=0.05,
          hint="only the all-reduce of the fp32 gradient shards leaves the node: 8 groups of 4 ranks, each "
               "all-reducing 1/8 of the gradients (an all-reduce sends twice (N-1)/N)")
def _hsdp_node_out():
    return _node_out_gb("FSDP2 hybrid")
