"""Chapter 10's verdict, measured: ZenFlow or plain offload on the same fine-tune at equal time (round 23,
results/gpu/zenflow_finetune_1xh200/round23), and ZenFlow's start-up host with labs' move of each buffer.

Round 23 ran round 19's pipeline again on one H200 (the same pre-training, whose losses repeat round 19's within
0.013 nats; the same fine-tune data, lr and 32,768 tokens per step) and fine-tuned 48 steps three ways: labs without
offload (4 x 2), plain offload (ZeRO-2, CPU Adam at every step, 8 x 1) and ZenFlow with its CPU step in the training
process (`overlap_step: false`, 8 x 1, every labs fix). Round 19's overlapped ZenFlow is compared over its first 48
steps, each run's speed as a share of its own round's no offload (the same kind of host, not the same one).

    zenflow_verdict.repeat_gaps()   # how closely round 23's pipeline repeated round 19's, per step
    zenflow_verdict.runs()          # per run: label, losses, share of no offload's tokens/s, late loss and gap
    zenflow_verdict.equal_time()    # per ZenFlow: plain offload's steps in its time, and the loss each reached
    zenflow_verdict.overlap_or_not()  # the two ZenFlows at equal time, and the host each left available
    zenflow_verdict.startup()       # round 23's ZenFlow start-up against round 19's: the host's tightest second
"""
from __future__ import annotations

from labs import memory
from labs.metrics import read_jsonl
from labs.course import host_samples, zenflow_moments_report as zm, zenflow_report as z

ROUND23 = z.FINETUNE / "round23"
STEPS, WINDOW, CYCLE = 48, 8, 4      # 48 steps compared, the loss over the last 8; speed over whole 4-step cycles
# name: (round folder, its no-offload run, label)
RUNS = {"ft_ref48": (ROUND23, "ft_ref48", "no offload"),
        "ft_off48": (ROUND23, "ft_ref48", "plain offload"),
        "ft_zfs48": (ROUND23, "ft_ref48", "ZenFlow, CPU step in the training process"),
        "ft_zfm64": (zm.ROUND19, "ft_ref64", "ZenFlow, overlapped (round 19)")}
ZENFLOWS = ("ft_zfs48", "ft_zfm64")


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def repeat_gaps() -> dict[str, float]:
    """The largest per-step loss difference between round 23 and round 19: the pre-training (120 steps) and no
    offload's fine-tune (round 23's 48 steps against round 19's first 48)."""
    def losses(folder, name):
        return [m["loss"] for m in read_jsonl(folder / name / "metrics.jsonl")]
    return {label: max(abs(a - b) for a, b in zip(losses(ROUND23, ours), losses(zm.ROUND19, theirs)))
            for label, ours, theirs in (("pre-training", "pre", "pre"), ("no offload", "ft_ref48", "ft_ref64"))}


def runs() -> dict[str, dict]:
    """Per run, over its first 48 steps: label, micro-batch x accumulation, losses, seconds since the end of step 1 at
    the end of each step (zenflow_report.zenflow_runs), its slowest step after step 1 and how long it took (the
    overlapped run's step 4 starts its optimizer process), tokens/s over whole cycles after the first (the whole run:
    round 19's ZenFlow ran 64 steps), its round's no offload's and the share, the mean loss over steps 41-48 and its
    gap to that no offload's."""
    found = {}
    for name, (folder, reference, label) in RUNS.items():
        pair = z.zenflow_runs((reference, name), folder, CYCLE)
        run, ref = pair[name], pair[reference]
        late = _mean(run["losses"][STEPS - WINDOW:STEPS])
        slowest = max(range(1, STEPS), key=lambda k: run["step_s"][k])          # after step 1's warm-up
        found[name] = dict(label=label, losses=run["losses"][:STEPS], elapsed_s=run["elapsed_s"][:STEPS],
                           batch=f"{run['micro_batch']} x {run['grad_accum']}", slowest_step=slowest + 1,
                           slowest_step_s=run["step_s"][slowest], tokens_per_s_per_gpu=run["tokens_per_s_per_gpu"],
                           reference_tokens_per_s_per_gpu=ref["tokens_per_s_per_gpu"],
                           share=run["tokens_per_s_per_gpu"] / ref["tokens_per_s_per_gpu"], late_loss=late,
                           gap=late - _mean(ref["losses"][STEPS - WINDOW:STEPS]))
    return found


def equal_time() -> dict[str, dict]:
    """Per ZenFlow run: in the time it takes for 48 steps at its speed, how many steps plain offload makes at its own
    (each a share of its round's no offload), plain offload's measured mean loss over the last 8 of those, ZenFlow's
    over steps 41-48, and how many of plain offload's steps ZenFlow's 48 are worth (the first k whose 8-step mean is
    as low); `tie` is the speed ratio ZenFlow would need for equal loss at equal time, `had` the one it has."""
    found, measured = {}, runs()
    off = measured["ft_off48"]
    for name in ZENFLOWS:
        zen = measured[name]
        steps = STEPS * off["share"] / zen["share"]
        reached = int(steps)
        worth = next(k for k in range(WINDOW, STEPS + 1) if _mean(off["losses"][k - WINDOW:k]) <= zen["late_loss"])
        found[name] = dict(label=zen["label"], off_steps=steps, off_loss=_mean(off["losses"][reached - WINDOW:reached]),
                           zen_loss=zen["late_loss"], worth=worth, tie=STEPS / worth, had=zen["share"] / off["share"])
    return found


def overlap_or_not() -> dict:
    """ZenFlow with its CPU step overlapped (round 19, 64 steps) against in the training process (round 23, 48), at
    equal time: the overlapped run's steps in the time the sequential one took for 48 (each at its share of its
    round's no offload), the overlapped run's mean loss over the last 8 of those, the sequential run's over steps
    41-48; the least host memory available while each trained (GiB; the overlapped figure from round 23's zf_start,
    the same run on the sequential run's host); and the sequential run's training rank at the host's tightest second
    (private plus shared, GiB) against labs.memory's host figure for it."""
    measured = runs()
    overlapped, sequential = measured["ft_zfm64"], measured["ft_zfs48"]
    steps = STEPS * overlapped["share"] / sequential["share"]
    losses = z.zenflow_runs(("ft_zfm64",), zm.ROUND19, CYCLE)["ft_zfm64"]["losses"]    # all 64 steps
    reached = int(steps)
    host = host_samples.read(ROUND23 / "ft_zfs48")
    return dict(overlapped_steps=steps, overlapped_loss=_mean(losses[reached - WINDOW:reached]),
                sequential_loss=sequential["late_loss"], sequential_available_gib=host["least_available_gib"],
                sequential_rank_gib=host["rank_at_tightest_gib"],
                sequential_predicted_gib=memory.from_run(ROUND23 / "ft_zfs48").host_per_node_bytes / 2**30,
                overlapped_available_gib=zm.host_use(ROUND23 / "zf_start")["least_available_running_gib"])


def startup() -> dict[str, dict]:
    """ZenFlow's host, sampled each second, with labs' move then: round 19's ft_zfm64 (the pinned originals given
    back at the end) and round 23's zf_start (each given back as soon as it has moved; 12 steps from the same
    weights): zenflow_moments_report.host_use, with the start-up's excess over training per parameter."""
    return {name: zm.host_use(run_dir)
            for name, run_dir in (("round 19", zm.ROUND19 / "ft_zfm64"), ("round 23", ROUND23 / "zf_start"))}
