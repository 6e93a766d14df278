"""labs.zenflow_columns: fp32 masters for the columns ZenFlow updates on the GPU. The pure parts run here on small
tensors against DeepSpeed's own selective optimizer; tests/test_zenflow.py runs whole ZenFlow trainings with it."""
import json
from types import SimpleNamespace

import pytest
import torch

from labs import zenflow_columns as zc


def _optimizer(param, lr=1e-5):
    from deepspeed.ops.adam.zenflow_torch_adam import ZenFlowSelectiveAdamW
    return ZenFlowSelectiveAdamW([{"params": [param]}], lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)


def _matrix(value=0.02, rows=4, cols=8, chosen=(1, 5)):
    param = torch.nn.Parameter(torch.full((rows, cols), value, dtype=torch.bfloat16), requires_grad=False)
    param.selected_indices = torch.tensor(chosen, dtype=torch.int32)       # DeepSpeed's dtype for them
    return param


def _steps(step, param, optimizer, n):
    for _ in range(n):
        param.selected_grad = torch.ones(param.shape[0], param.selected_indices.numel(), dtype=torch.bfloat16)
        step(optimizer, {0: [param]})


def test_deepspeeds_bf16_step_leaves_a_weight_of_002_where_it_is_at_lr_1e_5_and_the_fp32_master_moves_it():
    """20 AdamW steps of about 1e-5 each: every one is under half a bf16 step at 0.02 (6.1e-5), so DeepSpeed's update
    of the bf16 weight rounds back each time; labs' fp32 master adds them up and the weight moves by 2e-4."""
    from deepspeed.ops.adam.zenflow_torch_adam import ZenFlowSelectiveAdamW

    bf16 = lambda x: torch.tensor(x).bfloat16()            # noqa: E731
    assert bf16(0.02 - 1e-5) == bf16(0.02) != bf16(0.02 - 2e-4)      # a bf16 step at 0.02 is 2**-13 = 1.2e-4
    stock, ours = _matrix(), _matrix()
    _steps(ZenFlowSelectiveAdamW.group_step, stock, _optimizer(stock), 20)
    assert (stock == bf16(0.02)).all()
    optimizer = _optimizer(ours)
    _steps(zc.group_step, ours, optimizer, 20)
    start = bf16(0.02).float()                               # 0.0200195...: the weight is bf16 from the start
    chosen, others = ours[:, [1, 5]].float(), ours[:, [0, 2, 3, 4, 6, 7]]
    assert chosen.sub(start - 20e-5).abs().max() < 1e-4 and (others == start).all()
    master = getattr(ours, zc._MASTER)
    assert master.dtype == torch.float32 and master.shape == (4, 2)
    assert master.sub(start - 20e-5).abs().max() < 2e-6        # Adam with a steady gradient: lr per step
    assert optimizer.state[ours]["exp_avg"].dtype == torch.float32
    assert torch.equal(ours[:, [1, 5]], master.to(torch.bfloat16))


def test_a_vector_is_updated_whole_in_fp32():
    vector = torch.nn.Parameter(torch.ones(6, dtype=torch.bfloat16), requires_grad=False)
    optimizer = _optimizer(vector)
    for _ in range(30):                 # a bf16 step at 1.0 is 2**-7: 30 steps of 1e-5 still round to 1.0
        vector.selected_grad = torch.ones(6, dtype=torch.bfloat16)
        zc.step_without_offload(optimizer)
    assert getattr(vector, zc._MASTER).sub(1 - 30e-5).abs().max() < 2e-6
    assert (vector == 1).all()


