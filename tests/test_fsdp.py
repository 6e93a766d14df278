"""FSDP2 behind the DeepSpeed engine's interface: the "fsdp" config block (parsed, checked, selecting the engine),
labs.memory's FSDP2 model, and one real 2-rank pair, FSDP2 against ZeRO-3 in bf16, same seed and data: losses,
bytes held, bytes moved and checkpoint formats."""
import pytest
import torch

from conftest import ROOT
from labs import config, fsdp, launch, memory, models, preflight, resolve
from labs.course import exercises, fsdp_probes, fsdp_vs_zero
from labs.errors import LabsError

CONFIGS = ROOT / "ds_configs"
FSDP_FILES = sorted(p for p in CONFIGS.glob("*.json") if "fsdp" in config.load(p))
TINY = models.param_counts(models.shape("tiny"))["total"]
STEPS = 6           # chapter 7's: its first row is this pair (reused under `make test`, labs.runcache)


# ---------------------------------------------------------------------------------------------- the config block
@pytest.mark.parametrize("path", FSDP_FILES, ids=[p.name for p in FSDP_FILES])
def test_every_fsdp_file_resolves_and_selects_fsdp2(path):
    """FSDP2 files are checked by labs' own parser (DeepSpeed would ignore the block): they resolve for the ranks
    the chapter runs them on, and the block alone selects the engine."""
    ranks = next(row.ranks for row in fsdp_vs_zero.MAPPING if row.fsdp_file == path.name)
    spec, resolved = launch.prepare(config=path, nproc=ranks, steps=4)
    assert spec["engine"] == "fsdp2" and "zero_optimization" not in resolved
    assert resolved["fsdp"] == fsdp.settings(resolved, ranks) and set(resolved["fsdp"]) == set(fsdp.DEFAULTS)


def test_strategies_of_the_files():
    names = {row.fsdp_file: fsdp.strategy(fsdp.settings(config.load(CONFIGS / row.fsdp_file), row.ranks), row.ranks)
             for row in fsdp_vs_zero.MAPPING}
    assert names == {"fsdp2.json": "FULL_SHARD", "fsdp2_shard_grad_op.json": "SHARD_GRAD_OP",
                     "fsdp2_no_shard.json": "NO_SHARD", "fsdp2_hybrid.json": "HYBRID_SHARD",
                     "fsdp2_offload.json": "FULL_SHARD"}
    assert fsdp.settings({"fsdp": {"replicas": "all"}}, 8)["replicas"] == 8
    assert fsdp.settings({"fsdp": {"reshard_after_forward": 2}}, 8)["reshard_after_forward"] == 2


@pytest.mark.parametrize("block, ranks, message", [
    ({"offload": "nvme"}, 2, "'fsdp.offload' is 'nvme'"),
    ({"reshard": False}, 2, "'fsdp.reshard' is unknown"),
    ({"replicas": 3}, 4, "'fsdp.replicas' is 3: it must divide the 4 ranks"),
    ({"replicas": 0}, 4, "'fsdp.replicas' is 0"),
    ({"reshard_after_forward": 4}, 4, "'fsdp.reshard_after_forward' is 4"),
    ({"reshard_after_forward": "yes"}, 4, "'fsdp.reshard_after_forward' is 'yes'"),
])
def test_bad_settings_name_the_key(block, ranks, message):
    with pytest.raises(LabsError, match=message):
        fsdp.settings({"fsdp": block}, ranks)


def test_engine_choice_and_refusals(tmp_path):
    fsdp2 = config.load(CONFIGS / "fsdp2.json")
    assert resolve.engine(fsdp2) == "fsdp2" and resolve.engine(config.load(CONFIGS / "zero3.json")) == "deepspeed"
    assert resolve.engine(config.load(CONFIGS / "zero3.json"), "fsdp2") == "fsdp2"     # the bench's FSDP2 cases
    with pytest.raises(LabsError, match="config key 'fsdp' sets up FSDP2 but the engine is deepspeed"):
        launch.prepare(config=CONFIGS / "fsdp2.json", engine="deepspeed", out=tmp_path / "run")
    with pytest.raises(LabsError, match="zero_optimization.offload_optimizer' is DeepSpeed's"):
        launch.prepare(config=CONFIGS / "zero3_offload_optimizer.json", engine="fsdp2", out=tmp_path / "run")
    with pytest.raises(LabsError, match="labs runs FSDP2 in bf16 or fp32"):
        fsdp.settings(config.variant(fsdp2, {"fp16.enabled": True}), 2)
    assert not (tmp_path / "run").exists()
    assert config.offloads(config.load(CONFIGS / "fsdp2_offload.json")) == {"optimizer": "cpu", "param": "cpu"}


