"""Chapter 10's readings of ZenFlow's CPU Adam with labs.zenflow_moments (one set of moments, updates counted): what
DeepSpeed's step count does to an update, what the second set costs in host memory (round 12's record, measured, and
labs.memory), and the loss on the tiny model on a CPU (results/cpu/zenflow_moments, tools/zenflow_moments_loss.py).

    zenflow_moments_report.moves("deepspeed")          # each update's move, in learning rates ("labs": counted)
    zenflow_moments_report.optimizer_process_memory()                # round 12's moments, measured and predicted
    zenflow_moments_report.loss_rows()                                # the CPU measurement, per run and seed
    zenflow_moments_report.round19_target()           # the 3B on one H200: the offload target with every fix
    zenflow_moments_report.round19_moments()          # its optimizer process's private memory, one set and two
    zenflow_moments_report.equal_time()               # round 19's ZenFlow against plain offload at equal time
    zenflow_moments_report.train_line()               # that ZenFlow run as a `labs train` line
    zenflow_moments_report.startup_extra_bytes_per_param()   # what its start-up held above its training
"""
from __future__ import annotations

import contextlib
import io
import json

import torch

from labs import RESULTS, env, memory, zenflow_moments
from labs.bench import cases
from labs.zenflow_host import source_sha256
from labs.course import host_samples, zenflow_columns_report, zenflow_report as z

CPU = RESULTS / "cpu" / "zenflow_moments" / "result.json"
WINDOW = 16                       # the loss is judged over the last 16 of 48 steps
# "sequential": overlap_step false, the CPU step in the training process; "overlapped": in a second process, every
# overlapped run with labs.zenflow_host's wait (for the update of the round before) but the one marked
LABELS = {"no_offload": "labs, no offload",
          "sequential_deepspeed": "sequential, DeepSpeed's count",
          "sequential_labs": "sequential, counted updates",
          "sequential_labs_interval_1": "sequential, counted, update_interval 1",
          "overlap_deepspeed": "overlapped, two sets, DeepSpeed's count",
          "overlap_count": "overlapped, two sets, counted updates",
          "overlap_one_set": "overlapped, one set, DeepSpeed's count",
          "overlap_labs": "overlapped, one set, counted updates",
          "overlap_labs_deepspeeds_wait": "overlapped, one set, counted, DeepSpeed's wait"}
ROUND19 = z.FINETUNE / "round19"
ROUND19_RUNS = ("ft_ref64", "ft_zfm64", "ft_zfm64_ctl", "ft_zfm_ui2_64")
ROUND19_LABELS = dict(zip(ROUND19_RUNS, ("labs, no offload", "ZenFlow, labs' CPU Adam (one set, counted)",
                                        "ZenFlow, DeepSpeed's CPU Adam (two sets, its count; control)",
                                        "ZenFlow, labs' CPU Adam, update_interval 2")))
# one lever at a time, (without, with), the other lever held either way
LEVERS = {"count, sequential": ("sequential_deepspeed", "sequential_labs"),
          "count, overlapped, two sets": ("overlap_deepspeed", "overlap_count"),
          "count, overlapped, one set": ("overlap_one_set", "overlap_labs"),
          "one set, overlapped, DeepSpeed's count": ("overlap_deepspeed", "overlap_one_set"),
          "one set, overlapped, counted": ("overlap_count", "overlap_labs"),
          "labs' wait, overlapped": ("overlap_labs_deepspeeds_wait", "overlap_labs")}


def moves(which: str = "deepspeed", updates: int = 16, interval: int = 4, lr: float = 1e-2) -> list[float]:
    """ZenFlow's sequential CPU Adam step, DeepSpeed's (`which="deepspeed"`) or labs.zenflow_moments' ("labs"), run by
    DeepSpeed's own CPU Adam op on one weight with a steady gradient of 1, handed the training step's number at each
    update (interval, 2 x interval, ...) as ZenFlow hands it: how far each update moves the weight, in learning
    rates. Adam's answer is 1 every time."""
    env.name_deepspeed_accelerator()
    from deepspeed.ops.adam.zenflow_cpu_adam import ZenFlowCPUAdam

    assert source_sha256(ZenFlowCPUAdam._sequential_step) == zenflow_moments.SEQUENTIAL_STEP_SHA256, \
        "this process's ZenFlowCPUAdam is not DeepSpeed 0.19.8's (labs.zenflow_moments installed here?)"
    step = {"deepspeed": ZenFlowCPUAdam._sequential_step, "labs": zenflow_moments.sequential_step}[which]
    weight = torch.nn.Parameter(torch.ones(8))
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):   # the op's load lines
        adam = ZenFlowCPUAdam([weight], lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, adamw_mode=True)
    found = []
    for k in range(1, updates + 1):
        before = weight.detach()[0].item()
        weight.grad = torch.ones(8)
        step(adam, k * interval)
        found.append((before - weight.detach()[0].item()) / lr)
    return found


