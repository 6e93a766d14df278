"""labs.zenflow_moments: one set of moments and counted updates for ZenFlow's CPU Adam. The native step runs here in a
real optimizer process, as ZenFlow starts it, against a plain Adam written out below; tests/test_zenflow.py runs whole
ZenFlow trainings with it."""
import json
from types import SimpleNamespace

import pytest
import torch

from labs import zenflow_moments as zm

BETAS, EPS, LR = (0.9, 0.95), 1e-8, 1e-2


def _adam(grads, steps, sets):
    """Adam (weight decay 0) on one weight starting at 1.0, update k with grads[k] and step steps[k], its moments
    taken from set sets[k]: what the native step computes when it is handed those."""
    weight, moments = 1.0, {}
    for g, t, s in zip(grads, steps, sets):
        m, v = moments.get(s, (0.0, 0.0))
        m, v = BETAS[0] * m + (1 - BETAS[0]) * g, BETAS[1] * v + (1 - BETAS[1]) * g * g
        moments[s] = m, v
        weight -= LR * (m / (1 - BETAS[0] ** t)) / ((v / (1 - BETAS[1] ** t)) ** 0.5 + EPS)
    return weight


def _native(process, grads, steps):
    """ZenFlow's optimizer process (`process`, DeepSpeed's or labs') started as start_optimizer_process starts it,
    on one partition of 16 weights at 1.0; each update k fills gradient buffer k % 2 with grads[k] and submits state
    k % 2 and step steps[k], as the overlapped step alternates them. Returns the partition after the last update."""
    from multiprocessing import get_context

    from deepspeed.ops.op_builder import CPUAdamBuilder
    op = CPUAdamBuilder().load()
    param, buffers, stale = torch.ones(16), (torch.zeros(16), torch.zeros(16)), torch.zeros(16)
    for t in (param, *buffers, stale):
        t.share_memory_()
    ctrl = torch.zeros(op.zenflow_adam_ctrl_size(), dtype=torch.uint8).share_memory_()
    op.zenflow_adam_ctrl_init(ctrl.data_ptr(), 1)
    ctx = get_context("spawn")
    ready = ctx.Event()
    proc = ctx.Process(target=process, args=([(param, *buffers, stale)], ctrl, ready, [0], True), daemon=True)
    proc.start()
    try:
        assert ready.wait(timeout=300), "the optimizer process did not start"
        for k, (g, t) in enumerate(zip(grads, steps)):
            buffers[k % 2].fill_(g)
            op.zenflow_adam_submit(ctrl.data_ptr(), k % 2, t, [LR], [BETAS[0]], [BETAS[1]], [EPS], [0.0], [1])
            assert op.zenflow_adam_wait(ctrl.data_ptr(), 60.0)
        assert torch.equal(stale, param)                     # the copy the training side reads back
        return param.clone()
    finally:
        op.zenflow_adam_ctrl_exit(ctrl.data_ptr())
        proc.join(timeout=30)


def _moves(grads, steps, sets):
    """How far each update moves the weight, in learning rates (down is positive)."""
    weights = [1.0] + [_adam(grads[:k + 1], steps[:k + 1], sets[:k + 1]) for k in range(len(grads))]
    return [round((a - b) / LR, 2) for a, b in zip(weights, weights[1:])]


def test_deepspeeds_process_feeds_two_sets_of_moments_every_other_update_and_labs_feeds_one():
    """Four updates with gradients 1, -1, 1, -1 (steps 4, 8, 12, 16: update_interval 4, DeepSpeed's count). In
    DeepSpeed's process set 0 averages only the 1s and set 1 only the -1s, so every update moves the weight about
    half a learning rate its own way, as if the gradient had never changed sign; with one set the first moment
    averages the signs and the later updates nearly cancel. The native step in each process lands where the plain
    Adam above lands with those sets."""
    from deepspeed.runtime.zenflow.zenflow_utils import zenflow_optimizer_process

    grads, steps = [1.0, -1.0, 1.0, -1.0], [4, 8, 12, 16]
    assert _moves(grads, steps, sets=[0, 1, 0, 1]) == [0.56, -0.46, 0.57, -0.56]
    assert _moves(grads, steps, sets=[0, 0, 0, 0]) == [0.56, -0.03, 0.23, -0.04]
    stock, ours = _native(zenflow_optimizer_process, grads, steps), _native(zm.optimizer_process, grads, steps)
    assert stock.sub(_adam(grads, steps, [0, 1, 0, 1])).abs().max() < 1e-6
    assert ours.sub(_adam(grads, steps, [0, 0, 0, 0])).abs().max() < 1e-6