def test_memory_model_follows_the_block():
    """16 bytes per parameter (fp32 params and grads, Adam) over the ranks of a shard group; offload moves them to
    the host; SHARD_GRAD_OP keeps every gathered bf16 layer from forward to backward."""
    def estimate(file, gpus, nodes=1):
        return memory.estimate("tiny", gpus_per_node=gpus, nodes=nodes, engine="fsdp2",
                               ds_config=config.load(CONFIGS / file))

    def held(est):
        return sum(est.resident_per_rank[0][f"{c}_bytes"] for c in ("params", "grads", "optimizer"))

    assert held(estimate("fsdp2.json", 2)) == 16 * TINY // 2
    assert held(estimate("fsdp2_no_shard.json", 2)) == 16 * TINY
    assert held(estimate("fsdp2_hybrid.json", 4)) == held(estimate("fsdp2.json", 2))
    offloaded = estimate("fsdp2_offload.json", 2)
    assert offloaded.host_per_node_bytes == 16 * TINY and offloaded.phases["optimizer_step"]["params"] == 0
    kept = estimate("fsdp2_shard_grad_op.json", 2).phases["loss_backward"]["buffers"] - \
        estimate("fsdp2.json", 2).phases["loss_backward"]["buffers"]
    layer = models.param_counts(models.shape("tiny"))["per_layer"]
    assert kept == 2 * layer * models.shape("tiny")["num_hidden_layers"]


def test_exercise_checkers():
    for id, right, wrong in (("07.1", 14.19, 7.1), ("07.2", 14.19, 7.1), ("07.3", 444.5, 889.0),
                             ("07.4", 56.74, 113.5),       # the shards of 8 ranks per host, not the whole model
                             ("07.5", 0.899, 0.735)):      # the lr-0 steps count: not the first gradient's 0.735
        assert exercises.check(id, right) and not exercises.check(id, wrong), id


def test_adam_bias_correction_shift():
    assert fsdp_vs_zero.adam_update_ratio((0.9, 0.95), steps_before=0) == pytest.approx(1.0)
    assert fsdp_vs_zero.adam_update_ratio((0.9, 0.95), steps_before=1) == pytest.approx(0.735, abs=1e-3)
    assert fsdp_vs_zero.adam_update_ratio((0.9, 0.95), steps_before=1, real_steps=3) == pytest.approx(0.899, abs=1e-3)


def test_schedule_starts_with_lr_zero_steps():
    """WarmupCosineLR as labs resolves it for the chapter's 6 steps: lr 0 twice, then the warm-up's half peak."""
    lrs = fsdp_vs_zero.schedule_lrs("zero0_ddp.json", 6)
    peak = resolve.run_defaults("tiny")["lr"]
    assert lrs[:3] == [0.0, 0.0, pytest.approx(peak / 2)] and max(lrs) < peak


def test_cpu_ranks_on_any_host(tmp_path):
    """device='cpu' gives CPU ranks whatever the host has; 'cuda' without a GPU is refused; rows that need more
    ranks than fit are skipped with one printed line, before anything starts."""
    spec, _ = launch.prepare(config=CONFIGS / "fsdp2.json", steps=2, device="cpu", out=tmp_path / "run")
    assert spec["device"] == "cpu" and spec["nproc"] == 2
    if not torch.cuda.is_available():
        with pytest.raises(LabsError, match="device 'cuda': this machine has no GPU"):
            launch.prepare(config=CONFIGS / "fsdp2.json", steps=2, device="cuda", out=tmp_path / "run")
    with pytest.raises(LabsError, match="unknown device 'tpu'"):
        launch.prepare(config=CONFIGS / "fsdp2.json", steps=2, device="tpu", out=tmp_path / "run")
    too_many = fsdp_vs_zero.Row("too many", "", "fsdp2.json", "", "zero3.json", preflight.ranks_that_fit(False) + 1)
    assert fsdp_vs_zero.run_mapping(tmp_path / "runs", rows=(too_many,)) == {}
    assert not (tmp_path / "run").exists() and not (tmp_path / "runs").exists()


def test_bf16_grid_probe():
    """After one update at lr 1e-5, a fp32 master that started on the bf16 grid (DeepSpeed's) has changed fewer
    bf16 weights, and lowered the loss less, than one that started off it (FSDP2's). (The notebook runs the
    longer comparison, with the chapter's lr as the control.)"""
    [small] = fsdp_vs_zero.grid_summary(fsdp_probes.bf16_grid(lrs=(1e-5,), steps=2))
    assert small["on_changed"] < small["off_changed"]
    assert 0 < small["on_fell"] < small["off_fell"]


