"""Chapter 8's routes: the data order HF's Trainer and accelerate see, bad input, the checks that grade the source
tutorials' snippets, the learning-rate and tolerance rules, and one real job: transformers.Trainer + DeepSpeed ZeRO-3
on 2 ranks (the `deepspeed` launcher), with a checkpoint two steps before the end and a second Trainer resuming from
it in the same job."""
import json

import pytest
import torch

from labs import CONFIGS, config, data, launch, models
from labs.course import route_checks, routes, tutorial_snippets
from labs.course.route_batches import LabsOrder, dealt_batches
from labs.errors import LabsError

ROWS = torch.arange(23 * 5).view(23, 5)     # 23 rows: uneven shares, a dropped tail


@pytest.mark.parametrize("world_size, micro_batch", [(2, 2), (3, 1), (2, 3)])
def test_accelerate_deals_labs_order_as_labs_rank_batches(world_size, micro_batch):
    for rank in range(world_size):
        labs_batches = data.rank_batches(ROWS, micro_batch, rank, world_size, seed=7)
        per_epoch = len(LabsOrder(ROWS.shape[0], micro_batch, world_size, 7)) // world_size // micro_batch
        for epoch in range(2):                       # the second epoch reshuffles with seed + 1 in both
            dealt = list(dealt_batches(ROWS, micro_batch, rank, world_size, seed=7, epoch=epoch))
            assert len(dealt) == per_epoch
            for batch in dealt:
                assert torch.equal(batch, next(labs_batches))


def test_too_little_data_is_a_labs_error():
    with pytest.raises(LabsError, match="cannot fill one micro-batch"):
        LabsOrder(3, 2, 2, 0)


