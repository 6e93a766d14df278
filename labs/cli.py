"""`labs <command>`: the commands a user types. Bad input: one line on stderr, exit code 2, before any rank starts.
Each command's modules are imported only when it runs (start-up time); the parser's own, which every command
builds, at the top."""
from __future__ import annotations

import argparse
import json
import os
import sys

from labs import models, multinode, resolve
from labs.bench import cli as bench_cli
from labs.errors import LabsError, RankFailed, RunStopped, positive_float, positive_int
from labs.memory import cli as memory_cli

EXAMPLES = """examples:
  labs train                                          tiny model, ZeRO-3, 2 CPU ranks (or every GPU), 30 steps
  labs train --preset qwen2.5-7b --config zero3_offload_optimizer.json --nproc 1 --out runs/offload
  labs train --data corpus.jsonl --seq-len 512 --micro-batch 4 --grad-accum 8 --lr 1e-4
  labs memory --preset qwen2.5-7b --stage 3 --gpus 2 --gpu-memory 80GiB
  labs memory --plan --preset qwen2.5-7b --gpus 1 --gpu-memory H100 --host-memory 256GiB   what fits, fastest first
  labs export runs/long models/long                   a Hugging Face folder (from_pretrained) of the last checkpoint
  labs bench --preset qwen2.5-7b --cases stock-zero3,labs-zero3 --out results/gpu/mine.json
  labs env
"""
TRAIN_EXAMPLES = """examples:
  labs train                                   the tiny preset, zero3.json, 2 CPU ranks (all GPUs on a GPU host)
  labs train --config zero2.json --steps 100 --out runs/zero2
  labs train --steps 100 --save-every 20 --out runs/long     then, after a crash: labs train --resume runs/long
  labs train --resume runs/long --nproc 1                    the same run on 1 rank (universal checkpoint)
  labs train --preset qwen2.5-7b --model-path /models/Qwen2.5-7B --data chat.jsonl --seq-len 2048 --lr 1e-5
  labs train --preset qwen2.5-7b --gpu-memory H100 --activation-checkpointing 8 --loss liger --kernels liger
  labs train --nnodes 2 --node-rank 0 --rdzv-endpoint node0:29500 --nproc 8 ...   on node0; --node-rank 1 on node1
  labs train --hostfile hostfile --master-addr 10.0.0.1 --include "node0@node1"    DeepSpeed's launcher (pdsh)
  labs train --slurm job.sbatch --nnodes 4 --nproc 8 --preset qwen2.5-7b ...       writes a Slurm batch script

Several nodes: node 0 writes --out, node K writes --out.nodeK (its log, inputs, its ranks' errors).

--out: a new folder, or a run folder labs wrote earlier (replaced only when the new run succeeds). An existing
file, or a folder labs did not write, is refused. Ctrl-C stops every rank; a run that saved a complete
checkpoint is kept, marked interrupted, for --resume.
"""


class _Parser(argparse.ArgumentParser):
    def error(self, message):            # one line, exit 2 (argparse's default adds a usage block)
        command = self.prog.split()[-1]
        raise LabsError(f"{message} (see `{'labs' if command == 'labs' else 'labs ' + command} --help`)")