def optimizer_process_memory(name: str = "zf_fast20") -> dict:
    """Round 12's ZenFlow run on one H200 (the 3B, before labs.zenflow_moments): the optimizer process's private
    memory at the host's tightest second (its moments, GiB), the parameters, and labs.memory's host figure for the
    node with DeepSpeed's two sets and with one (bytes)."""
    held = z.host_memory(name)["at_tightest"]
    two, one = (memory.from_run(z.FOLDER / name, zenflow_moments=m) for m in ("deepspeed", "labs"))
    return dict(private_gib=held[("ZenFlow's optimizer process", "RssAnon")], params=two.params,
                host_two_sets=two.host_per_node_bytes, host_one_set=one.host_per_node_bytes)


def record() -> dict:
    """The CPU measurement as recorded: when, where, how, the commands and every run's per-step losses per seed."""
    return json.loads(CPU.read_text())


def late_means(found: dict | None = None) -> dict[str, dict[str, float]]:
    """Per run and seed, the mean loss over the last WINDOW steps."""
    found = found or record()
    return {name: {seed: sum(losses[-WINDOW:]) / WINDOW for seed, losses in seeds.items()}
            for name, seeds in found["losses"].items()}


def loss_rows(found: dict | None = None) -> list[dict]:
    """One row per run: the late mean loss per seed, its mean over the seeds and the gap to no offload (nats)."""
    late = late_means(found)
    reference = late["no_offload"]
    rows = []
    for name, seeds in late.items():
        row = {"run": LABELS[name]} | {f"seed {s}": f"{v:.3f}" for s, v in seeds.items()}
        mean_gap = sum(v - reference[s] for s, v in seeds.items()) / len(seeds)
        rows.append(row | {"gap to no offload": "" if name == "no_offload" else f"{mean_gap:+.3f}"})
    return rows


def first_difference(first: str, second: str, found: dict | None = None) -> int:
    """The first step (1-based) at which two runs' losses differ for any seed: where a lever first acts."""
    found = found or record()
    a, b = found["losses"][first], found["losses"][second]
    return min(next(k for k, (x, y) in enumerate(zip(a[s], b[s]), start=1) if x != y) for s in a)


def lever_gains(found: dict | None = None) -> dict[str, list[float]]:
    """Per lever (LEVERS), how much lower the late mean loss is with it than without, per seed (nats)."""
    late = late_means(found)
    return {lever: [late[before][s] - late[after][s] for s in late[before]]
            for lever, (before, after) in LEVERS.items()}


def round19_target() -> dict:
    """The offload target over round 19's fine-tunes (zenflow_report.round14_target, steps 49-64): ZenFlow with labs'
    CPU Adam at update_interval 4 and 2, and the control with DeepSpeed's (labs' wait and fp32 columns in all three)."""
    return z.round14_target(ROUND19, ROUND19_RUNS, z.WINDOW15, "round 19, 64 steps", ROUND19_LABELS)


def round19_moments() -> dict[str, dict]:
    """host_use for round 19's ZenFlow runs at interval 4: labs' CPU Adam (one set of moments) and the control with
    DeepSpeed's (two)."""
    return {name: host_use(ROUND19 / name, moments) for name, moments in (("ft_zfm64", "labs"),
                                                                           ("ft_zfm64_ctl", "deepspeed"))}


