"""Bad checkpoint input never reaches a rank: one line `labs: error: ...`, exit code 2, nothing written. The run
folders here are made by hand (inputs from launch.prepare, a checkpoint manifest), so no rank ever starts."""
import json

import pytest

from labs import checkpoint, cli, launch, runfolder


def _run_folder(path, steps=8, checkpoint_at=None, config="zero3.json", **manifest_changes):
    """A run folder as labs writes it (run.json, ds_config.json, metrics), with a checkpoint whose manifest says
    it is complete (its files are not real: the refusals below come before any rank would read them)."""
    spec, resolved = launch.prepare(preset="tiny", config=config, steps=steps, out=str(path), save_every=4)
    path.mkdir(parents=True)
    (path / runfolder.MARKER).write_text("{}")
    (path / "run.json").write_text(json.dumps(spec))
    (path / "ds_config.json").write_text(json.dumps(resolved))
    (path / "command.txt").write_text("labs train\n")
    (path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in
                                                range(1, (checkpoint_at or 0) + 1)))
    if checkpoint_at:
        folder = checkpoint.folder(path) / checkpoint.tag(checkpoint_at)
        folder.mkdir(parents=True)
        manifest = dict(step=checkpoint_at, world_size=2, zero_stage=resolved["zero_optimization"]["stage"],
                        train_batch_size=resolved["train_batch_size"], files={},
                        **{key: spec[key] for key in checkpoint.RUN_KEYS})
        for dotted, value in manifest_changes.items():
            node, *rest = dotted.split("__")
            (manifest[node].__setitem__(rest[0], value) if rest else manifest.__setitem__(node, value))
        (folder / checkpoint.MANIFEST).write_text(json.dumps(manifest))
    return path