def test_columns_chosen_again_keep_their_fp32_values_and_new_ones_start_from_the_bf16_weights():
    param = _matrix(rows=3, cols=6, chosen=(0, 2, 4))
    param.data = torch.arange(18, dtype=torch.bfloat16).view(3, 6)
    master = zc.fp32_columns(param)
    master += 0.25                                            # what fp32 steps would have added
    assert zc.fp32_columns(param) is master                   # the same choice: the same master
    param.selected_indices = torch.tensor([2, 3], dtype=torch.int32)
    again = zc.fp32_columns(param)
    assert torch.equal(again[:, 0], master[:, 1])             # column 2, kept
    assert torch.equal(again[:, 1], param.data[:, 3].float())  # column 3, new


def _optimizer_stub(params, partition, positions):
    ids = {id(p): k for k, p in enumerate(params)}
    return SimpleNamespace(params_in_partition=[params], single_partition_of_fp32_groups=[partition],
                           grad_position={ids[id(p)]: [0] + pos for p, pos in zip(params, positions)},
                           get_param_id=lambda p: ids[id(p)], micro_step=4,
                           selective_optimizer=SimpleNamespace(offload=False))


def test_the_refresh_writes_only_the_gpus_values_exactly_where_zenflows_flat_partition_keeps_them():
    """A rank's fp32 partition that starts 2 elements into a [3, 5] matrix (stored transposed: column j is elements
    3j .. 3j+2) and ends with 4 elements of a vector. The matrix's column 0 is cut by the partition's edge, so never
    chosen there; columns 1 and 3 are the GPU's. Everything else keeps the CPU's values."""
    matrix = _matrix(rows=3, cols=5, chosen=(1, 3))
    vector = torch.nn.Parameter(torch.zeros(6, dtype=torch.bfloat16), requires_grad=False)
    setattr(matrix, zc._MASTER, torch.tensor([[1.0, 2.0], [1.5, 2.5], [1.25, 2.25]]) + 1e-3)
    setattr(matrix, zc._CHOSEN, matrix.selected_indices)
    setattr(vector, zc._MASTER, torch.arange(6.0) + 1e-3)
    cpu = torch.full((13 + 4,), -7.0)
    cpu.stale_param = cpu.clone()                  # the copy the optimizer process hands back (overlapped step)
    stub = _optimizer_stub([matrix, vector], cpu, [[2, 0, 13], [0, 13, 4]])
    zc.sync_fp32_param_from_gpu(stub)
    expected = torch.full((17,), -7.0)
    expected[1:4] = torch.tensor([1.0, 1.5, 1.25]) + 1e-3      # column 1: matrix elements 3-5, partition 1-3
    expected[7:10] = torch.tensor([2.0, 2.5, 2.25]) + 1e-3     # column 3: elements 9-11
    expected[13:] = torch.arange(4.0) + 1e-3
    assert torch.equal(cpu, expected) and torch.equal(cpu.stale_param, expected)
    first, count, columns, places = zc.master_positions(matrix, 2, 13)
    assert (first, count, columns.tolist(), places.tolist()) == (1, 4, [0, 2], [0, 1])


def test_labs_restates_the_selective_optimizer_it_runs_with():
    from deepspeed.ops.adam.zenflow_torch_adam import ZenFlowSelectiveAdamW as adam

    if adam.group_step is not zc.group_step:           # another test may have installed it in this process
        assert zc.source_sha256(adam.group_step) == zc.GROUP_STEP_SHA256
        assert zc.source_sha256(adam._step_without_offload) == zc.STEP_SHA256


def test_labs_memory_counts_12_bytes_per_chosen_element_where_deepspeed_keeps_4():
    from labs import config, memory, models
    from labs.memory.layout import zenflow_selected_elements

    raw = config.load(config.find("bench/labs_zero2_offload_zenflow.json"))
    ours, stock = (memory.estimate("qwen2.5-3b", ds_config=raw, micro_batch=8, seq_len=4096, zenflow_columns=c)
                   for c in ("labs", "deepspeed"))
    assert ours.total_per_gpu_bytes - stock.total_per_gpu_bytes == \
        8 * zenflow_selected_elements(models.shape("qwen2.5-3b"), 0.1)