def test_labs_counts_updates_where_deepspeed_hands_the_engines_step():
    """The overlapped path: what CountedSubmit hands the op, called with DeepSpeed's steps 4, 8, 12 (interval 4), is
    1, 2, 3; the rest of the call and every other attribute go through. Then what that count is worth: with a steady
    gradient Adam moves the weight by the learning rate at every update; DeepSpeed's count, 0.56 of it at the first
    update, 0.73 at the fourth, 1.07 at the sixteenth."""
    handed = []
    op = SimpleNamespace(zenflow_adam_submit=lambda *args: handed.append(args), zenflow_adam_wait=lambda *a: True)
    counted = zm.CountedSubmit(op)
    for step in (4, 8, 12):
        counted.zenflow_adam_submit(7, step % 2, step, [LR], [0.9], [0.95], [EPS], [0.0], [1])
    assert [(a[1], a[2]) for a in handed] == [(0, 1), (0, 2), (0, 3)] and handed[0][3:] == ([LR], [0.9], [0.95],
                                                                                           [EPS], [0.0], [1])
    assert counted.zenflow_adam_wait(7, 1.0) is True
    steady = [1.0] * 16
    assert _moves(steady, list(range(1, 17)), [0] * 16) == [1.0] * 16
    deepspeeds = _moves(steady, list(range(4, 65, 4)), [0] * 16)
    assert (deepspeeds[0], deepspeeds[3], deepspeeds[15]) == (0.56, 0.73, 1.07)


def test_the_sequential_step_counts_each_parameters_updates():
    """ZenFlow without the overlap (ZenFlowCPUAdam._sequential_step): labs' step ignores step_id (the training step's
    number) and counts the updates a parameter has had, so three updates handed steps 4, 8, 12 land where plain
    Adam's steps 1, 2, 3 land, and DeepSpeed's where steps 4, 8, 12 do."""
    from deepspeed.ops.adam.zenflow_cpu_adam import ZenFlowCPUAdam

    def run(step):
        p = torch.nn.Parameter(torch.ones(16))
        optimizer = ZenFlowCPUAdam([p], lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0, adamw_mode=True)
        for step_id in (4, 8, 12):
            p.grad = torch.ones(16)
            step(optimizer, step_id)
        return p.detach()
    assert run(zm.sequential_step).sub(_adam([1.0] * 3, [1, 2, 3], [0] * 3)).abs().max() < 1e-6
    assert run(ZenFlowCPUAdam._sequential_step).sub(_adam([1.0] * 3, [4, 8, 12], [0] * 3)).abs().max() < 1e-6


def test_labs_restates_the_deepspeed_it_runs_with():
    """The hashes of the sources labs.zenflow_moments restates or relies on are those of the DeepSpeed installed."""
    from deepspeed.ops.adam.zenflow_cpu_adam import ZenFlowCPUAdam
    from deepspeed.runtime.zenflow import engine_stage3, zenflow_stage_1_and_2, zenflow_utils

    from labs.zenflow_host import source_sha256
    assert source_sha256(zenflow_utils.zenflow_optimizer_process) == zm.PROCESS_SHA256
    assert source_sha256(zenflow_utils.start_optimizer_process) == zm.START_SHA256
    assert source_sha256(zenflow_stage_1_and_2.ZenFlowZeroOptimizerParallel.zenflow_cpu_optimizer_step) == \
        zm.SUBMIT_STEP_SHA256["zero12"]
    assert source_sha256(engine_stage3.zenflow_cpu_optimizer_overlap_step) == zm.SUBMIT_STEP_SHA256["zero3"]
    assert source_sha256(ZenFlowCPUAdam._sequential_step) == zm.SEQUENTIAL_STEP_SHA256


def test_the_cpu_record_is_like_for_like_and_each_lever_lowers_the_loss_on_every_seed():
    """results/cpu/zenflow_moments (tools/zenflow_moments_loss.py): per seed every run starts from the same loss (same
    weights and batches), each lever, measured on its own, lowers the mean loss of steps 33-48 on every seed, and the
    README's figures are the ones the report computes from the record (and chapter 10 prints)."""
    from labs import ROOT
    from labs.course import zenflow_moments_report as report

    found = report.record()
    assert found["labs_commit"] and set(found["losses"]) == set(report.LABELS)
    for seed in ("0", "1", "2"):
        firsts = {runs[seed][0] for runs in found["losses"].values()}
        assert len(firsts) == 1 and all(len(runs[seed]) == 48 for runs in found["losses"].values())
    assert all(gain > 0 for gains in report.lever_gains(found).values() for gain in gains)
    gaps = {row["run"]: float(row["gap to no offload"]) for row in report.loss_rows(found)[1:]}
    before, after = gaps[report.LABELS["overlap_deepspeed"]], gaps[report.LABELS["overlap_labs"]]
    process = report.optimizer_process_memory()
    readme = " ".join((ROOT / "README.md").read_text().split())
    every_step = gaps[report.LABELS["sequential_labs_interval_1"]]
    assert abs(every_step) < 0.01 < gaps[report.LABELS["sequential_labs"]]       # the interval is the gap
    for figure in (f"{before - after:.3f} of the overlapped run's {before:.3f} nats",
                   f"ends {every_step:.3f} nats from",
                   f"held {process['private_gib']:.1f} GiB"):
        assert figure in readme, figure


