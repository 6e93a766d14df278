"""Two real 2-rank launches, fp32, same seed and data: ZeRO-0 and ZeRO-3 must give the same losses, and the
rank loop's counters and probes must report what each stage holds and moves. The runs are chapter 2's (same steps,
instruments and knobs), so under `make test` the chapter reuses them (labs.runcache)."""
import pytest

from labs import models, resolve
from labs.course import stages
from labs.instruments import comm

STEPS = 8           # chapter 2's stage runs


@pytest.fixture(scope="module")
def stage_runs(tmp_path_factory):
    return stages.run_stages(tmp_path_factory.mktemp("stages"), steps=STEPS, stages=(0, 3))


def test_zero0_and_zero3_losses_agree_in_fp32(stage_runs):
    zero0, zero3 = stage_runs[0].losses, stage_runs[3].losses
    assert len(zero0) == len(zero3) == STEPS
    assert zero0[-1] < zero0[0] - 0.1, "the model did not train: the comparison would prove nothing"
    assert stages.loss_differences(stage_runs)[3] <= 1e-5, (zero0, zero3)


def test_bytes_moved_per_step(stage_runs):
    rows = {row["stage"]: row for row in stages.comm_rows(stage_runs)}
    psi = rows[0]["psi_bytes"]
    assert psi == 9_822_784 * 4
    assert rows[0]["volume_psi"] == pytest.approx(2.0, abs=0.01)          # DDP: one all-reduce of the gradients
    assert rows[3]["reduce_scatter_bytes"] == psi                         # ZeRO-3: each gradient reduce-scattered
    assert rows[3]["all_gather_bytes"] == pytest.approx(psi, rel=0.01)    # gathered once: kept for backward
    first = stage_runs[3].metrics[0]["comm"]["all_gather"]["bytes"]
    assert first > 3 * psi                                                # step 1 has no trace: gathers every use
    totals = stage_runs[3].summary["comm"]
    assert len(totals) == 2 and totals[0]["reduce_scatter"]["bytes"] == STEPS * psi


def test_bytes_held_per_rank(stage_runs):
    held = {stage: run.summary["state_bytes"][0] for stage, run in stage_runs.items()}
    assert held[3]["params_bytes"] / held[0]["params_bytes"] == pytest.approx(0.5, abs=0.01)
    buffers = stage_runs[3].summary["zero_buffers"][0]
    assert buffers["persistent_elements"] == 576                  # norm weights and q/k/v biases of 2 layers
    assert buffers["gathered_peak_elements"] == 9_822_784 - 576   # the whole partitioned model, at peak
    assert buffers["bucket_bytes"] == 64 * 64 * 4                 # one reduce bucket of hidden^2 fp32 elements
    assert stage_runs[0].summary["zero_buffers"][0]["step_optimizer"] == "AdamW"


@pytest.fixture(scope="module")
def released_run(tmp_path_factory):
    """ZeRO-3 releasing every parameter after each use (reuse distance 0) and prefetching nothing: one of chapter 2's
    knob runs (3 steps, every instrument)."""
    z = "zero_optimization."
    variants = {"zero3_reuse_0_prefetch_0": ("zero3.json", {z + "stage3_max_reuse_distance": 0,
                                                            z + "stage3_prefetch_bucket_size": 0})}
    return stages.run_variants(tmp_path_factory.mktemp("variants"), variants, steps=3)["zero3_reuse_0_prefetch_0"]


def test_zero3_gathers_match_the_reuse_distance_model(stage_runs, released_run):
    """labs.instruments.comm.zero3_gathered_elements against the all-gathered bytes counted per step: the file's
    reuse distance keeps every parameter from forward to backward (one gather each); distance 0 gathers the tied
    embedding at each of its four uses and every other partitioned parameter twice."""
    dims = models.shape("tiny")
    for run, gathers in ((stage_runs[3], 1.0), (released_run, 3.98)):
        knobs = resolve.zero_knobs(run.ds_config)
        predicted = comm.zero3_gathered_elements(dims, knobs["stage3_max_reuse_distance"],
                                                 knobs["stage3_param_persistence_threshold"])
        measured = comm.per_step(run.metrics)["all_gather"]["bytes"]
        assert measured == 4 * predicted and round(predicted / run.summary["params"], 2) == gathers
