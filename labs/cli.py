"""`labs <command>`: the commands a user types. Bad input: one line on stderr, exit code 2."""
from __future__ import annotations

import argparse
import json
import sys

from labs import resolve
from labs.errors import LabsError, RankFailed


class _Parser(argparse.ArgumentParser):
    def error(self, message):            # one line, exit 2 (argparse's default adds a usage block)
        raise LabsError(f"{message} (see `labs {self.prog.split()[-1]} --help`)")


def _train_args(sub):
    p = sub.add_parser("train", help="launch a training run and wait for it")
    p.add_argument("--preset", default="tiny", help="tiny | qwen-7b | qwen2.5-7b (default tiny)")
    p.add_argument("--config", default=resolve.DEFAULT_CONFIG,
                   help="DeepSpeed JSON config: a path, or a file name in the course's ds_configs/ "
                        f"(default {resolve.DEFAULT_CONFIG})")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--out", default="runs/demo", help="run folder to write (replaced when the run succeeds)")
    p.add_argument("--nproc", type=int, help="ranks on this host (default: all GPUs, or 2 CPU ranks)")
    p.add_argument("--model-path", help="local Hugging Face model folder to start from (never downloads)")
    p.add_argument("--data", dest="data_path", help=".txt or .jsonl ({'text': ...} per line); default: embedded")
    p.add_argument("--seq-len", type=int)
    p.add_argument("--micro-batch", type=int)
    p.add_argument("--grad-accum", type=int)
    p.add_argument("--lr", type=float)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--loss", default="hf", help="hf (stock) | chunked | liger (GPU)")
    p.add_argument("--kernels", default="stock", help="stock | liger (Triton RMSNorm/SwiGLU/RoPE, GPU)")
    p.add_argument("--activation-checkpointing", default="none", help="none | full | number of layers")
    p.add_argument("--engine", help="deepspeed | fsdp2 (default: fsdp2 if the config has an \"fsdp\" block)")
    p.add_argument("--quiet", action="store_true", help="do not stream the ranks' output")


def main(argv=None) -> int:
    parser = _Parser(prog="labs", description="zero-course labs: train Qwen-architecture models with DeepSpeed")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _train_args(sub)
    p = sub.add_parser("bench", help="stock reference vs labs fast path, same GPUs, one invocation")
    p.add_argument("--preset", default="qwen2.5-7b")
    p.add_argument("--cases", default="stock-zero3,labs-zero3", help="comma-separated names from labs.bench.CASES")
    p.add_argument("--steps", type=int, default=8, help="steps per case; the first 2 are warm-up")
    p.add_argument("--seq-len", type=int)
    p.add_argument("--micro-batch", type=int)
    p.add_argument("--out", help="JSON result file (written after every case)")
    p.add_argument("--work", help="folder for the cases' run folders (default: a new temporary folder)")
    p.add_argument("--quiet", action="store_true")
    p = sub.add_parser("env", help="environment report with fixes")
    p.add_argument("--json", action="store_true")
    from labs.memory import cli as memory_cli
    memory_cli.add_parser(sub)
    try:
        args = parser.parse_args(argv)
        return _dispatch(args)
    except LabsError as exc:
        print(f"labs: error: {exc}", file=sys.stderr)
        return 2
    except RankFailed as exc:
        print(f"labs: {exc}", file=sys.stderr)
        return 1


def _dispatch(args) -> int:
    if args.command == "train":
        from labs import launch

        options = {k: v for k, v in vars(args).items() if k not in ("command", "quiet")}
        run = launch.run(stream=not args.quiet, **options)
        s = run.summary
        print(f"done: {s['steps']} steps, loss {s['first_loss']:.3f} -> {s['final_loss']:.3f} (mean of last 5), "
              f"{s['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU ({s['timing']}), run folder {run.path}")
        return 0
    if args.command == "bench":
        from labs import bench

        result = bench.run_cases(args.cases.split(","), preset=args.preset, steps=args.steps, seq_len=args.seq_len,
                                 micro_batch=args.micro_batch, out=args.out, work=args.work,
                                 stream=not args.quiet)
        print(bench.format_table(result))
        return 0
    if args.command == "env":
        from labs import env

        info = env.report()
        print(json.dumps(info, indent=1) if args.json else env.format_report(info))
        return 0
    if args.command == "memory":
        from labs.memory import cli as memory_cli

        return memory_cli.run(args)
    raise LabsError(f"unknown command {args.command}")


if __name__ == "__main__":
    sys.exit(main())
