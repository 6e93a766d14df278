"""`labs memory`: the memory calculator on the command line (a table, or JSON with --json).

    labs memory --preset qwen2.5-7b --stage 3 --gpus 2 --micro-batch 2 --gpu-memory H200
    labs memory --params 7.5e9 --stage 2 --gpus 8 --json
"""
from __future__ import annotations

import json

from labs import config, models
from labs.table import Table
from labs.errors import LabsError, positive_int
from labs.memory.accounting import OPTIMIZERS
from labs.memory.advise import advise
from labs.memory.estimate import MemoryEstimate, estimate
from labs.memory.units import GB, GPUS, GiB, flag_bytes


def add_parser(sub):
    p = sub.add_parser("memory", help="predict memory per GPU and per host (and whether it fits)")
    p.add_argument("--preset", help=" | ".join(models.PRESETS))
    p.add_argument("--params", help="a parameter count instead of a preset, e.g. 7.5e9 (model states only)")
    p.add_argument("--stage", type=int, choices=(0, 1, 2, 3), help="ZeRO stage (default: the --config's, else 3)")
    p.add_argument("--gpus", type=positive_int, default=1, help="GPUs per node (default: 1)")
    p.add_argument("--nodes", type=positive_int, default=1, help="nodes (default: 1)")
    p.add_argument("--precision", help="bf16 | fp16 | fp32 (default: the --config's, else bf16)")
    p.add_argument("--offload-optimizer", help="none | cpu | nvme (default: the --config's, else none)")
    p.add_argument("--offload-param", help="none | cpu | nvme, ZeRO-3 only (default: the --config's, else none)")
    p.add_argument("--micro-batch", type=positive_int,
                   help="sequences per GPU per step (default: the --config's, else what `labs train` uses)")
    p.add_argument("--grad-accum", type=positive_int,
                   help="micro-batches per optimizer step (default: the --config's, else 1); with optimizer offload "
                        "under ZeRO-1/2 more than 1 keeps every gradient on the host between micro-batches")
    p.add_argument("--seq-len", type=positive_int, help="tokens per sequence (default: what `labs train` uses for "
                                                        "the preset)")
    p.add_argument("--activation-checkpointing", default="none", help="none | full | number of layers")
    p.add_argument("--loss", default="hf", help="hf | chunked | liger")
    p.add_argument("--kernels", default="stock", help="stock | liger")
    p.add_argument("--optimizer", default="adamw", help=" | ".join(OPTIMIZERS))
    p.add_argument("--engine", default="deepspeed", help="deepspeed | fsdp2")
    p.add_argument("--config", help="a DeepSpeed JSON config for bucket sizes, prefetch, persistence ...")
    p.add_argument("--gpu-memory", help=f"memory of one GPU for a verdict: 80GiB, 141GB or {', '.join(GPUS)}")
    p.add_argument("--host-pinning", default="torch",
                   help="torch (default: a GPU host; each pinned offload buffer takes a power of two) | exact "
                        "(DS_PIN_MEMORY_BACKEND=native, or CPU ranks)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--plan", type=positive_int, nargs="?", const=10, default=None, metavar="N",
                   help="instead: rank every configuration that fits --gpu-memory on --gpus by predicted speed "
                        "(labs.bench.planner, calibrated on results/gpu) and show the best N (default 10)")
    p.add_argument("--host-memory", help="host memory per node (e.g. 256GiB), checked against the prediction's (with "
                                         "--plan: against each offload setup's, where nothing fits without offload)")
    p.add_argument("--batch-per-gpu", type=positive_int, default=8,
                   help="with --plan: sequences per GPU per optimizer step, micro-batch x accumulation (default: 8)")