# ---------------------------------------------------------------------------------------------- real ranks
def test_optimizer_probes():
    """An optimizer built before fully_shard holds none of the trained parameters and its step changes nothing;
    DeepSpeed's bf16 engine without ZeRO has counted one Adam step before training, the ZeRO stages none."""
    found = fsdp_probes.optimizers()
    order = found["order"]
    assert order["still_model_parameters"] == 0 and order["early_step_change"] == 0.0
    assert order["late_step_change"] > 0.01 and order["parameter_type"] == "DTensor"
    assert {stage: s["adam_steps"] for stage, s in found["deepspeed_steps"].items()} == \
        {"0": 1.0, "1": 0.0, "2": 0.0, "3": 0.0}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return fsdp_vs_zero.run_mapping(tmp_path_factory.mktemp("fsdp"), steps=STEPS, rows=fsdp_vs_zero.MAPPING[:1])[
        "full shard"]


def test_fsdp2_and_zero3_train_the_same_model(pair):
    result = fsdp_vs_zero.parity(pair)
    assert result["steps"] == STEPS and result["same_start"]          # same weights, same bf16 forward
    assert result["moved"] > 0.1, "the model did not train: the comparison would prove nothing"
    assert result["within"], result


def test_bytes_held_and_moved(pair):
    held = {engine: fsdp_vs_zero.held(pair[engine]) for engine in fsdp_vs_zero.ENGINES}
    assert held["fsdp2"]["dtypes"]["params"] == "float32" and held["deepspeed"]["dtypes"]["params"] == "bfloat16"
    assert held["fsdp2"]["params"] == 4 * TINY // 2 and held["fsdp2"]["grads"] == 4 * TINY // 2
    assert held["deepspeed"]["params"] == pytest.approx(2 * TINY / 2, rel=0.001)
    for engine in fsdp_vs_zero.ENGINES:                               # 16 bytes per parameter, over 2 ranks
        assert held[engine]["total"] == pytest.approx(8 * TINY, rel=0.001)
        assert held[engine]["total"] == pytest.approx(held[engine]["predicted"], rel=0.001)
    moved = {r["engine"]: r for r in fsdp_vs_zero.comm_rows({"full shard": pair})}
    assert moved["fsdp2"]["reduce_scatter_per_param"] == pytest.approx(4.0, rel=0.01)      # reduce_dtype fp32
    assert moved["deepspeed"]["reduce_scatter_per_param"] == pytest.approx(2.0, rel=0.01)  # bf16
    assert moved["fsdp2"]["all_gather_per_param"] == pytest.approx(2.0, rel=0.02)          # param_dtype bf16


def test_checkpoint_formats(pair):
    rows = {(r["engine"], r["kind"], r["name"].split(".")[-2]): r for r in fsdp_vs_zero.state_dict_rows(pair)}
    saved = rows[("fsdp2", "saved", "embed_tokens")]
    assert saved["type"] == "DTensor" and saved["placement"] == "(Shard(dim=0),)"
    assert saved["local_shape"][0] * 2 == saved["full_shape"][0]
    assert rows[("deepspeed", "saved", "embed_tokens")]["local_shape"] == [0]     # ZeRO-3 placeholders
    for engine in fsdp_vs_zero.ENGINES:
        gathered = rows[(engine, "gathered", "embed_tokens")]
        assert gathered["dtype"] == "float32" and gathered["local_shape"] == saved["full_shape"]
    files = [f["name"] for f in fsdp_vs_zero.checkpoint_files(pair["fsdp2"])]
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    # What fills a rank's file: DeepSpeed 12 bytes per owned parameter (fp32 master, Adam's two moments); DCP the
    # same 12 plus the tied head written again under its own name.
    contents = {(r["engine"], r["what"]): r["per_param"] for r in fsdp_vs_zero.checkpoint_contents(pair)}
    assert sum(v for (e, _), v in contents.items() if e == "deepspeed") == pytest.approx(12, rel=0.001)
    assert contents[("fsdp2", "tied head: the embedding again")] == pytest.approx(4, rel=0.02)
    assert sum(v for (e, _), v in contents.items() if e == "fsdp2") == pytest.approx(16, rel=0.01)
    assert pair["fsdp2"].summary["state_dict"][1]["full_keys"] == 0      # the full state dict lands on rank 0 only