def _train_args(sub):
    p = sub.add_parser("train", help="launch a training run and wait for it", epilog=TRAIN_EXAMPLES,
                       description="Train a Qwen2-architecture model with DeepSpeed ZeRO (or FSDP2) on this host.",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", help=f"{' | '.join(models.PRESETS)}: the model's shape and the run's defaults "
                                     "(default: tiny; from a model folder, the preset of its shape)")
    p.add_argument("--config", default=resolve.DEFAULT_CONFIG,
                   help="DeepSpeed JSON config: a path, or a file name in the course's ds_configs/ "
                        f"(default: {resolve.DEFAULT_CONFIG})")
    p.add_argument("--steps", type=positive_int, default=30, help="optimizer steps (default: 30)")
    p.add_argument("--out", default="runs/demo", help="run folder to write (default: runs/demo); see below")
    p.add_argument("--nproc", type=positive_int, help="ranks on this host (default: every GPU, or 2 CPU ranks)")
    p.add_argument("--model-path", help="local Hugging Face Qwen2 folder to start from: config.json + "
                                        "*.safetensors (default: random weights; nothing is ever downloaded)")
    p.add_argument("--data", dest="data_path", help="a .txt file, or .jsonl with one {\"text\": ...} per line "
                                                    "(default: the embedded corpus, CPython's help pages)")
    p.add_argument("--seq-len", type=positive_int, help="tokens per sequence (default: the preset's, 64 for tiny, "
                                                         "4096 for the 7B presets)")
    p.add_argument("--micro-batch", type=positive_int, help="sequences per rank per forward (default: the "
                                                             "config's, else 2)")
    p.add_argument("--grad-accum", type=positive_int, help="micro-batches per optimizer step (default: the "
                                                            "config's, else 1)")
    p.add_argument("--lr", type=positive_float, help="peak learning rate (default: the config's, else the "
                                                      "preset's: 5e-3 tiny, 1e-4 for 7B)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the data order (default: 0)")
    p.add_argument("--loss", default="hf", help="hf (stock) | chunked (no full logits) | liger (fused, GPU) "
                                                "(default: hf)")
    p.add_argument("--kernels", default="stock", help="stock | liger (Triton RMSNorm/SwiGLU/RoPE, GPU) "
                                                      "(default: stock)")
    p.add_argument("--activation-checkpointing", default="none",
                   help="none | full | a number of layers, the first k (default: none)")
    p.add_argument("--engine", help="deepspeed | fsdp2 (default: fsdp2 if the config has an \"fsdp\" block, else "
                                    "deepspeed)")
    p.add_argument("--gpu-memory", help="cap each rank's GPU memory, e.g. 80GiB or H100 (default: the whole GPU)")
    p.add_argument("--no-memory-check", dest="memory_check", action="store_false",
                   help="start even when labs.memory predicts far more memory than there is")
    p.add_argument("--save-every", type=positive_int, metavar="N", help="write a checkpoint every N steps and at "
                                                                         "the last (default: none)")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue RUN_DIR from its newest complete checkpoint (or the "
                                                        "checkpoint folder named), with its settings except the flags "
                                                        "given; --out defaults to RUN_DIR; --nproc may shrink, not grow "
                                                        "(default: a new run)")
    p.add_argument("--instruments", type=lambda text: tuple(n for n in text.split(",") if n),
                   default=("state_bytes",), help="comma-separated measurements besides training: state_bytes, "
                                                  "comm, zero_buffers, state_dict, probe_logits, rank_env, "
                                                  "peak_allocations (GPU) "
                                                  "(default: state_bytes)")
    p.add_argument("--quiet", action="store_true", help="do not stream the ranks' output")
    n = p.add_argument_group("several nodes (torchrun: --nnodes ...; DeepSpeed's launcher: --hostfile ...)")
    n.add_argument("--nnodes", type=positive_int, help="nodes taking part; each runs this command (default: 1)")
    n.add_argument("--node-rank", type=int, help="this node's rank, 0..nnodes-1 (0 on the rendezvous host; default: 0)")
    n.add_argument("--rdzv-endpoint", help="HOST:PORT of node 0, reachable from every node (torchrun; default: none, one host)")
    n.add_argument("--rdzv-timeout", type=positive_int, default=multinode.DEFAULT_RDZV_TIMEOUT_S,
                   help="seconds a node waits for the others before giving up (default: "
                        f"{multinode.DEFAULT_RDZV_TIMEOUT_S})")
    n.add_argument("--hostfile", help="DeepSpeed hostfile, one 'HOST slots=N' per line: run DeepSpeed's launcher, "
                                       "here, which starts every host with pdsh over passwordless ssh (rank 0 on "
                                       "the first host; run folder on a shared file system); with --node-rank, on "
                                       "each host "
                                       "(default: none, torchrun)")
    n.add_argument("--include", default="", help="DeepSpeed's NODE[:SLOT,...][@NODE...]: only these "
                                                       "(default: every host of the hostfile)")
    n.add_argument("--exclude", default="", help="DeepSpeed's NODE[:SLOT,...][@NODE...]: all but these "
                                                       "(default: none)")
    n.add_argument("--master-addr", help="address of the hostfile's first host, where rank 0 runs "
                                                "(DeepSpeed; required with more than one host; default: 127.0.0.1)")
    n.add_argument("--master-port", type=positive_int, default=multinode.DEFAULT_PORT,
                   help=f"(DeepSpeed, Slurm; default: {multinode.DEFAULT_PORT})")
    n.add_argument("--slurm", metavar="FILE", help="write a Slurm batch script that runs this command on --nnodes "
                                                   "nodes of --nproc GPUs, then exit (nothing is trained here; "
                                                   "default: none, train now)")
    return p