def run(args) -> int:
    if (args.preset is None) == (args.params is None):
        raise LabsError(f"give exactly one of --preset ({', '.join(models.PRESETS)}) and --params (e.g. 7.5e9)")
    host = host_bytes(args.host_memory)
    flag_bytes("--gpu-memory", args.gpu_memory)                  # checked, the flag named, before any estimate
    ds_config = config.load(args.config) if args.config else None
    checkpointing = args.activation_checkpointing
    est = estimate(args.preset, params=args.params, stage=args.stage, gpus_per_node=args.gpus, nodes=args.nodes,
                   precision=args.precision, offload_optimizer=args.offload_optimizer,
                   offload_param=args.offload_param, micro_batch=args.micro_batch, grad_accum=args.grad_accum,
                   seq_len=args.seq_len,
                   activation_checkpointing=int(checkpointing) if checkpointing.isdigit() else checkpointing,
                   loss=args.loss, kernels=args.kernels, optimizer=args.optimizer, ds_config=ds_config,
                   engine=args.engine, host_pinning=args.host_pinning)
    advice = advise(args.gpu_memory, **est.inputs) if args.gpu_memory else None
    # the host a node needs: an offloaded optimizer's, or a start-up flatten DeepSpeed makes on the CPU, if larger
    host_need = max(est.host_per_node_bytes, est.start_up_host_per_node_bytes_on(args.gpu_memory) if args.gpu_memory
                    else 0)
    if args.json:
        out = est.as_dict()
        out["total_per_gpu_gib"] = est.total_per_gpu_bytes / GiB
        if advice:
            out["verdict"] = advice.as_dict()
            out["fits"] = advice.fits_as_is
        if host is not None:
            out["host_need_per_node_bytes"], out["host_fits"] = host_need, host_need <= host
        print(json.dumps(out, indent=1, default=str))
    else:
        print(format_table(est, advice))
        if host is not None:
            verdict = "fits" if host_need <= host else "does not fit"
            print(f"host: {host_need / GiB:.1f} GiB per node {verdict} {host / GiB:.1f} GiB "
                  "(the system and the data loader come on top)")
    return 0


def host_bytes(host_memory: str | None) -> int | None:
    """--host-memory, parsed, the flag named where it is wrong."""
    return flag_bytes("--host-memory", host_memory)


def format_table(est: MemoryEstimate, advice=None) -> str:
    """The estimate as a readable table (GiB = 2^30 bytes; the paper's GB are 10^9 bytes)."""
    i = est.inputs
    offload = ", ".join(f"{part} offload {i[f'offload_{part}']}" for part in ("optimizer", "param")
                        if i[f"offload_{part}"]) or "no offload"
    rows = [("parameters", f"{est.params:,}"),
            ("setup", f"{'FSDP2' if i['engine'] == 'fsdp2' else 'ZeRO-' + str(i['stage'])}, {i['gpus_per_node']} "
                      f"GPU(s) x {i['nodes']} node(s), {i['precision']}, {offload}"),
            ("batch", f"micro-batch {i['micro_batch']} x seq {i['seq_len']}, checkpointing "
                      f"{i['activation_checkpointing']}, loss {i['loss']}, kernels {i['kernels']}"),
            ("paper model states / GPU", _size(est.paper_model_states_per_gpu_bytes)),
            ("DeepSpeed model states / GPU", _size(est.model_states_per_gpu_bytes)),
            (f"peak / GPU (at {est.peak_phase})", _size(est.total_per_gpu_bytes)),
            ("  parameters", _size(est.params_per_gpu_bytes)), ("  gradients", _size(est.grads_per_gpu_bytes)),
            ("  optimizer states", _size(est.optimizer_per_gpu_bytes)),
            ("  activations + loss", _size(est.activations_per_gpu_bytes)),
            ("  FSDP2 buffers (gathered layers, reduce inputs)" if i["engine"] == "fsdp2" else "  DeepSpeed buffers",
             _size(est.buffers_per_gpu_bytes)),
            ("host / node (offload)", _size(est.host_per_node_bytes))]
    if est.nvme_per_node_bytes:
        rows.append(("NVMe / node", _size(est.nvme_per_node_bytes)))
    if advice is not None:
        rows.append(("verdict", str(advice)))
    rows += [("note", note) for note in est.notes]
    return str(Table([dict(quantity=k, value=v) for k, v in rows]))


def _size(n) -> str:
    return f"{n / GiB:>9,.2f} GiB  ({n / GB:,.2f} GB)"
