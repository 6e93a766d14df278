"""Measurement: the bytes real DeepSpeed engines hold (the state_bytes instrument) against labs.memory's prediction.
Tiny preset, 2 CPU ranks, bf16 (what the GPU runs use; fp16 does not run on CPU), 2 steps per stage so the
optimizer states exist when the probe walks the engine (before the last optimizer step)."""
import pytest
import torch

from labs import memory
from labs.course import stages
from labs.instruments import state as state_instrument


def test_ledger_counts_each_storage_once():
    flat = torch.zeros(1000, dtype=torch.bfloat16)
    ledger = state_instrument._Ledger()
    ledger.walk([flat[:500], flat[500:], {"again": flat}], "params", "flat")
    ledger.add(torch.zeros(10, device="meta"), "params", "meta")
    assert ledger.by_device() == {"params": {"cpu": 2000}, "grads": {}, "optimizer": {}, "other": {}}


def test_a_plain_torch_model_and_optimizer_are_walked_too():
    """Engines without DeepSpeed's wrapper (e.g. FSDP2) still get params, grads and Adam states counted."""
    class Engine:
        module = torch.nn.Linear(4, 4)

    engine = Engine()
    engine.optimizer = torch.optim.AdamW(engine.module.parameters())
    engine.module(torch.ones(2, 4)).sum().backward()
    engine.optimizer.step()
    state = state_instrument.engine_state_bytes(engine)
    assert (state["params_bytes"], state["grads_bytes"]) == (80, 80) and state["zero_stage"] is None
    assert state["optimizer_bytes"] == 2 * 80 + 2 * 4          # exp_avg, exp_avg_sq and two step counters


def test_buffer_names_say_what_they_hold():
    names = {"averaged_gradients": "grads", "grad_partitions_flat_buffer": "grads", "ipg_buckets": "grads",
             "single_partition_of_fp32_groups": "optimizer", "fp32_partitioned_groups_flat": "optimizer",
             "bit16_groups_flat": "params", "fp16_partitioned_groups_flat": "params", "loss_scaler": "other"}
    assert {name: state_instrument._category(name) for name in names} == names


@pytest.fixture(scope="module")
def stage_runs(tmp_path_factory):
    return stages.run_stages(tmp_path_factory.mktemp("memory"), steps=2, precision=None, instruments=("state_bytes",))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_each_rank_holds_what_labs_memory_predicts(stage_runs, stage):
    run = stage_runs[stage]
    rows = stages.state_rows({stage: run})
    assert {(r["rank"], r["category"]) for r in rows} == {(rank, c) for rank in (0, 1)
                                                         for c in ("params", "grads", "optimizer")}
    for row in rows:
        assert abs(row["ratio"] - 1) < 0.05, row
    for rank_state in run.summary["state_bytes"]:
        assert rank_state["moment"] == state_instrument.MOMENT and set(rank_state["by_device"]["params"]) == {"cpu"}
        assert rank_state["other_bytes"] < 1000, rank_state["largest"]
        by_device = rank_state["by_device"]
        assert rank_state["total_bytes"] == sum(sum(by_device[c].values()) for c in state_instrument.CATEGORIES)
        sizes = [t["bytes"] for t in rank_state["largest"]]
        assert sizes == sorted(sizes, reverse=True) and sizes[0] <= rank_state["total_bytes"]


def test_what_each_stage_partitions(stage_runs):
    """Relative to ZeRO-0 on the same 9.8 M-parameter model: ZeRO-1/2 halve the optimizer states on 2 ranks
    (and keep bf16 params whole), ZeRO-3 also halves the parameters. The tied embedding is counted once."""
    first = {s: run.summary["state_bytes"][0] for s, run in stage_runs.items()}
    params = memory.estimate("tiny").params
    assert first[0]["params_bytes"] == 2 * params                      # bf16, tied head not double counted
    assert first[0]["optimizer_bytes"] == pytest.approx(12 * params, abs=1000)
    for stage in (1, 2):
        assert first[stage]["optimizer_bytes"] == pytest.approx(6 * params, abs=1000)
        assert first[stage]["params_bytes"] == 2 * params
    assert first[3]["params_bytes"] == pytest.approx(params, rel=0.01)


@pytest.fixture(scope="module")
def offload_run(tmp_path_factory):
    """ZeRO-2 with the optimizer offloaded (DeepSpeedCPUAdam), as chapter 3 runs it: bf16, 8 steps, every instrument
    (the chapter's own run, reused there under `make test`: labs.runcache)."""
    return stages.run_configs(tmp_path_factory.mktemp("offload"),
                              {"zero2_offload": "zero2_offload_optimizer.json"})["zero2_offload"]


def test_zero2_offload_host_bytes_match_labs_memory(offload_run):
    """The host side of ZeRO-2 + optimizer offload, found by name on every rank (fp32 master, Adam's moments, the
    fp32 gradient partition, the bf16 buffer for the updated weights, the host staging buffer), against
    labs.memory's host_per_node_bytes for the same run: byte for byte."""
    from labs.course import offload

    rows = offload.host_rows({"zero2_offload": offload_run})
    assert len(rows) == 1 and rows[0]["ranks"] == 2
    assert rows[0]["measured_bytes"] == rows[0]["predicted_bytes"], rows
    found = {t["what"] for s in offload_run.summary["state_bytes"] for t in s["largest"]}
    assert {"param_buffer_of_bit16_for_cpu_offload_groups[0]", "temp_grad_buffer_for_cpu_offload"} <= found
