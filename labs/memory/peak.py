"""The peak of `torch.cuda.max_memory_allocated` through a training step, moment by moment.

A step passes through moments where different things are alive; the peak is the largest of them:
- init: ZeRO-0/1/2 copy the model into one flat buffer while the original tensors still exist. ZeRO-1/2 make that
  copy on the CPU when it exceeds the card's total memory, and then this moment decides no fit verdict
  (labs.memory.fit).
- loss_backward: every saved activation plus the loss at its worst (stock loss: three fp32 [tokens, vocab]
  tensors inside log_softmax's backward); no gradient exists yet (ZeRO-3 keeps its gradient buffer), unless
  an earlier micro-batch of the same step left its gradients (ZeRO-0/1: every p.grad, and ZeRO-1's reduce buckets;
  ZeRO-2: its partition buffer).
  ZeRO-3 still holds lm_head gathered: it is reused within `stage3_max_reuse_distance`.
- layer_backward: the last decoder layer's backward: its activations (recomputed if checkpointed) and
  gradient temporaries, the head's gradient, DeepSpeed's reduce buckets (ZeRO-1/2) or the gathered layer
  (ZeRO-3).
- first_reduce (ZeRO-2, one micro-batch per step): the gradient partition appears when the first reduce bucket
  fills, some layers into backward; those layers' activations are freed by then (round 8's allocator record).
- backward_end: every gradient this stage keeps (ZeRO-0/1: all of them, before the reduction frees the
  others' shares), plus the embedding's dense gradient gathered at ZeRO-3. FSDP2: the first layer's backward,
  with every later layer's gradient shard and that layer's activations (round 8's allocator record).
- root_reduce (FSDP2): the root's reduction, last of all: every gradient shard and the root's unsharded fp32
  reduce-scatter input, no activation (round 9's record: the peak when the root is large and activations small).
- optimizer_step: the gradient partition flattened and copied to fp32 for the update (ZeRO-1/2: the whole
  partition; ZeRO-3: one sub-group at a time; ZeRO-0: FP16_Optimizer's fp32 copies).
Each moment is split into params, grads, optimizer (states + fp32 master), activations and buffers (what
DeepSpeed allocates for a while: buckets, gathered parameters, copies). All bytes are on the GPU of the
worst rank; offloaded states count on the host instead.
"""
from __future__ import annotations

from labs.memory import host as host_bytes
from labs.memory import layout as zero_layout


