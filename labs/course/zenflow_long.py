"""Chapter 10's verdict over twice the steps, on an 80 GB card: round 27c (2026-12-07/08, one H100 80GB,
results/gpu/zenflow_finetune_1xh100/round27c).

Round 23 compared ZenFlow and plain offload over 48 steps of a fine-tune, and ZenFlow's loss gap to no offload grew in
every window. Round 27c asks whether it stops growing: round 23's pipeline again (pre-training, export, the same
fine-tune data, lr 1e-5 and 32,768 tokens per step), every run with full activation checkpointing so that the 3B fits
an 80 GB card, then 96 steps of no offload (4 x 2) and of ZenFlow with its CPU step in the training process (8 x 1,
`overlap_step: false`), and 24 steps of plain offload (8 x 1) for its speed on the same host. Recompute changes speed,
not the update's arithmetic: the first 48 steps repeat round 23's (repeat_gaps).

    zenflow_long.runs()          # per run: label, batch, losses, share of no offload's tokens/s, elapsed seconds
    zenflow_long.gaps()          # ZenFlow's mean loss above no offload's, per 8-step window
    zenflow_long.repeat_gaps()   # the largest per-step loss difference from round 23's same runs
    zenflow_long.equal_time()    # plain offload's steps in ZenFlow's time for 96, and the loss each reached
    zenflow_long.target()        # chapter 9's ZenFlow target over these 96 steps
"""
from __future__ import annotations

import json

from labs import RESULTS
from labs.course import zenflow_report as z
from labs.course import zenflow_verdict as verdict
from labs.metrics import read_jsonl

ROUND27C = RESULTS / "gpu" / "zenflow_finetune_1xh100" / "round27c"
STEPS, WINDOW, CYCLE = 96, 8, 4         # 96 steps, losses over 8-step windows, speed over whole 4-step cycles
WINDOWS = tuple((end - WINDOW + 1, end) for end in range(48, STEPS + 1, WINDOW))   # steps 41-48, 49-56 ... 89-96
RUNS = {"ft_ref96c": "no offload", "ft_off24c": "plain offload (24 steps: its speed)",
        "ft_zfs96c": "ZenFlow, CPU step in the training process"}
REFERENCE, PLAIN, ZENFLOW = RUNS
TIMED = range(CYCLE + 1, 25)            # steps 5-24: plain offload ran 24, so every run's speed is over these


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def _window(losses, first: int, last: int) -> float:
    assert 1 <= first <= last <= len(losses), (first, last, len(losses))
    return _mean(losses[first - 1:last])


def runs() -> dict[str, dict]:
    """Per run: label, micro-batch x accumulation, losses, seconds since the end of step 1 at the end of each step,
    tokens/s and its share of no offload's over TIMED (the steps every run made, whole cycles after the first: the
    same steps for every run), the same over steps 5-96 where a run made them (`tokens_per_s_96`), and the GPU peak
    allocated and reserved (GiB). The medians in each summary.json count ZenFlow's fast steps only: not used."""
    measured = z.zenflow_runs(tuple(RUNS), ROUND27C, CYCLE)
    speed = {name: r["tokens_per_step"] * len(TIMED) / sum(r["step_s"][k - 1] for k in TIMED)
             for name, r in measured.items()}
    return {name: dict(label=RUNS[name], batch=f"{r['micro_batch']} x {r['grad_accum']}", losses=r["losses"],
                       elapsed_s=r["elapsed_s"], tokens_per_s_per_gpu=speed[name], share=speed[name] / speed[REFERENCE],
                       tokens_per_s_96=r["tokens_per_s_per_gpu"] if len(r["losses"]) == STEPS else None,
                       peak_gpu_gib=r["peak_gpu_gib"],
                       reserved_gpu_gib=max(_summary(name)["peak_reserved_bytes"]) / 2**30)
            for name, r in measured.items()}


def _summary(name: str) -> dict:
    return json.loads((ROUND27C / name / "summary.json").read_text())


def gaps() -> list[dict]:
    """Per window of WINDOWS: no offload's and ZenFlow's mean loss, and ZenFlow's gap above no offload's."""
    measured = runs()
    found = []
    for first, last in WINDOWS:
        ref, zen = (_window(measured[name]["losses"], first, last) for name in (REFERENCE, ZENFLOW))
        found.append(dict(steps=f"{first}-{last}", reference=ref, zenflow=zen, gap=zen - ref))
    return found


def repeat_gaps() -> dict[str, float]:
    """The largest per-step loss difference from round 23's same runs, over the steps both ran (pre-training 120;
    no offload and ZenFlow 48; plain offload 24), and plain offload's from no offload's over its 24 steps."""
    def losses(folder, name):
        return [m["loss"] for m in read_jsonl(folder / name / "metrics.jsonl")]

    def largest(a, b):
        return max(abs(x - y) for x, y in zip(a, b))
    pairs = (("pre-training", "pre", "pre"), ("no offload", REFERENCE, "ft_ref48"),
             ("ZenFlow", ZENFLOW, "ft_zfs48"), ("plain offload", PLAIN, "ft_off48"))
    found = {label: largest(losses(ROUND27C, ours), losses(verdict.ROUND23, theirs)) for label, ours, theirs in pairs}
    found["plain offload against no offload"] = largest(losses(ROUND27C, PLAIN), losses(ROUND27C, REFERENCE))
    return found


def equal_time() -> dict:
    """In ZenFlow's time for 96 steps (each run at its speed over steps 5-24), the steps plain offload makes, and the
    loss it reaches there: no offload's mean over the last 8 of those steps, since plain offload trains step for
    step as no offload does (repeat_gaps: its largest per-step difference over its 24 steps is under a
    thousandth of a nat; round 23: +0.002 nats over steps 41-48); `plain_window` names those steps. `worth`: how
    many of plain offload's steps ZenFlow's 96 are worth (the first k whose 8-step mean is as low as ZenFlow's
    over steps 89-96); `tie` the speed ratio ZenFlow would need, `had` the one it has."""
    measured = runs()
    zen, plain, ref = measured[ZENFLOW], measured[PLAIN], measured[REFERENCE]["losses"]
    steps = STEPS * plain["share"] / zen["share"]
    reached = int(steps)
    zen_loss = _window(zen["losses"], STEPS - WINDOW + 1, STEPS)
    worth = next((k for k in range(WINDOW, STEPS + 1) if _window(ref, k - WINDOW + 1, k) <= zen_loss), None)
    assert worth is not None, "no offload never reached ZenFlow's loss: the stand-in says nothing here"
    return dict(plain_steps=steps, plain_window=f"{reached - WINDOW + 1}-{reached}",
                plain_loss=_window(ref, reached - WINDOW + 1, reached), zen_loss=zen_loss,
                worth=worth, tie=STEPS / worth, had=zen["share"] / plain["share"])


def target() -> dict:
    """Chapter 9's ZenFlow target (zenflow_report.round14_target: >= 90% of no offload's tokens/s, loss within
    LOSS_TOLERANCE) over this round, the loss judged over its last 16 steps."""
    return z.round14_target(ROUND27C, (REFERENCE, ZENFLOW), range(STEPS - 15, STEPS + 1),
                            "round 27c, 96 steps on a real H100 80GB, full checkpointing", {ZENFLOW: RUNS[ZENFLOW]})