def _export_args(sub):
    p = sub.add_parser("export", help="write a run's checkpoint as a Hugging Face model folder",
                       description="Consolidate a checkpoint's ZeRO partitions (zero_to_fp32) and write config.json, "
                                   "safetensors and the tokenizer, for transformers' from_pretrained.")
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run folder written with --save-every (or a checkpoint in it)")
    p.add_argument("out_dir", metavar="OUT_DIR", help="the model folder to write (new, or an earlier export)")
    p.add_argument("--dtype", default="bf16", help="bf16 | fp16 | fp32: the weights' dtype on disk (default: bf16, "
                                                   "what the run computed with; fp32: the master weights)")


def _bench_args(sub):
    p = sub.add_parser("bench", help="stock reference vs labs fast path, same GPUs, one invocation")
    p.add_argument("--preset", default="qwen2.5-7b", help="(default: qwen2.5-7b)")
    p.add_argument("--cases", default="stock-zero3,labs-zero3",
                   help="comma-separated named cases (labs.bench.CASES) or composed ones, SIDE-ENGINE[-OPTION...] "
                        "(labs.bench.cases) (default: stock-zero3,labs-zero3)")
    p.add_argument("--steps", type=positive_int, default=8, help="steps per case; the first 2 are warm-up "
                                                                  "(default: 8)")
    p.add_argument("--seq-len", type=positive_int, help="(default: the preset's)")
    p.add_argument("--micro-batch", type=positive_int, help="(default: each case's)")
    p.add_argument("--out", help="JSON result file, written after every case (default: none)")
    p.add_argument("--work", help="folder for the cases' run folders (default: a new temporary folder)")
    p.add_argument("--gpu-memory", help="cap every case's GPU memory per rank, e.g. 80GiB or H100 (default: none)")
    p.add_argument("--sweep", type=positive_int, metavar="N",
                   help="best against best: run the planner's N fastest predicted candidates of each side that fit "
                        "the memory, plus --cases, all at --batch-per-gpu (default: off)")
    p.add_argument("--batch-per-gpu", type=positive_int, default=8,
                   help="with --sweep: sequences per GPU per optimizer step (default: 8)")
    p.add_argument("--quiet", action="store_true", help="do not stream the ranks' output")


# What an interrupt leaves for the commands that launch no run (the others stop their ranks and say what they kept).
STARTS_NOTHING = {None: "nothing was started", "env": "nothing was started or written",
                  "memory": "nothing was started or written",
                  "train --slurm": "the script file is either as it was or whole",
                  "export": "nothing was written (the model folder is written beside OUT_DIR and takes its place only "
                            "when whole; an earlier export there is kept until then)"}