def test_round_19_measured_one_set_of_moments_and_the_readme_holds_what_chapter_10_reads():
    """Round 19 on one H200: every fine-tune starts from the same weights at the same tokens per step; the control ran
    without labs.zenflow_moments (its log says so); the optimizer process held one set of moments with labs and two
    without, as labs.memory counts them (within 2%); labs' CPU Adam lowered the loss a little, not to the target; the
    results README's table is what round19_target and round19_moments compute."""
    from labs.course import zenflow_moments_report as zmr, zenflow_report as z

    runs = z.finetune_runs(zmr.ROUND19, zmr.ROUND19_RUNS)
    assert len({round(runs[n]["losses"][0], 6) for n in zmr.ROUND19_RUNS}) == 1
    assert len({runs[n]["micro_batch"] * runs[n]["grad_accum"] for n in zmr.ROUND19_RUNS}) == 1
    assert "labs.zenflow_moments not installed" in (zmr.ROUND19 / "ft_zfm64_ctl" / "job.log").read_text().splitlines()[0]
    assert [z.update_interval(n, zmr.ROUND19) for n in zmr.ROUND19_RUNS[1:]] == [4, 4, 2]
    target, moments = zmr.round19_target(), zmr.round19_moments()
    for found in moments.values():
        assert found["private_gib"] == pytest.approx(found["moments_gib"], rel=0.02)
    assert moments["ft_zfm64_ctl"]["moments_gib"] == pytest.approx(2 * moments["ft_zfm64"]["moments_gib"])
    gaps = target["gaps"]
    assert 0 < gaps["ft_zfm64_ctl"] - gaps["ft_zfm64"] < 0.2 and not target["met"]
    readme = (z.FINETUNE / "README.md").read_text().split("## Round 19")[1]
    for name in zmr.ROUND19_RUNS[1:]:
        memory = f"{moments[name]['private_gib']:.1f} GiB" if name in moments else "not sampled"
        assert f"| {zmr.ROUND19_LABELS[name]} | {target['hidden'][name]:.1%} | {gaps[name]:+.2f} | {memory} |" in readme
    prose = " ".join(readme.split())
    one, two = moments["ft_zfm64"], moments["ft_zfm64_ctl"]
    assert one["least_second"] < one["process_from_second"] and two["least_second"] > two["process_from_second"]
    for figure in (f"by {gaps['ft_zfm64_ctl'] - gaps['ft_zfm64']:.2f} over steps 49-64",
                   f"{one['least_available_running_gib'] - two['least_available_running_gib']:.1f} GiB more available",
                   f"{one['least_available_gib']:.1f} GiB available against the control's "
                   f"{two['least_available_gib']:.1f}, "
                   f"{one['least_available_gib'] - two['least_available_gib']:.1f} GiB less tight"):
        assert figure in prose, figure


def test_equal_time_rests_on_plain_offload_training_like_no_offload_and_counts_steps_by_speed():
    """Chapter 10's verdict: plain offload's loss is read from no offload's (round 10: the same fall over 20 steps
    from the same weights), its steps from its speed; ZenFlow's last 8 steps are worth fewer of no offload's steps
    than plain offload makes in ZenFlow's time, and the train line parses as labs' own arguments."""
    import shlex

    from labs import cli
    from labs.course import zenflow_moments_report as zmr

    eq = zmr.equal_time()
    assert eq["falls"][0] == pytest.approx(eq["falls"][1], abs=0.01)
    assert eq["off_steps"] == pytest.approx(eq["steps"] * eq["off_share"] / eq["zen_share"])
    assert 0.4 < eq["off_share"] < 0.6 and 0.85 < eq["zen_share"] < 0.95
    assert eq["zen_worth"] < eq["off_steps"] and eq["off_loss"] < eq["zen_loss"]
    parser = cli._Parser(prog="labs")
    cli._train_args(parser.add_subparsers(dest="command", parser_class=cli._Parser))
    args = parser.parse_args(shlex.split(zmr.train_line())[1:])
    assert (args.micro_batch, args.grad_accum, args.config) == (8, 1, "bench/labs_zero2_offload_zenflow.json")
