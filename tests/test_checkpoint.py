"""Checkpoints end to end, on real 2-rank runs of the tiny preset: a rank killed mid-run and a crash during a save,
each resumed from the last complete checkpoint and reproducing the logged losses exactly (ZeRO-3 and ZeRO-2); a
2-rank ZeRO-3 checkpoint resumed on 1 rank through the universal checkpoint; the export reloaded by transformers
with the engine's logits; the universal copy's bytes per parameter at ZeRO-2 and ZeRO-3. Six launches serve
every test here (module fixtures and one 1-rank run)."""
import json
from pathlib import Path

import pytest
import torch

from conftest import run_labs
from labs import checkpoint, launch
from labs.course import checkpoints
from labs.errors import LabsError, RankFailed

ZERO3_16BIT = {"zero_optimization.stage3_gather_16bit_weights_on_model_save": True}


@pytest.fixture(scope="module")
def zero3_killed(tmp_path_factory):
    """ZeRO-3 (gathering a 16-bit model on every save), 8 steps, a checkpoint every 4: rank 1 SIGKILLs itself
    right after step 7. Then the run resumed in place."""
    root = tmp_path_factory.mktemp("z3")
    config = checkpoints.config_variant("zero3.json", ZERO3_16BIT, root / "zero3_16bit.json")
    killed, message = checkpoints.crashed_run("1:step:7", config=config, steps=8, save_every=4, out=root / "run")
    snapshot = dict(losses=killed.losses, interrupted=killed.interrupted, names=sorted(p.name for p in root.iterdir()))
    resumed = launch.run(resume=root / "run", instruments=("state_bytes", "probe_logits"), stream=False)
    return dict(root=root, message=message, killed=snapshot, resumed=resumed)


@pytest.fixture(scope="module")
def zero2_crashed_in_save(tmp_path_factory):
    """ZeRO-2, 8 steps, a checkpoint every 3: rank 1 dies while the step-6 checkpoint is being written (after
    DeepSpeed wrote its files, before its RNG file and the publish). Then resumed into a second folder."""
    root = tmp_path_factory.mktemp("z2")
    crashed, message = checkpoints.crashed_run("1:save:6", config="zero2.json", steps=8, save_every=3,
                                                 out=root / "crashed")
    resumed = launch.run(resume=root / "crashed", out=root / "resumed", stream=False)
    return dict(root=root, message=message, crashed=crashed, resumed=resumed)


def test_a_killed_rank_leaves_a_run_to_resume_and_the_resumed_run_repeats_every_logged_loss(zero3_killed):
    message, killed, resumed = zero3_killed["message"], zero3_killed["killed"], zero3_killed["resumed"]
    first = message.splitlines()[0]
    assert first.startswith("rank 1 was killed by signal 9 (SIGKILL)") and "keeps the checkpoint of step 4" in first
    assert "labs train --resume" in first
    assert killed["interrupted"]["step"] == 4 and killed["names"] == ["run", "zero3_16bit.json"]   # no partial
    assert len(killed["losses"]) >= 6          # rank 1 died after step 7: rank 0 had logged at least step 6
    assert resumed.spec["resume"]["step"] == 4 and not resumed.spec["resume"]["universal"]
    assert resumed.losses[:len(killed["losses"])] == killed["losses"]          # exactly, bit for bit
    assert [m["step"] for m in resumed.metrics] == list(range(1, 9)) and resumed.interrupted is None
    assert [p.name for p in checkpoint.complete(resumed.path)] == ["step00000004", "step00000008"]
    assert resumed.summary["steps"] == 8


