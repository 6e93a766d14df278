"""`labs autotune` and `labs memory --plan`: their command lines (labs.cli adds them; labs.bench.autotune,
labs.bench.planner and labs.bench.offload_plan do the work)."""
from __future__ import annotations

from labs import resolve
from labs.bench import autotune, offload_plan, planner
from labs.errors import LabsError, positive_int
from labs.memory import cli as memory_cli
from labs.table import Table


def add_autotune_parser(sub):
    p = sub.add_parser("autotune", help="DeepSpeed's autotuner over ZeRO stages and micro-batches, on labs' loop",
                       description="Run DeepSpeed's autotuner (deepspeed --autotuning tune) with labs' training loop: "
                                   "every candidate trains --batch-per-gpu sequences per GPU per optimizer step.")
    p.add_argument("--preset", default="tiny", help="(default: tiny)")
    p.add_argument("--config", default=resolve.DEFAULT_CONFIG, help="the DeepSpeed config the candidates start from")
    p.add_argument("--stages", default="2,3", help="ZeRO stages to try, comma-separated (default: 2,3)")
    p.add_argument("--micro-batches", default="1,2,4,8", help="micro-batches to try (default: 1,2,4,8)")
    p.add_argument("--batch-per-gpu", type=positive_int, default=8,
                   help="sequences per GPU per optimizer step; each micro-batch must divide it (default: 8)")
    p.add_argument("--nproc", type=positive_int, help="ranks per experiment (default: every GPU, or 2 CPU ranks)")
    p.add_argument("--seq-len", type=positive_int, help="(default: the preset's)")
    p.add_argument("--loss", default="hf", help="hf | chunked | liger (default: hf)")
    p.add_argument("--kernels", default="stock", help="stock | liger (default: stock)")
    p.add_argument("--activation-checkpointing", default="none", help="none | full | k layers (default: none)")
    p.add_argument("--stock", action="store_true", help="the stock HF model: HF's own gradient checkpointing")
    p.add_argument("--gpu-memory", help="cap each rank's GPU memory, e.g. 80GiB or H100 (default: the whole GPU); "
                                        "the autotuner's own memory model still sees the whole card")
    p.add_argument("--out", default="runs/autotune", help="folder to write (default: runs/autotune)")


def _int_list(flag: str, text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise LabsError(f"{flag} {text!r}: give whole numbers separated by commas, e.g. 1,2,4") from None


def run_autotune(args) -> int:
    found = autotune.run(preset=args.preset, config=args.config, stages=_int_list("--stages", args.stages),
                         micro_batches=_int_list("--micro-batches", args.micro_batches),
                         batch_per_gpu=args.batch_per_gpu, nproc=args.nproc, out=args.out, seq_len=args.seq_len,
                         loss=args.loss, kernels=args.kernels, gpu_memory=args.gpu_memory,
                         activation_checkpointing=args.activation_checkpointing, stock=args.stock)
    print(autotune.table(found))
    print(f"done: the autotuner picked {found['pick']} after {len(found['experiments'])} experiments and its "
          f"model-info run, {found['seconds']:.0f} s in all; folder {args.out}")
    return 0


def run_plan(args) -> int:
    """`labs memory --plan N`: the N fastest candidates that fit, by the step-time model; where none fits without
    offload, what fits with it and the host memory each needs."""
    preset, card, seq_len = args.preset or "qwen2.5-7b", args.gpu_memory or "H200", args.seq_len or 4096
    host = memory_cli.host_bytes(args.host_memory)        # checked before any work
    host = host / 2**30 if host is not None else None
    if args.gpu_memory is None:   # most readers plan for 80 GB cards: a silent H200 answer would mislead them
        print("no --gpu-memory given: planning for H200 cards (141 GB); for an 80 GB card pass --gpu-memory H100 "
              "(or 80GiB)")
    plans = planner.plan(preset, gpus=args.gpus, gpu_memory=card, batch_per_gpu=args.batch_per_gpu, seq_len=seq_len)
    if plans:
        print(Table(plans[:args.plan], ["side", "case", ("predicted peak GiB", "predicted_peak_gib", ".1f"),
                                        ("predicted tokens/s/GPU", "predicted_tokens_per_s_per_gpu", ",.0f")]))
        return 0
    return _print_offload_plan(args, preset, card, seq_len, host)


def _print_offload_plan(args, preset: str, card: str, seq_len: int, host: float | None) -> int:
    """`labs memory --plan` where no candidate fits without offload: what fits with it, and the host it needs."""
    found = offload_plan.rows(preset, cards=(card,), gpus=args.gpus, batch_per_gpu=args.batch_per_gpu, seq_len=seq_len)
    print(f"nothing fits {args.gpus} x {card} without offload at {args.batch_per_gpu} sequences of {seq_len:,} tokens per "
          "GPU per step; with the optimizer offloaded (labs.memory's prediction; the step-time model has no offload "
          "term, so these are not ranked by speed):")
    for r in found:
        r["checkpointing"] = f"{r['checkpointed']} of {r['layers']}"
        r["host_fits"] = "" if host is None else ("yes" if r["host_gib"] <= host else "no")
    columns = ["setup", "batch", ("offloaded", "offloaded", ".0%"), ("checkpointed layers", "checkpointing", ""),
               ("GPU peak GiB", "gpu_gib", ".1f"), ("host GiB per node", "host_gib", ".0f")]
    print(Table(found, columns + ([(f"fits {host:,.0f} GiB host", "host_fits", "")] if host else [])))
    if not found:
        print("nothing fits with offload either: use more GPUs (--gpus) or fewer sequences per step (--batch-per-gpu)")
    return 0