def _yaml(tmp_path, text, name="x.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


BAD = [
    (dict(route="keras"), "unknown route 'keras'"),
    (dict(route="trainer", launcher="mpirun"), "unknown launcher for route 'trainer' 'mpirun'"),
    (dict(route="accelerate"), "needs accelerate_config"),
    (dict(route="accelerate", accelerate_config="nowhere.yaml"), "'nowhere.yaml' does not exist"),
    (dict(route="accelerate", accelerate_config="TMP/multi_gpu.yaml"), "distributed_type is 'MULTI_GPU'"),
    (dict(route="accelerate", accelerate_config="TMP/four.yaml"), "num_processes must be an integer"),
    (dict(route="accelerate", accelerate_config="TMP/no_file.yaml"), "deepspeed_config_file is missing"),
    (dict(route="accelerate", accelerate_config="TMP/comments.yaml"), "not valid JSON: line 1"),
    (dict(route="trainer", config="zero2_typo.json"), "config 'zero2_typo.json' does not exist"),
    (dict(route="trainer", checkpoint_step=8), "checkpoint_step 8"),
    (dict(route="accelerate", accelerate_config="accelerate_configs/fsdp2.yaml", checkpoint_step=2),
     "only the trainer route resumes"),
]


@pytest.mark.parametrize("kwargs, message", BAD)
def test_bad_input_is_one_labs_error_before_anything_is_written(tmp_path, kwargs, message):
    _yaml(tmp_path, "distributed_type: MULTI_GPU\nnum_processes: 2\n", "multi_gpu.yaml")
    _yaml(tmp_path, "distributed_type: FSDP\nnum_processes: four\n", "four.yaml")
    _yaml(tmp_path, "distributed_type: DEEPSPEED\nnum_processes: 2\n", "no_file.yaml")
    (tmp_path / "c.json").write_text(tutorial_snippets.ZERO2_JSON.replace('"auto"', "2").replace("{\n", "{ // x\n", 1))
    _yaml(tmp_path, f"distributed_type: DEEPSPEED\nnum_processes: 2\ndeepspeed_config:\n"
                    f"  deepspeed_config_file: {tmp_path / 'c.json'}\n", "comments.yaml")
    if "accelerate_config" in kwargs:
        kwargs = dict(kwargs, accelerate_config=kwargs["accelerate_config"].replace("TMP", str(tmp_path)))
    out = tmp_path / "out"
    with pytest.raises(LabsError, match=message) as error:
        routes.run(out=out, steps=8, **kwargs)
    assert "\n" not in str(error.value)
    assert not out.exists() and not list(tmp_path.glob(".out*"))


def test_launcher_commands(tmp_path):
    spec = routes.prepare("trainer", out=tmp_path / "t", launcher="deepspeed")
    command = routes.launcher_command(spec, tmp_path)
    assert command[1:3] == ["-m", "deepspeed.launcher.runner"] and "--no_local_rank" in command
    assert command[-3:] == ["--module", "labs.course.route_rank", str(tmp_path)]
    spec = routes.prepare("trainer", out=tmp_path / "t", launcher="torchrun")
    assert routes.launcher_command(spec, tmp_path)[1:3] == ["-m", "torch.distributed.run"]
    spec = routes.prepare("accelerate", out=tmp_path / "a", nproc=1,
                          accelerate_config="accelerate_configs/deepspeed_zero2.yaml")     # the YAML says 2
    spec["ds_config"] = "RUN/ds_config.json"
    command = routes.launcher_command(spec, tmp_path)
    assert spec["config"] == str(CONFIGS / "zero2.json")
    assert command[command.index("--deepspeed_config_file") + 1] == "RUN/ds_config.json"
    assert command[command.index("--num_processes") + 1] == "1"          # the run's rank count, over the YAML's


def test_tutorial_json_with_comments_passes_hjson_not_json():
    assert "line 17 column 28" in tutorial_snippets.json_error(tutorial_snippets.ZERO2_JSON)
    assert tutorial_snippets.hjson_error(tutorial_snippets.ZERO2_JSON) is None
    assert tutorial_snippets.json_error(tutorial_snippets.ZERO3_OFFLOAD_JSON) is not None


def test_hf_fills_auto_and_refuses_what_disagrees():
    zero2 = tutorial_snippets.without_comments(tutorial_snippets.ZERO2_JSON)
    filled, error = tutorial_snippets.hf_fill(zero2, world_size=2, per_device_train_batch_size=4, fp16=True)
    assert error is None and filled["train_batch_size"] == 8 and filled["optimizer"]["params"]["lr"] == 5e-5
    assert "fp16.enabled=True vs hf fp16" in tutorial_snippets.hf_fill(zero2, per_device_train_batch_size=4)[1]
    fixed = dict(zero2, train_batch_size=16)
    assert "train_batch_size=16" in tutorial_snippets.hf_fill(fixed, per_device_train_batch_size=4, fp16=True)[1]
    assert "unsupported operand" in tutorial_snippets.deepspeed_error(zero2)        # DeepSpeed itself fills no "auto"
    assert tutorial_snippets.deepspeed_error(filled) is None
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    tutorial_snippets.hf_fill(json.loads((CONFIGS / "zero3.json").read_text()), adam_beta2=0.95)
    assert not is_deepspeed_zero3_enabled()      # no ZeRO-3 config left behind to reroute later model builds


def test_bf16_rounding_and_accelerate_scheduler_rule():
    assert route_checks.bf16_rounding(11.3) == 2.0 ** -5 and route_checks.bf16_rounding(2.7) == 2.0 ** -7
    assert float(torch.tensor(11.3 + 0.9 * 2.0 ** -5).bfloat16()) - 11.3 <= 2.0 ** -5
    assert route_checks.accelerate_scheduler_steps(16, 2) == 8 and route_checks.accelerate_scheduler_steps(9, 2) == 5
    for steps, processes in ((8, 2), (1000, 4), (7, 3)):
        passed = route_checks.dummy_scheduler_steps(steps, processes)
        assert route_checks.accelerate_scheduler_steps(passed, processes) == steps


def test_first_rates_are_zero_and_the_loss_moves_at_step_four(tmp_path):
    """DeepSpeed's WarmupCosineLR gives step 1 rate 0 whatever the config; labs' warm-up from 0 gives step 2 rate 0;
    so steps 1-3 compute on the initial weights. A warm-up from 0.1 leaves only DeepSpeed's zero."""
    _, resolved = launch.prepare(preset="tiny", config="zero3.json", steps=8, nproc=2, out=tmp_path / "x", instruments=())
    rates = route_checks.scheduled_rates(resolved, 8)
    assert rates[:2] == [0.0, 0.0] and all(rate > 0 for rate in rates[2:])
    assert route_checks.steps_on_initial_weights(rates) == 3
    warm = route_checks.scheduled_rates(config.variant(resolved, {"scheduler.params.warmup_min_ratio": 0.1}), 8)
    assert warm[0] == 0.0 and warm[1] > 0 and route_checks.steps_on_initial_weights(warm) == 2
    assert route_checks.rounding_tolerances(rates, 1e-4) == [0.0] * 3 + [1e-3] * 5


# ---------------------------------------------------------------------------------------------- one real job
# Chapter 8's Trainer job, the same run: `make test` trains it once for both (labs.runcache keys routes too).
STEPS, CHECKPOINT = 8, 6


def test_this_is_chapter_8s_trainer_job(tmp_path):
    """The chapter passes its rank count and a checkpoint two steps before the end; the fixture below the defaults."""
    chapter = routes.prepare("trainer", out=tmp_path / "c", config="zero3.json", launcher="deepspeed", steps=8,
                             nproc=routes.chapter_ranks(), checkpoint_step=8 - 2)
    assert chapter == routes.prepare("trainer", out=tmp_path / "t", config="zero3.json", launcher="deepspeed",
                                     steps=STEPS, checkpoint_step=CHECKPOINT)


@pytest.fixture(scope="module")
def trainer_run(tmp_path_factory):
    """Trainer + DeepSpeed ZeRO-3, 8 steps, checkpoint after step 6, a second Trainer resuming from it."""
    return routes.run("trainer", tmp_path_factory.mktemp("routes") / "trainer", config="zero3.json",
                      launcher="deepspeed", steps=STEPS, checkpoint_step=CHECKPOINT)


def test_trainer_runs_on_two_ranks_with_zero3_partitions(trainer_run):
    assert [r["world_size"] for r in trainer_run.ranks] == [2, 2]
    assert (trainer_run.path / "ds_config.json").is_file() and trainer_run.spec["ds_config"].endswith("ds_config.json")
    total = models.param_counts(models.shape("tiny"))["total"]
    assert all(r["param_elements"] == total for r in trainer_run.ranks)
    assert total <= sum(r["param_elements_held"] for r in trainer_run.ranks) < total * 1.001   # halves (+ padding)
    assert trainer_run.ds_config["zero_optimization"]["stage"] == 3


def test_trainer_sees_labs_weights_batches_and_schedule(trainer_run, tmp_path):
    """Step 1 (before any update) is a pure function of the initial weights and the batch: each rank's loss must
    equal the forward of labs.models.build's model on labs.data.rank_batches' first batch for that rank, computed as
    the rank computes it (DeepSpeed's ZeRO-3 Linear, the rank's products: route_checks.replay_loss)."""
    spec = trainer_run.spec
    initial = models.build("tiny", dtype=torch.bfloat16, device=torch.device("cpu"), seed=spec["seed"]).state_dict()
    for rank, record in enumerate(trainer_run.ranks):
        assert route_checks.replay_loss(None, spec, 1, rank, initial, zero3_linear=True) == record["losses"][0]
    _, resolved = launch.prepare(preset="tiny", config="zero3.json", steps=STEPS, nproc=2, out=tmp_path / "x")
    rates = route_checks.scheduled_rates(resolved, STEPS)       # the rate each step used, read before it (as labs)
    assert [m["lr"] for m in trainer_run.metrics] == rates
    # HF's own log shows the rate after the engine stepped the scheduler: the next step's (to 4 significant digits)
    logged = route_checks.trainer_logged_rates(trainer_run.path)[:STEPS - 1]
    assert logged == [float(f"{r:.4g}") for r in rates[1:STEPS]]


def test_resumed_trainer_repeats_every_loss_exactly(trainer_run):
    resumed = trainer_run.resumed
    assert [m["step"] for m in resumed] == list(range(CHECKPOINT + 1, STEPS + 1))
    assert [m["rank_losses"] for m in resumed] == [m["rank_losses"] for m in trainer_run.metrics[CHECKPOINT:]]


def test_zero3_checkpoint_holds_no_weights_but_zero_to_fp32_recovers_them(trainer_run):
    checkpoint = trainer_run.path / "trainer" / f"checkpoint-{CHECKPOINT}"
    assert "model.safetensors" not in route_checks.checkpoint_files(checkpoint)
    weights = route_checks.recovered_weights(checkpoint)
    for rank in (0, 1):
        replayed = route_checks.replay_loss(checkpoint, trainer_run.spec, CHECKPOINT + 1, rank, weights,
                                            zero3_linear=True)
        assert replayed == trainer_run.ranks[rank]["losses"][CHECKPOINT]
    saved = route_checks.safetensors_summary(trainer_run.path / "resumed" / "final" / "model.safetensors")
    assert saved["elements"] == models.param_counts(models.shape("tiny"))["total"]
    assert saved["dtypes"] == ["torch.bfloat16"]