def test_a_crash_during_a_save_is_never_loaded(zero2_crashed_in_save):
    crashed, resumed = zero2_crashed_in_save["crashed"], zero2_crashed_in_save["resumed"]
    assert "keeps the checkpoint of step 3 (steps 4-6 are redone on resume)" in zero2_crashed_in_save["message"]
    assert [p.name for p in checkpoint.complete(crashed.path)] == ["step00000003"]
    assert not list(checkpoint.folder(crashed.path).glob(".*partial"))      # the half-written save was dropped
    assert crashed.losses and len(crashed.losses) == 6 and not (crashed.path / "summary.json").exists()
    assert resumed.spec["resume"]["step"] == 3
    assert resumed.losses[:6] == crashed.losses
    assert [p.name for p in checkpoint.complete(resumed.path)] == ["step00000003", "step00000006", "step00000008"]
    assert crashed.path.is_dir() and crashed.interrupted["step"] == 3       # --out elsewhere: the source stays


def test_two_rank_zero3_checkpoint_resumes_on_one_rank(zero3_killed):
    """Through DeepSpeed's universal checkpoint. Step 5 runs the same weights, so only the grouping of the 4 rows
    (2 x 2 on two ranks, 4 on one) changes its rounding; later steps also reduce their bf16 gradients in another
    order, so they drift by bf16 rounding, far less than the loss moves per step."""
    resumed = zero3_killed["resumed"]
    one = launch.run(resume=resumed.path / "checkpoints" / "step00000004", nproc=1, out=zero3_killed["root"] / "one",
                     stream=False)
    assert one.spec["resume"]["universal"] and one.ds_config["checkpoint"]["load_universal"]
    assert one.ds_config["train_micro_batch_size_per_gpu"] == 4 and one.summary["world_size"] == 1
    assert not list(checkpoint.folder(one.path).glob("*universal*"))        # the converted copy is not kept
    assert one.losses[:4] == resumed.losses[:4]
    differences = checkpoints.loss_differences(one.losses, resumed.losses, after=4)
    assert differences[0] < checkpoints.SAME_WEIGHTS_TOLERANCE, differences
    assert max(differences) < checkpoints.RESHARD_TOLERANCE, differences


