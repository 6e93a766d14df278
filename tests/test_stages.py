"""Chapter 2's four real 2-rank launches, fp32, same seed and data: ZeRO-0 and ZeRO-3 must give the same losses, and
the rank loop's counters and probes must report what each stage holds and moves. The runs are chapter 2's (same steps,
instruments and knobs), so under `make test` the chapter reuses them (labs.runcache): ZeRO-1 and ZeRO-2, which only
the memory check reads here, are trained once for both."""
import pytest

from labs import CONFIGS, config, models, resolve
from labs.course import stages
from labs.instruments import comm

STEPS = 8           # chapter 2's stage runs


@pytest.fixture(scope="module")
def stage_runs(tmp_path_factory):
    return stages.run_stages(tmp_path_factory.mktemp("stages"), steps=STEPS)


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
    knob runs (5 steps on the stage runs' 8-step learning-rate schedule, every instrument)."""
    z = "zero_optimization."
    variants = {"zero3_reuse_0_prefetch_0": ("zero3.json", {z + "stage3_max_reuse_distance": 0,
                                                            z + "stage3_prefetch_bucket_size": 0})}
    return stages.run_variants(tmp_path_factory.mktemp("variants"), variants, steps=5,
                               schedule_steps=STEPS)["zero3_reuse_0_prefetch_0"]


def test_a_variant_steps_at_the_stage_runs_rates_and_trains_the_same(stage_runs, released_run):
    """Its learning rates are the 8-step runs' first five (the first two 0: labs' warm-up), so its losses compare step
    by step; the last two follow real updates."""
    rates = [r["lr"] for r in stage_runs[0].metrics]
    assert [r["lr"] for r in released_run.metrics] == rates[:5] and rates[:2] == [0.0, 0.0] and rates[2] > 0
    assert stages.updated_steps(released_run) == [4, 5] and stages.updated_steps(stage_runs[0]) == [4, 5, 6, 7, 8]
    assert max(abs(a - b) for a, b in zip(released_run.losses, stage_runs[0].losses)) <= 1e-5


def test_a_variant_on_a_longer_schedule_gets_that_runs_warm_up():
    """schedule_steps gives a variant the scheduler of a run that long, its warm-up included (labs.resolve's rule: a
    tenth of the steps, at least 2): a 5-step variant on a 40-step schedule warms up over 4 steps like the 40-step run,
    not over the 2 its own 5 steps would give. Config only, no run."""
    dims = models.shape("tiny")

    def schedule(raw, steps):
        resolved = resolve.ds_config(raw, world_size=2, dims=dims, steps=steps, on_gpu=False, preset="tiny")
        return resolved["scheduler"]["params"]

    change = {"zero_optimization.stage3_max_reuse_distance": 0}
    long_run = schedule(config.variant(config.load(CONFIGS / "zero3.json"), change), 40)
    assert long_run["total_num_steps"] == 40 and long_run["warmup_num_steps"] == 4
    for schedule_steps in (20, 40, 100):
        variant = schedule(stages.variant_config("zero3.json", change, schedule_steps=schedule_steps), 5)
        assert variant["total_num_steps"] == schedule_steps
        assert variant["warmup_num_steps"] == max(2, schedule_steps // 10)
    assert schedule(stages.variant_config("zero3.json", change, schedule_steps=40), 5) == long_run
    assert schedule(stages.variant_config("zero3.json", change), 5)["warmup_num_steps"] == 2      # its own 5 steps
    typed = stages.variant_config("zero3.json", {"scheduler.params.warmup_num_steps": 7}, schedule_steps=40)
    assert typed["scheduler"]["params"]["warmup_num_steps"] == 7                                 # a typed count stays


def test_every_rank_against_labs_memory(stage_runs):
    """What chapter 2 prints under its table: 24 rows (4 stages x 2 ranks x 3 categories), 10 of them equal to the
    byte, all within 1%; the largest gap is torch's AdamW step counter, 4 bytes per parameter tensor (26 in tiny),
    which labs.memory leaves out."""
    rows = stages.state_rows(stage_runs)
    first, *named = stages.mismatches(stage_runs, rows)
    assert not named and first == ("24 rows (every stage, rank and category): 10 equal to the byte, every row within "
                                   "1% of the prediction; the largest gap +104 bytes (ZeRO-0 rank 0 optimizer)")
    assert {(r["stage"], r["rank"]) for r in rows} == {(s, r) for s in range(4) for r in range(2)}


def test_what_zero2_saves_over_zero1_and_the_bf16_optimizer():
    """labs.memory's moments: ZeRO-1 ends backward with every bf16 gradient, ZeRO-2 with its partition; both hold the
    partition at the optimizer step. In fp32 ZeRO-1 keeps 3/4 of ZeRO-0's optimizer bytes on 2 ranks, in bf16 1/2."""
    one, two = stages.gradient_moments("qwen2.5-7b", gpus=8)
    params = models.param_counts(models.shape("qwen2.5-7b"))["total"]
    assert one["end_grads"] == 2 * params and two["end_grads"] == two["step_grads"] == one["step_grads"]
    assert two["end_grads"] < params / 3
    ratios = {r["precision"]: r["ratio"] for r in stages.optimizer_ratios("tiny", gpus=2)}
    assert ratios == {"fp32": 0.75, "bf16": 0.5}


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