def deepspeed(params, layout, dims, stage, world, d, mixed, state_bytes, offload_optimizer, offload_param, knobs,
              acts, accumulation=1, pinned_rounding=False, zenflow=None, zenflow_columns="labs", zenflow_moment_sets=1):
    """Returns (phases, resident_per_rank, host_bytes_per_rank, nvme_bytes_per_rank). With gradient accumulation
    the gradients of the earlier micro-batches stay on the GPU through the later ones' forward and backward.
    `pinned_rounding`: the host buffers DeepSpeed pins take a power of two each (PyTorch's pinned allocator, GPUs).
    `zenflow`: the config's `zero_optimization.zenflow` block, or None (labs.memory.host.offloaded_optimizer counts
    its host side); `zenflow_columns` how it keeps the columns it updates on the GPU, `zenflow_moment_sets` how many
    sets of Adam moments its overlapped optimizer process keeps (labs.memory.estimate)."""
    # ---- what each rank holds for good once the first step has run
    master = 4 if (mixed or stage >= 1) else 0                 # fp32 ZeRO-1/2/3 still clone an fp32 partition
    bucket = reduce_bucket_bytes(knobs, d, stage=3)            # ZeRO-3's one contiguous gradient bucket
    if stage == 3:
        z3 = zero_layout.zero3_partition(layout, world, knobs["stage3_param_persistence_threshold"],
                                    knobs["sub_group_size"])
        partition = z3["partition"]
        params_rank = d * (partition + z3["persistent"])       # ds_tensor partitions + small params kept whole
        # ZeRO++ hpZ: a secondary copy of the partitioned parameters, sharded within groups of this many ranks
        # (ds_secondary_tensor; chapter 7 measured it: 1.25x labs.memory's count before it was counted)
        hpz = int(knobs.get("zero_hpz_partition_size") or 1)
        if hpz > 1:
            params_rank += d * -(-partition * world // hpz)
        grads_rank = [d * partition + bucket] * world
    elif stage in (1, 2):
        partition = zero_layout.zero12_partition(params, world)   # slice of the flat buffer (padded to 2 x world)
        params_rank = d * partition * world
        # with only a parameter count, assume parameters small enough that each rank holds ~its slice
        held = zero_layout.zero12_grad_elements(layout, world) if dims else [partition] * world
        grads_rank = [d * n for n in held]
    else:
        partition, params_rank = params, d * params
        grads_rank = [d * params] * world
    optimizer_rank = master * partition + state_bytes * partition / params
    worst = max(range(world), key=lambda r: grads_rank[r])

    params_gpu = params_rank
    if offload_param:
        params_gpu = d * z3["persistent"]
    # ZeRO-3 partial offload (offload_optimizer.ratio < 1): the first sub-groups stay on the GPU, whole
    on_gpu = zero_layout.zero3_gpu_sub_groups(z3, knobs) if offload_optimizer and stage == 3 else []
    gpu_share = sum(on_gpu) / partition if on_gpu else 0.0
    optimizer_gpu = gpu_share * optimizer_rank if offload_optimizer else optimizer_rank
    if zenflow and dims and stage in (1, 2):
        # ZenFlow's GPU Adam for the top-k columns it updates every step; counted whole on every rank (DeepSpeed's
        # bf16 moments measured on one GPU, round 15: to the byte; with more ranks an upper bound, not measured)
        # labs.zenflow_columns: an fp32 master and two fp32 moments; DeepSpeed alone (or with `zenflow.offload`, which
        # labs leaves to it): two moments in the parameters' dtype
        per_element = 4 + 4 + 4 if zenflow_columns == "labs" and not zenflow.get("offload") else 2 * d
        optimizer_gpu += per_element * zero_layout.zenflow_selected_elements(dims, zenflow.get("topk_ratio", 0.1))
    host, nvme, staging_gpu = host_bytes.offloaded_optimizer(
        layout, dims, stage, d, partition, optimizer_rank, offload_optimizer, z3 if stage == 3 else None, knobs,
        world, gpu_share, pinned_rounding, accumulation, zenflow, zenflow_moment_sets)
    if offload_param:
        if offload_param == "nvme":
            nvme += params_rank
            host += 5 * d * 1e8                                 # offload_param's default swap buffers: 5 x 1e8
        else:
            host += params_rank
    resident = [dict(rank=r, params_bytes=int(params_rank), grads_bytes=int(grads_rank[r]),
                     optimizer_bytes=int(optimizer_rank)) for r in range(world)]

    # ---- gradients on this GPU at each moment
    grads_kept = grads_rank[worst]
    # ZeRO-2 with one micro-batch per step: decoder layers backward finishes before its partition exists (see there)
    before_reduce = layers_before_first_reduce(acts, dims, knobs) if stage == 2 and accumulation == 1 else 0
    if stage == 3:
        # partial offload: DeepSpeed moves a GPU sub-group's fp32 gradient to the GPU (stage3.py, `.grad = ...to(`)
        kept_on_gpu = bucket + gpu_share * 4 * partition if offload_optimizer else grads_kept
        grads = dict(loss=kept_on_gpu, layer=kept_on_gpu, end=kept_on_gpu, step=kept_on_gpu)
    elif stage == 2:
        # the partition's gradient buffer lives from the first backward to the step: with accumulation it is
        # already there when a later micro-batch's loss peaks (runs f and x: +7.1 GiB per GPU for the 7B on two GPUs,
        # +5.8 GiB for the 3B on one; tests/test_memory.py measures it on a CPU engine); under offload the earlier
        # micro-batches' gradients wait on the host
        kept_on_gpu = 0 if offload_optimizer else grads_kept
        grads = dict(loss=kept_on_gpu if accumulation > 1 else 0, layer=kept_on_gpu, end=kept_on_gpu, step=kept_on_gpu)
        if before_reduce:
            grads["layer"] = 0     # the buffer is allocated by the first bucket's reduction: not yet there
    else:                                                      # ZeRO-0/1: p.grad of every parameter
        head_grad = d * acts["head"]
        after = 0 if offload_optimizer else grads_kept
        accumulated = d * params if accumulation > 1 else 0    # p.grad accumulates until the boundary's reduction
        grads = dict(loss=accumulated, layer=max(head_grad, accumulated), end=d * params,
                     step=d * params if stage == 0 else after)

    # ---- DeepSpeed's temporary buffers at each moment
    reduce_buckets = reduce_bucket_bytes(knobs, d) if stage in (1, 2) else 0
    gathered_head = gathered_layer = gathered_embedding = 0
    if stage == 3 and world > 1:
        live, prefetch = knobs["stage3_max_live_parameters"], knobs["stage3_prefetch_bucket_size"]
        gathered_head = d * _gathered(acts["head"], live, prefetch)
        gathered_layer = d * _gathered(acts["layer_params"], live, prefetch)
        gathered_embedding = 2 * d * acts["head"]               # gathered weight + its dense gradient
    elif stage == 3:
        # one rank holds every parameter whole: DeepSpeed gathers nothing (partition_parameters.py returns
        # `_no_gather_coalesced` when every partition's world is 1; round 8's allocator record shows no gathered
        # block at the peak); the embedding's dense gradient remains
        gathered_embedding = d * acts["head"]
    if offload_optimizer:
        step_copies = (d + 4) * max(on_gpu, default=0)         # the update runs on the host, but for on_gpu
    elif stage == 3:
        step_copies = (d + 4) * z3["largest_sub_group"]        # flatten (bf16) then .to(fp32), per sub-group
    elif stage in (1, 2):
        step_copies = (d + 4) * partition
    else:
        step_copies = 8 * params if mixed else 0               # FP16_Optimizer: fp32 copy of each grad + flat copy
    allreduce_bucket = d * min(params, 5e8) if stage == 0 else 0
    # ZeRO-1 reduces only at the accumulation boundary: the buckets its hooks set up in the first backward stay
    # allocated until then, so a later micro-batch's loss peaks on top of them (measured on a CPU engine)
    kept_buckets = reduce_buckets if stage == 1 and accumulation > 1 else 0

    # ---- activations
    saved, loss = acts["saved"] + acts["final_norm"], acts["loss"]
    recompute = _recompute(acts)

    base = dict(params=params_gpu, optimizer=optimizer_gpu)
    phases = {
        "init": dict(params=params_gpu, optimizer=0, grads=0, activations=0,
                     buffers=d * params if stage in (1, 2) else 2 * d * params if stage == 0 else 0),
        "loss_backward": dict(base, grads=grads["loss"], activations=saved + loss,
                              buffers=staging_gpu + gathered_head + kept_buckets),
        "layer_backward": dict(base, grads=grads["layer"], activations=acts["saved"] + recompute + acts["temporaries"],
                               buffers=staging_gpu + reduce_buckets + gathered_layer),
        "backward_end": dict(base, grads=grads["end"], activations=0,
                             buffers=staging_gpu + reduce_buckets + allreduce_bucket + gathered_embedding),
        "optimizer_step": dict(base, grads=grads["step"], activations=0, buffers=staging_gpu + step_copies),
    }
    if before_reduce and grads["end"]:
        phases["first_reduce"] = dict(base, grads=grads["end"], activations=_activations_after(acts, before_reduce),
                                      buffers=staging_gpu + reduce_buckets)
    return phases, resident, host, nvme


def _gathered(module: int, live: float, prefetch: float) -> float:
    """Elements gathered while a ZeRO-3 module computes: the module itself, always (DeepSpeed 0.19.8 never releases a
    parameter early to honour `stage3_max_live_parameters`), plus what it prefetches for the next modules: about
    prefetch_bucket_size elements (DeepSpeed checks the bound before adding each parameter, so it can pass it by one
    parameter; not modelled), and no more than the live limit leaves above what is already gathered
    (partitioned_param_coordinator.py, `max_params_to_prefetch`). Chapter 2 measured live=1: the same peak as
    prefetching off."""
    return module + min(prefetch, max(0, live - module))


def layers_before_first_reduce(acts, dims, knobs) -> int:
    """ZeRO-2 (one micro-batch per step) allocates its gradient partition when the first reduce bucket fills. Backward
    meets the untied head first (a tied head's gradient is complete only at the embedding, at the very end), then
    the final norm, then the decoder layers from the last: the decoder layers whose backward ends before a bucket of
    reduce_bucket_size elements is full. 0: the bucket is full before the first decoder layer's backward ends. Round 8
    measured it (labs ZeRO-2 on the 3B, tied, 1e9-element buckets: no partition at the peak, 13 layers in)."""
    if not dims or not knobs["contiguous_gradients"]:
        return 0
    first = (0 if dims["tie_word_embeddings"] else acts["head"]) + dims["hidden_size"]
    return max(0, -(-int(knobs["reduce_bucket_size"] - first) // acts["layer_params"]))


def _activations_after(acts, done: int) -> int:
    """The saved activations left when backward has finished the last `done` decoder layers (the kept-whole layers
    come last in the model, so backward frees them first), plus the next layer's backward temporaries."""
    layers, checkpointed = acts["layers"], acts["checkpointed"]
    whole = min(done, layers - checkpointed)
    freed = whole * acts["layer"] + (min(done, layers) - whole) * acts["layer_input"]
    following_recomputes = done < layers and layers - done <= checkpointed
    return acts["saved"] - freed + acts["temporaries"] + (acts["layer"] if following_recomputes else 0)


def reduce_bucket_bytes(knobs: dict, dtype_bytes: int, stage: int = 2) -> int:
    """The contiguous gradient buckets during backward. ZeRO-1/2: one of reduce_bucket_size elements, a second
    with overlap_comm (one fills while the other reduces), none without contiguous_gradients (chapter 2 measures
    all three cases on a live engine). ZeRO-3 allocates one bucket whatever overlap_comm says (stage3.py,
    `ipg_buckets`), also none without contiguous_gradients."""
    if not knobs["contiguous_gradients"]:
        return 0
    copies = 2 if knobs["overlap_comm"] and stage in (1, 2) else 1
    return int(copies * knobs["reduce_bucket_size"] * dtype_bytes)


def fsdp2(params, layout, dims, stage, world, d, mixed, state_bytes, offload_optimizer, offload_param, knobs, acts,
          settings=None, accumulation=1):
    """FSDP2 (`fully_shard` per decoder layer and on the root), approximated: fp32 sharded parameters,
    gradients and Adam states (16 bytes per parameter / shard group); bf16 copies of the current and the
    prefetched layer during compute; the root's embedding and head gathered through forward and backward.
    `settings` is the config's "fsdp" block (labs.fsdp.settings): `replicas` groups each hold a full sharded copy
    (the shard group is world / replicas ranks); offload "cpu" moves the shards and the optimizer to the host;
    reshard_after_forward false (or k) keeps every layer's gathered parameters (or a 1/k slice) from forward to
    backward. Backward has two candidate peaks: its start (every saved activation, almost no gradient) and its end
    (every layer's gradient shard but the first layer's, that layer's activations). With gradient accumulation the
    fp32 gradient shards of the earlier micro-batches stay through the later ones' forward and backward (FSDP2
    accumulates into them): measured on 2 x H200, +14 GiB at Qwen2.5-7B."""
    settings = settings or {"reshard_after_forward": True, "offload": "none", "replicas": 1}
    shard = -(-params // (world // settings["replicas"]))
    on_host = settings["offload"] == "cpu"
    params_gpu = 0 if on_host else 4 * shard
    optimizer_gpu = 0 if on_host else state_bytes * shard / params
    layer = 2 * d * acts["layer_params"]                       # current + prefetched layer, unsharded
    root = d * acts["head"] * (1 if dims and dims["tie_word_embeddings"] else 2)
    reshard = settings["reshard_after_forward"]
    kept = 0 if reshard is True else d * acts["layer_params"] * acts["layers"] / (1 if reshard is False else reshard)
    saved = acts["saved"] + acts["final_norm"]
    recompute = _recompute(acts)
    base = dict(params=params_gpu, optimizer=optimizer_gpu)
    # FSDP2 allocates each layer's sharded fp32 gradient when that layer's backward reduce-scatters it (and
    # zero_grad(set_to_none) frees them all after the step), unlike DeepSpeed's gradient buffers that exist for
    # the whole step. So early in backward almost no gradient exists yet and nearly all activations still do.
    group = world // settings["replicas"]
    layer_grad_shard = 0 if on_host else 4 * acts["layer_params"] / group
    accumulated = 4 * shard if accumulation > 1 and not on_host else 0
    # The other end of backward (the first layer's backward, the last one it meets): every later layer's gradient
    # shard exists by then, while the root's (embedding, head, final norm) come only after it, and the head's
    # unsharded gradient waits for them. Measured with the peak_allocations instrument on one H200 (round 8): at
    # Qwen2.5-7B, micro-batch 8, every layer checkpointed, this is the peak, 6 GiB above the optimizer step.
    root_params = acts["head"] * (1 if dims and dims["tie_word_embeddings"] else 2) + (dims or {}).get("hidden_size", 0)
    later_layers = 0 if on_host else 4 * (params - root_params - acts["layer_params"]) / group
    phases = {
        "loss_backward": dict(base, grads=accumulated, activations=saved + acts["loss"], buffers=root + kept),
        "layer_backward": dict(base, grads=accumulated + layer_grad_shard,
                               activations=acts["saved"] + recompute + acts["temporaries"],
                               buffers=root + kept + layer + (d + 4) * acts["layer_params"]),  # + its unsharded grad
        "backward_end": dict(base, grads=max(accumulated, later_layers),
                             activations=acts["layer"] + acts["temporaries"],
                             # the gathered layer and its fp32 reduce-scatter input; the head's unsharded gradient
                             buffers=root + kept + (d + 4) * acts["layer_params"] + d * acts["head"]),
        # The root's own reduction, the last of backward: every gradient shard exists (the root's is being
        # allocated), and so does the root's unsharded fp32 reduce-scatter input; its gathered parameters and bf16
        # gradient are freed by then. With accumulation the new shard is added to the kept one, so both exist.
        # Measured (round 9): stock FSDP2 at Qwen2.5-7B, micro-batch 2, whose untied 1.09 B-parameter root makes
        # this the peak, 117.6 GiB replayed against 117.5 here.
        "root_reduce": dict(base, grads=0 if on_host else 4 * shard + (4 * root_params / group if accumulation > 1 else 0),
                            activations=0, buffers=4 * root_params),
        "optimizer_step": dict(base, grads=0 if on_host else 4 * shard, activations=0, buffers=0),
    }
    resident = [dict(rank=r, params_bytes=int(4 * shard), grads_bytes=int(4 * shard),
                     optimizer_bytes=int(state_bytes * shard / params)) for r in range(world)]
    host = (8 * shard + state_bytes * shard / params) if on_host else 0
    return phases, resident, host, 0


def _recompute(acts) -> int:
    """labs checkpoints the first k layers; backward meets them last, when the later layers' activations are
    already freed. So recomputing a layer adds to the peak only when every layer is checkpointed."""
    return acts["layer"] if acts["checkpointed"] and acts["checkpointed"] == acts["layers"] else 0