def test_export_reloads_in_transformers_with_the_engine_logits(zero3_killed, tmp_path):
    """The step-4 checkpoint exported, reloaded with from_pretrained: its logits on the probe equal those the
    resumed engine computed from the same checkpoint, within 2 bf16 steps at the logits' size (the engine's
    ZeRO-3 linear layers add the bias after rounding the product to bf16, transformers' fused linear before)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from labs import data, export

    resumed = zero3_killed["resumed"]
    result = run_labs("export", resumed.path / "checkpoints" / "step00000004", tmp_path / "hf")
    assert result.returncode == 0, result.stderr[-3000:]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    probe = torch.load(resumed.path / "probe_logits.pt")
    with torch.no_grad():
        logits = model(input_ids=probe["ids"]).logits
    assert logits.dtype == torch.bfloat16 and model.config.tie_word_embeddings
    assert checkpoints.max_logit_difference(logits, probe["logits"]) <= checkpoints.bf16_steps(probe["logits"], 2)
    text = data.embedded_documents()[3][:2000]
    assert AutoTokenizer.from_pretrained(tmp_path / "hf").encode(text, add_special_tokens=False) == data.encode(text)
    # ZeRO-3's gathered 16-bit model and zero_to_fp32's fp32 master weights agree after rounding to bf16
    sixteen = torch.load(resumed.path / "checkpoints" / "step00000004" / checkpoint.SIXTEEN_BIT)
    fp32 = export.consolidated(resumed.path / "checkpoints" / "step00000004")
    assert all(torch.equal(sixteen[name].to(torch.bfloat16), fp32[name.removeprefix(export.PREFIX)].bfloat16())
               for name in sixteen if name.removeprefix(export.PREFIX) in fp32)
    provenance = json.loads((tmp_path / "hf" / export.PROVENANCE).read_text())
    assert provenance["step"] == 4 and provenance["dtype"] == "bf16"



def test_an_export_stopped_as_it_takes_its_place_keeps_the_earlier_one(zero3_killed, tmp_path, monkeypatch):
    """A second export into the same folder replaces the first only once it is whole: stopped (a Ctrl-C) just
    before the new folder takes the old one's place, the earlier export is still there, untouched, and nothing
    else is left beside it. The old code deleted the earlier export first."""
    from labs import export

    step = zero3_killed["resumed"].path / "checkpoints" / "step00000004"
    export.to_hf(step, tmp_path / "hf", tokenizer=False)
    written = (tmp_path / "hf" / export.PROVENANCE).read_text()
    rename = Path.rename

    def stopped_before_the_new_one_moves_in(self, target):
        if self.name.startswith(".hf.partial-"):
            raise KeyboardInterrupt
        return rename(self, target)

    monkeypatch.setattr(Path, "rename", stopped_before_the_new_one_moves_in)
    with pytest.raises(KeyboardInterrupt):
        export.to_hf(step, tmp_path / "hf", tokenizer=False)
    assert (tmp_path / "hf" / export.PROVENANCE).read_text() == written
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]
    monkeypatch.undo()
    export.to_hf(step, tmp_path / "hf", dtype="fp32", tokenizer=False)      # not stopped: the new one takes its place
    assert json.loads((tmp_path / "hf" / export.PROVENANCE).read_text())["dtype"] == "fp32"
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]


def test_an_export_killed_outright_is_recovered_by_the_next(zero3_killed, tmp_path, capsys):
    """SIGKILL leaves no finally: an export killed between its two renames leaves the earlier export set aside
    (.hf.replaced-*) and no hf; killed while writing, its half-written .hf.partial-* (marked as an export's). The
    next export, under the folder's lock, puts the newest set-aside export back before it starts and removes the
    rest; a folder of that name without the mark, and other names, are left alone."""
    from labs import export

    step = zero3_killed["resumed"].path / "checkpoints" / "step00000004"
    export.to_hf(step, tmp_path / "v1", tokenizer=False)
    export.to_hf(step, tmp_path / "v2", dtype="fp32", tokenizer=False)
    newer = json.loads((tmp_path / "v2" / export.PROVENANCE).read_text())
    newer["exported"] = "2099-01-01T00:00:00+0000"                 # the later of the two set aside
    (tmp_path / "v2" / export.PROVENANCE).write_text(json.dumps(newer))
    (tmp_path / "v1").rename(tmp_path / ".hf.replaced-older000")   # mkdtemp's 8 characters
    (tmp_path / "v2").rename(tmp_path / ".hf.replaced-newer000")
    (tmp_path / ".hf.partial-123").mkdir()
    (tmp_path / ".hf.partial-123" / export.PARTIAL).touch()
    (tmp_path / ".hf.partial-456").mkdir()                         # no mark: not known to be an export's
    (tmp_path / ".hf.notes").mkdir()                               # not labs' name
    (tmp_path / ".hf.old.partial-123").mkdir()                    # another folder's (hf.old): not this one's shape
    (tmp_path / ".hf.old.partial-123" / export.PARTIAL).touch()
    capsys.readouterr()
    restored_before = []
    real = export._recover

    def spy(out):                     # what to_hf's own recovery put in place, before the new export replaced it
        real(out)
        restored_before.append(json.loads((out / export.PROVENANCE).read_text())["exported"])

    export._recover = spy
    try:
        again = export.to_hf(step, tmp_path / "hf", dtype="bf16", tokenizer=False)
    finally:
        export._recover = real
    assert restored_before == ["2099-01-01T00:00:00+0000"]          # the newest went back, not the oldest
    assert "set '" in capsys.readouterr().err
    assert json.loads((again.path / export.PROVENANCE).read_text())["dtype"] == "bf16"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".hf.notes", ".hf.old.partial-123", ".hf.partial-456", "hf"]
    assert sorted(p.name for p in again.path.iterdir()) == sorted(
        ["config.json", "generation_config.json", "model.safetensors", export.PROVENANCE])   # no mark left


def test_a_second_export_into_the_same_folder_is_one_line(zero3_killed, tmp_path):
    from labs import export, runfolder

    step = zero3_killed["resumed"].path / "checkpoints" / "step00000004"
    out = tmp_path / "hf"
    with runfolder.lock(tmp_path / ".hf.lock", out, "export folder"):
        with pytest.raises(LabsError, match=r"export folder '.*hf' is being written by another labs process "
                                            r"\(pid \d+.*choose another folder"):
            export.to_hf(step, out, tokenizer=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.parametrize("stage", [2, 3])
def test_the_universal_copy_holds_what_expected_bytes_per_param_says(stage, zero3_killed, tmp_path):
    """DeepSpeed 0.19.8's ds_to_universal, measured: at ZeRO-3 it copies rank 0's optimizer file whole (12 x
    (1 + 1/N) bytes per parameter); at ZeRO-1/2 it drops the partitions from the common state and copies the
    model-states file (bf16 module) instead: 14, plus the tied output layer written again in fp32, whatever N.
    The ZeRO-2 checkpoint comes from 1 rank, where 12 x (1 + 1/N) would say 24."""
    from labs import resume

    if stage == 3:
        path = zero3_killed["resumed"].path / "checkpoints" / "step00000004"
    else:
        run = launch.run(preset="tiny", config="zero2.json", steps=1, save_every=1, nproc=1, out=tmp_path / "z2",
                         stream=False)
        path = checkpoint.complete(run.path)[-1]
    resume.to_universal(path, tmp_path / "universal")
    [row] = checkpoints.universal_rows([(path, tmp_path / "universal")])
    assert row["stage"] == stage and row["tied"] > 0.9            # the tiny model's embedding is nearly all of it
    assert abs(row["per_param"] - row["expected_per_param"]) < 0.05, row
    if stage == 2:
        assert row["ranks"] == 1 and abs(row["per_param"] - row["zero3_formula"]) > 5, row
    no_tie = checkpoints.expected_bytes_per_param(stage, 8)["universal checkpoint"]
    assert no_tie == (12 * (1 + 1 / 8) if stage == 3 else 14)

# ------------------------------------------------------------------------------------------ no launch
def test_a_checkpoint_with_a_short_file_is_not_complete(tmp_path):
    path = tmp_path / "checkpoints" / "step00000002"
    path.mkdir(parents=True)
    (path / "part.pt").write_bytes(b"x" * 10)
    (path / checkpoint.MANIFEST).write_text(json.dumps({"step": 2, "files": {"part.pt": 10}}))
    assert checkpoint.complete(tmp_path) == [path]
    (path / "part.pt").write_bytes(b"x" * 9)                # truncated, as a full disk or a bad copy leaves it
    assert checkpoint.complete(tmp_path) == []


def test_a_resumed_run_skips_exactly_the_consumed_batches():
    from labs import data

    rows = torch.arange(200).view(100, 2)
    for start in (0, 3, 24, 25, 31):                        # 25 micro-batches of 2 per rank per epoch
        fresh = data.rank_batches(rows, 2, 1, 2, seed=5)
        for _ in range(start):
            next(fresh)
        assert torch.equal(next(data.rank_batches(rows, 2, 1, 2, seed=5, start=start)), next(fresh))


def test_two_ranks_of_two_and_one_rank_of_four_see_the_same_rows():
    from labs import data

    rows = torch.arange(120).view(60, 2)
    for k in range(20):
        two = torch.cat([next(_nth(data.rank_batches(rows, 2, r, 2, seed=1), k)) for r in (0, 1)])
        one = next(_nth(data.rank_batches(rows, 4, 0, 1, seed=1), k))
        assert sorted(two[:, 0].tolist()) == sorted(one[:, 0].tolist())


def _nth(batches, k):
    for _ in range(k):
        next(batches)
    return batches