def host_use(run_dir, moments: str = "labs") -> dict:
    """A sampled ZenFlow run's host, from its host samples (each second) and labs.memory: the optimizer process's
    largest private memory (GiB), 8 bytes per parameter per set of moments (GiB), the host's least available memory
    over the whole run and while the optimizer process ran (GiB, with the second of the run), the training rank's
    shared memory at its largest and while the process ran (GiB), and labs.memory's host figure for the node (GiB),
    which models training, not the start-up, with the parameters it counts; and startup_extra_bytes_per_param's
    figure."""
    host = host_samples.read(run_dir)
    running = [t for t in host["timeline"] if "ZenFlow's optimizer process RssAnon" in t]
    least, least_running = (min(seconds, key=lambda t: t["available_gib"]) for seconds in (host["timeline"], running))
    estimate = memory.from_run(run_dir, zenflow_moments=moments)
    return dict(private_gib=host["peaks"][("ZenFlow's optimizer process", "RssAnon")],
                moments_gib=(1 if moments == "labs" else 2) * 8 * estimate.params / 2**30,
                total_gib=host["total_gib"], least_available_gib=least["available_gib"],
                least_second=least["second"], process_from_second=running[0]["second"],
                least_available_running_gib=least_running["available_gib"],
                rank_shared_gib=host["peaks"][("training rank", "RssShmem")],
                rank_shared_running_gib=max(t["training rank RssShmem"] for t in running),
                host_gib=estimate.host_per_node_bytes / 2**30, params=estimate.params,
                extra_bytes_per_param=(least_running["available_gib"] - least["available_gib"]) * 2**30
                / estimate.params)


def equal_time(name: str = "ft_zfm64", window: int = 8) -> dict:
    """ZenFlow against plain offload at equal wall-clock time, on round 19's fine-tune of the 3B.

    Plain offload was not run on these weights. It runs the same Adam as no offload, on the CPU: in round 10 (one
    host, from random weights, 20 steps) its loss fell as far as no offload's (`fall`), at `off_share` of no
    offload's tokens/s. So in the time ZenFlow takes for its N steps (at `zen_share` of no offload's speed), plain
    offload makes N x off_share / zen_share steps, and its loss there is no offload's. ZenFlow's loss over its last
    `window` steps is no offload's at step `zen_worth` (the first k whose mean over steps k-window+1..k is as low)."""
    runs = z.finetune_runs(ROUND19, ("ft_ref64", name))
    reference, zen = runs["ft_ref64"], runs[name]
    r10 = z.zenflow_runs(("off20b", "ref20"))                                   # round 10, one host
    off_share = r10["off20b"]["tokens_per_s_per_gpu"] / r10["ref20"]["tokens_per_s_per_gpu"]
    zen_share = zen["tokens_per_s_per_gpu"] / reference["tokens_per_s_per_gpu"]
    steps = len(zen["losses"])
    off_steps = steps * off_share / zen_share
    reached = int(off_steps)
    return dict(off_share=off_share, zen_share=zen_share, steps=steps, off_steps=off_steps, window=window,
                zen_worth=zenflow_columns_report.caught_up(name, window, ROUND19),
                zen_loss=sum(zen["losses"][-window:]) / window,
                off_loss=z.window_mean(reference["losses"], range(reached - window + 1, reached + 1)),
                falls=(r10["off20b"]["fall"], r10["ref20"]["fall"]))


def train_line(name: str = "ft_zfm64", folder=ROUND19, config: str | None = None) -> str:
    """The `labs train` line of a recorded ZenFlow run, from its run.json and resolved config, with the round's own
    weights and data as placeholders; `config` names the committed config of a run made with a copy in /tmp."""
    spec = json.loads((folder / name / "run.json").read_text())
    resolved = json.loads((folder / name / "ds_config.json").read_text())
    options = {**spec, **({"config": config} if config else {}),
               "micro_batch": resolved["train_micro_batch_size_per_gpu"],
               "grad_accum": resolved["gradient_accumulation_steps"]}
    return cases.train_line(options, spec["nproc"], inputs="--model-path YOUR_MODEL --data YOUR_DATA.jsonl")


def startup_extra_bytes_per_param(run_dir=ROUND19 / "ft_zfm64") -> float:
    """Round 19 on the 3B (labs' one set of moments, and labs' move of then, which gave the pinned originals back
    only at the end): the host memory in use at the run's tightest second, during ZenFlow's start-up, above what was in
    use at the tightest second while it trained, per parameter. Both are the same run on the same host, so the system's
    own memory cancels; the optimizer process's moments were not yet allocated at start-up, so this understates the
    start-up's own buffers by them."""
    return host_use(run_dir)["extra_bytes_per_param"]