def test_round_18_ran_like_for_like_and_its_readme_holds_what_chapter_10_computes():
    """Round 18 on one H200: no offload, ZenFlow with the fix choosing once and every 4 steps, and the control with
    DeepSpeed's bf16 columns, from the same weights on the same batches (same first loss, same tokens per step). The
    fix costs the GPU 8 bytes per chosen element, as labs.memory says, and every peak is within 1% of its prediction;
    the control repeats round 17's run without the fix; the results README's figures are the computed ones."""
    from labs import models
    from labs.course import zenflow_columns_report as zc, zenflow_report as z
    from labs.memory.layout import zenflow_selected_elements

    runs = z.finetune_runs(zc.ROUND18, zc.ROUND18_RUNS)
    assert len({round(runs[n]["losses"][0], 6) for n in zc.ROUND18_RUNS}) == 1
    assert len({runs[n]["micro_batch"] * runs[n]["grad_accum"] for n in zc.ROUND18_RUNS}) == 1
    control_log = (zc.ROUND18 / "ft_zf64_ds" / "job.log").read_text().splitlines()[0]
    assert "labs.zenflow_columns not installed" in control_log
    target, peaks = zc.round18_target(), zc.peaks()
    gaps = target["gaps"]
    assert gaps["ft_zf64_ds"] - gaps["ft_zfc64"] > 0.3 and not target["met"]
    assert gaps["ft_zf64_ds"] == pytest.approx(z.round17_target()["gaps"]["ft_zf64"], abs=0.05)
    extra = peaks["ft_zfc64"]["measured"] - peaks["ft_zf64_ds"]["measured"]
    assert extra == pytest.approx(8 * zenflow_selected_elements(models.shape("qwen2.5-3b"), 0.1), rel=0.02)
    assert all(p["measured"] / p["predicted"] == pytest.approx(1, abs=0.01) for p in peaks.values())
    readme = (z.FINETUNE / "README.md").read_text().split("## Round 18")[1]
    for name in zc.ROUND18_RUNS[1:]:
        assert f"| {zc.LABELS[name]}{' (control)' if name == 'ft_zf64_ds' else ''} | " \
               f"{target['hidden'][name]:.1%} | {gaps[name]:+.2f} | {peaks[name]['measured'] / 2**30:.2f} GiB |" in readme
    assert f"closes {gaps['ft_zf64_ds'] - gaps['ft_zfc64']:.2f} of the {gaps['ft_zf64_ds']:.2f} nats" in readme
    assert f"It costs {extra / 2**30:.2f} GiB" in readme
    assert f"about step {zc.caught_up('ft_zfc64')} (the control:\nstep {zc.caught_up('ft_zf64_ds')})" in readme
    ours, before = ([ms for ms in z.selection_ms(name, folder, timer="selective_optimizer_sync") if ms > 1]
                    for name, folder in (("ft_zfc_sel4_64", zc.ROUND18), ("ft_zf_sel4_64", z.ROUND17)))
    assert f"about {sum(ours) / len(ours):.0f} ms per choice, against {sum(before) / len(before):.0f} ms" in \
        " ".join(readme.split())


def test_the_cpu_measurement_shows_the_chosen_columns_standing_still_and_the_fix_moving_them():
    from labs.course import zenflow_columns_report as zc

    runs = zc.cpu_shares()["runs"]
    assert runs["deepspeed_chosen_once"]["chosen"]["moved_share"] < 0.3 < 0.9 < \
        runs["labs_chosen_once"]["chosen"]["moved_share"]
    assert runs["labs_chosen_once"]["chosen"]["distance_to_no_offload"] < 0.2 < \
        runs["deepspeed_chosen_once"]["chosen"]["distance_to_no_offload"]
    assert runs["labs_chosen_every_4"]["rest"]["moved_share"] > 3 * runs["deepspeed_chosen_every_4"]["rest"]["moved_share"]