def main(argv=None) -> int:
    parser = _Parser(prog="labs", description="zero-course labs: train Qwen-architecture models with DeepSpeed ZeRO",
                     epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser, metavar="COMMAND")
    train_parser = _train_args(sub)
    _export_args(sub)
    _bench_args(sub)
    bench_cli.add_autotune_parser(sub)
    p = sub.add_parser("env", help="versions, GPUs, which DeepSpeed ops build here, and fixes for what is wrong")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    memory_cli.add_parser(sub)
    command = None
    try:
        argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
        args = parser.parse_args(argv)
        command = "train --slurm" if args.command == "train" and args.slurm else args.command
        if args.command == "train" and args.resume is not None:
            args.typed = _typed(train_parser, argv)
        return _dispatch(args, argv)
    except LabsError as exc:
        print(f"labs: error: {exc}", file=sys.stderr)
        return 2
    except RankFailed as exc:
        print(f"labs: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as exc:
        if command in STARTS_NOTHING:
            print(f"labs: interrupted: {STARTS_NOTHING[command]}", file=sys.stderr)
            return 130
        kept = getattr(exc, "kept", "") or "no run folder was kept"
        print(f"labs: interrupted: every process of the run was stopped; {kept}", file=sys.stderr)
        return 130
    except RunStopped as exc:
        kept = getattr(exc, "kept", "") or "no run folder was kept"
        print(f"labs: {exc}: every process of the run was stopped; {kept}", file=sys.stderr)
        return 128 + exc.signum


def _typed(train_parser, argv) -> set:
    """The train options the user typed (a resumed run takes the others from the run it resumes, not from the
    defaults): the same command line parsed again with every default suppressed."""
    for action in train_parser._actions:
        action.default = argparse.SUPPRESS
    return set(vars(train_parser.parse_args(argv[argv.index("train") + 1:])))


def _dispatch(args, argv) -> int:
    if args.command == "train":
        if args.slurm:
            return _write_slurm(args, argv)
        nodes = multinode.from_flags(**{k: getattr(args, k) for k in multinode.FLAGS})
        from labs import launch

        typed = getattr(args, "typed", None)
        options = {k: v for k, v in vars(args).items() if k not in ("command", "quiet", "typed", "slurm",
                                                                     *multinode.FLAGS)
                   and (typed is None or k in typed)}
        run = launch.run(stream=not args.quiet, nodes=nodes, **options)
        if not (run.path / "summary.json").exists():     # a node > 0: global rank 0 wrote node 0's folder
            print(f"done: node {nodes.node_rank}'s ranks finished; metrics and summary are in node 0's --out; "
                  f"this node's log and inputs: {run.path}")
            return 0
        print(done_line(run.summary, run.path))
        return 0
    if args.command == "export":
        from labs import export

        folder = export.to_hf(args.run_dir, args.out_dir, dtype=args.dtype)
        print(f"exported {folder.source} as {args.dtype} to {folder.path}: {folder.summary}")
        return 0
    if args.command == "bench":
        from labs import bench

        common = dict(preset=args.preset, steps=args.steps, seq_len=args.seq_len, out=args.out, work=args.work,
                      stream=not args.quiet, gpu_memory=args.gpu_memory)
        if args.sweep:
            result = bench.run_sweep(top=args.sweep, batch_per_gpu=args.batch_per_gpu,
                                     extra=[c for c in args.cases.split(",") if c], **common)
        else:
            result = bench.run_cases(args.cases.split(","), micro_batch=args.micro_batch, **common)
        print(bench.format_table(result))
        return 0
    if args.command == "autotune":
        return bench_cli.run_autotune(args)
    if args.command == "env":
        from labs import env

        info = env.report()
        print(json.dumps(info, indent=1) if args.json else env.format_report(info))
        return 0
    if args.command == "memory" and args.plan:
        return bench_cli.run_plan(args)
    if args.command == "memory":
        return memory_cli.run(args)
    raise LabsError(f"unknown command {args.command}")


def done_line(s: dict, path) -> str:
    """A finished run in one line; its final loss is the mean of the last 5 steps' (labs.metrics), or of all."""
    averaged = min(5, s["steps"])
    final = f"mean of last {averaged}" if averaged > 1 else "one step"
    return (f"done: {s['steps']} steps, loss {s['first_loss']:.3f} -> {s['final_loss']:.3f} ({final}), "
            f"{s['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU ({s['timing']}), run folder {path}")


def _write_slurm(args, argv) -> int:
    from pathlib import Path

    if not args.nnodes or not args.nproc:
        raise LabsError("--slurm needs --nnodes (nodes to ask for) and --nproc (GPUs per node)")
    script = multinode.slurm_script(args.nnodes, args.nproc, multinode.slurm_train_args(argv[1:]),
                                    port=args.master_port, workdir=str(Path.cwd()))
    given = Path(args.slurm)
    target = given.resolve()                      # through a link to the file it names
    stream = str(given).startswith(("/dev/", "/proc/")) or (given.exists() and not given.is_file())
    if not stream and not target.parent.is_dir():
        raise LabsError(f"--slurm {args.slurm}: the folder '{target.parent}' does not exist; create it first")
    if stream:                                    # /dev/stdout, a pipe to sbatch: written as it is, the note to stderr
        with open(given, "a") as stream_file:    # appended: a shell's `>` has emptied the file already, `>>` keeps it
            stream_file.write(script)
        print(f"wrote the script to {args.slurm}", file=sys.stderr)
        return 0
    # whole or not at all: an earlier script there stays as it was until this one is written
    partial = target.with_name(f".{target.name}.partial-{os.getpid()}")
    try:
        partial.write_text(script)
        if target.exists():
            partial.chmod(target.stat().st_mode & 0o7777)      # keep the earlier file's mode (e.g. +x)
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    print(f"wrote {args.slurm}: submit it with `sbatch {args.slurm}`")
    return 0


if __name__ == "__main__":
    sys.exit(main())