def _refused(tmp_path, capsys, *args) -> str:
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    code = cli.main([*map(str, args)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("labs: error: "), err
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before, "something was written"
    return err[0]


def test_resume_from_a_run_without_a_checkpoint(tmp_path, capsys):
    run = _run_folder(tmp_path / "run")
    assert "holds no complete checkpoint" in _refused(tmp_path, capsys, "train", "--resume", run)
    partial = checkpoint.folder(run) / ".step00000004.partial"
    partial.mkdir(parents=True)
    assert "only an unfinished save, .step00000004.partial" in _refused(tmp_path, capsys, "train", "--resume", run)


def test_resume_from_something_that_is_not_a_run(tmp_path, capsys):
    (tmp_path / "notes").mkdir()
    assert "is not a labs run folder" in _refused(tmp_path, capsys, "train", "--resume", tmp_path / "notes")
    assert "does not exist" in _refused(tmp_path, capsys, "train", "--resume", tmp_path / "nothing")


def test_export_of_a_run_without_a_checkpoint(tmp_path, capsys):
    run = _run_folder(tmp_path / "run")
    assert "holds no complete checkpoint" in _refused(tmp_path, capsys, "export", run, tmp_path / "hf")


def test_export_names_its_own_argument_and_refuses_a_checkpoint_without_deepspeed_files(tmp_path, capsys):
    assert "export: RUN_DIR" in _refused(tmp_path, capsys, "export", tmp_path / "missing", tmp_path / "hf")
    run = _run_folder(tmp_path / "run", checkpoint_at=4)        # a manifest and no DeepSpeed file
    line = _refused(tmp_path, capsys, "export", run, tmp_path / "hf")
    assert "is not a DeepSpeed ZeRO checkpoint that zero_to_fp32 can read" in line and "--resume" not in line


def test_export_never_replaces_what_labs_did_not_write(tmp_path, capsys):
    run = _run_folder(tmp_path / "run", checkpoint_at=4)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "weights.bin").write_text("keep")
    assert "is not an earlier labs export" in _refused(tmp_path, capsys, "export", run, tmp_path / "mine")
    assert "unknown dtype 'int4'" in _refused(tmp_path, capsys, "export", run, tmp_path / "hf", "--dtype", "int4")


def test_a_checkpoint_of_another_model_shape(tmp_path, capsys):
    run = _run_folder(tmp_path / "run", checkpoint_at=4, dims__hidden_size=128)
    line = _refused(tmp_path, capsys, "train", "--resume", run)
    assert "holds another model shape (hidden_size 128 -> 64)" in line and "preset 'tiny'" in line


def test_a_checkpoint_written_before_a_shape_key_existed_still_resumes(tmp_path):
    run = _run_folder(tmp_path / "run", checkpoint_at=4)
    path = checkpoint.folder(run) / checkpoint.tag(4)
    saved = checkpoint.manifest(path)
    del saved["dims"]["max_position_embeddings"]                # not recorded by older labs
    (path / checkpoint.MANIFEST).write_text(json.dumps(saved))
    assert launch.prepare(resume=run)[0]["resume"]["step"] == 4


def test_a_resumed_run_keeps_the_precision(tmp_path):
    from labs.errors import LabsError

    run = _run_folder(tmp_path / "run", checkpoint_at=4)
    with pytest.raises(LabsError, match="the precision .* was 'bf16' .* not 'fp32'; the resumed run must compute in "
                                        "the precision its weights and optimizer states were trained in"):
        launch.prepare(resume=run, precision="fp32")


def test_save_every_zero_and_save_every_where_labs_cannot_save(tmp_path, capsys):
    out = tmp_path / "run"
    assert "argument --save-every: must be at least 1, not 0" in \
        _refused(tmp_path, capsys, "train", "--save-every", 0, "--out", out)
    assert "--save-every: labs checkpoints DeepSpeed runs" in \
        _refused(tmp_path, capsys, "train", "--save-every", 2, "--engine", "fsdp2", "--out", out)


@pytest.mark.parametrize("args, message", [
    (("--steps", 4), "--steps 4: checkpoint 'step00000004' is already at step 4; give a larger --steps"),
    (("--seed", 1), "--seed was 0 when checkpoint 'step00000004' was written, not 1"),
    (("--seq-len", 32), "--seq-len was 64 when checkpoint 'step00000004' was written, not 32"),
    (("--micro-batch", 1), "the global batch was 4 sequences per step, not 2"),
    (("--config", "zero2.json"), "ZeRO-3 on 2 rank(s) -> ZeRO-2 on 2: DeepSpeed's universal checkpoint changes the stage only"),
    (("--engine", "fsdp2"), "labs resumes DeepSpeed runs"),
    (("--nproc", 4), "--nproc 4: checkpoint 'step00000004' was written by 2 rank(s), and labs resumes it on as many "
                     "ranks or fewer; to train on more GPUs, export the model (labs export RUN_DIR OUT_DIR) and "
                     "start a new run from it with --model-path OUT_DIR"),
])
def test_a_resumed_run_must_continue_the_same_run(tmp_path, capsys, args, message):
    run = _run_folder(tmp_path / "run", checkpoint_at=4)
    assert message in _refused(tmp_path, capsys, "train", "--resume", run, *args)


def test_a_resumed_run_inherits_what_was_not_typed(tmp_path):
    """`labs train --resume RUN --nproc 1` keeps the run's 8 steps and global batch (4 rows per rank now)."""
    run = _run_folder(tmp_path / "run", checkpoint_at=4)
    spec, resolved = launch.prepare(resume=run, nproc=1)
    assert spec["steps"] == 8 and spec["out"] == str(run) and spec["save_every"] == 4
    assert resolved["train_micro_batch_size_per_gpu"] == 4 and resolved["checkpoint"] == {"load_universal": True}
    assert spec["resume"]["universal"] and spec["resume"]["step"] == 4


# ------------------------------------------------------------------------------------------ interrupted runs
def _failed_work(tmp_path, with_checkpoint=True):
    """A working folder as a failed run leaves it: metrics of 3 steps, a complete checkpoint of step 2 (or only
    a save that was cut short)."""
    work = tmp_path / ".run.partial-1"
    name = checkpoint.tag(2) if with_checkpoint else f".{checkpoint.tag(2)}.partial"
    (checkpoint.folder(work) / name).mkdir(parents=True)
    (checkpoint.folder(work) / name / checkpoint.MANIFEST).write_text(json.dumps({"step": 2, "files": {}}))
    (work / runfolder.MARKER).write_text("{}")
    (work / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3)))
    return work


def test_a_failed_run_with_a_checkpoint_is_kept_marked_interrupted(tmp_path):
    from labs import resume

    line = resume.keep_interrupted(_failed_work(tmp_path), tmp_path / "run", "rank 1 was killed by signal 9")
    assert "keeps the checkpoint of step 2 (step 3 is redone on resume)" in line
    kept = runfolder.Run(tmp_path / "run")
    assert kept.interrupted["step"] == 2 and kept.interrupted["reason"] == "rank 1 was killed by signal 9"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_an_interrupted_run_never_replaces_a_finished_one(tmp_path):
    from labs import resume

    finished = tmp_path / "run"
    finished.mkdir()
    (finished / runfolder.MARKER).write_text("{}")
    (finished / "summary.json").write_text("{}")
    line = resume.keep_interrupted(_failed_work(tmp_path), finished, "stopped by SIGTERM")
    assert (finished / "summary.json").is_file() and "run.interrupted" in line
    assert runfolder.Run(tmp_path / "run.interrupted").interrupted["step"] == 2


def test_a_failed_run_without_a_complete_checkpoint_keeps_nothing(tmp_path):
    from labs import resume

    assert resume.keep_interrupted(_failed_work(tmp_path, with_checkpoint=False), tmp_path / "run", "x") == ""
    assert not (tmp_path / "run").exists()
