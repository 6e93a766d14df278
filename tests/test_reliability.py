"""Bad input never reaches a rank: one line `labs: error: ...` naming the key or path, exit code 2, nothing written.
Run in-process (`cli.main`), as the `labs` entry point runs it: no rank starts, so these tests are fast."""
import json

import pytest

from conftest import ROOT
from labs import cli, runfolder
from labs.errors import LabsError

ZERO3 = json.loads((ROOT / "ds_configs/zero3.json").read_text())


def _refused(tmp_path, capsys, *args, out=None) -> str:
    out = out or tmp_path / "run"
    before = sorted(p.name for p in tmp_path.iterdir())
    code = cli.main(["train", "--out", str(out), "--steps", "2", *map(str, args)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("labs: error: "), err
    assert sorted(p.name for p in tmp_path.iterdir()) == before, "something was written"
    return err[0]


def _config(tmp_path, **changes) -> str:
    config = json.loads(json.dumps(ZERO3))
    for dotted, value in changes.items():
        *parents, leaf = dotted.split("__")
        node = config
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(config))
    return str(path)


# ------------------------------------------------------------------------------------------ flags
@pytest.mark.parametrize("flag", ["--micro-batch", "--grad-accum", "--seq-len", "--nproc", "--steps"])
def test_zero_is_refused_not_read_as_the_default(tmp_path, capsys, flag):
    assert f"argument {flag}: must be at least 1, not 0" in _refused(tmp_path, capsys, flag, 0)


@pytest.mark.parametrize("value", ["-1e-3", "nan", "inf", "0"])
def test_learning_rate_must_be_positive(tmp_path, capsys, value):
    assert "argument --lr: must be a positive number" in _refused(tmp_path, capsys, f"--lr={value}")


def test_mistyped_flag_points_to_the_right_help(tmp_path, capsys):
    assert "unrecognized arguments: --stpes" in _refused(tmp_path, capsys, "--stpes", 3)
    assert cli.main(["trian"]) == 2
    line = capsys.readouterr().err.strip()
    assert "invalid choice: 'trian'" in line and "(see `labs --help`)" in line and "labs labs" not in line


def test_more_ranks_than_cores(tmp_path, capsys):
    assert "--nproc 64: this machine has" in _refused(tmp_path, capsys, "--nproc", 64)


def test_cpu_ranks_are_counted_on_the_cores_this_process_may_use(tmp_path, capsys, monkeypatch):
    """In a Slurm task or a container limited to one core, labs allows the ranks it gives threads for (2 per core),
    not 2 per core of the whole machine."""
    from labs import env

    monkeypatch.setattr(env, "usable_cores", lambda: 1)
    assert "--nproc 3: this machine has 1 usable CPU core(s)" in _refused(tmp_path, capsys, "--nproc", 3)


def test_gpu_only_loss_on_a_cpu(tmp_path, capsys):
    assert "--loss liger: Liger's Triton kernels need an NVIDIA GPU" in _refused(tmp_path, capsys, "--loss", "liger")


def test_sequence_longer_than_the_model_positions(tmp_path, capsys):
    assert "--seq-len 4096 is longer than the model's 2048 positions" in \
        _refused(tmp_path, capsys, "--seq-len", 4096)


def test_more_checkpointed_layers_than_the_model_has(tmp_path, capsys):
    assert "activation checkpointing '3': use none, full, or a number of layers from 0 to 2" in \
        _refused(tmp_path, capsys, "--activation-checkpointing", 3)


def test_a_7b_model_on_a_machine_without_the_memory(tmp_path, capsys):
    line = _refused(tmp_path, capsys, "--preset", "qwen2.5-7b", "--nproc", 1)
    assert "labs.memory predicts a peak of" in line and "far above" in line


def test_an_offloaded_7b_on_a_gpu_host_without_the_host_memory(monkeypatch, capsys):
    """On a GPU host labs also checks the offloaded optimizer's host memory before any rank starts: on the 1-GPU kind
    (125 GiB, results/gpu/zenflow_1xh200/round10_free.txt) the 3B's ZeRO-2 offload fits (64 GiB predicted, 65.5
    measured); the 7.6B's needs 4 + 4 bytes pinned per parameter at 32 GiB each, 2 more at 16, and 8 of Adam states:
    139 GiB, 129 even if DeepSpeed pinned each buffer at its own size (DS_PIN_MEMORY_BACKEND=native). A run whose
    prediction fits but comes within 10% of the host gets one note (recorded runs held a few GiB more)."""
    from labs import memory, models, preflight

    monkeypatch.setattr(preflight, "ranks_that_fit", lambda on_gpu: 1)
    monkeypatch.setattr(preflight, "host_memory_bytes", lambda: 125 * 2**30)
    config = json.loads((ROOT / "ds_configs/bench/labs_zero2_offload.json").read_text())

    def check(preset, micro_batch, checkpointing):
        dims = models.shape(preset)
        preflight.check_hardware(1, True, 4096, dims, dict(
            dims=dims, gpus_per_node=1, seq_len=4096, loss="liger", kernels="liger", ds_config=config,
            micro_batch=micro_batch, grad_accum=1, activation_checkpointing=checkpointing), memory.gpu_bytes("H200"))

    check("qwen2.5-3b", 8, "none")
    assert "labs: note" not in capsys.readouterr().err            # 64 GiB of 125: no note
    monkeypatch.setattr(preflight, "host_memory_bytes", lambda: 140 * 2**30)
    check("qwen2.5-7b", 2, "full")                                 # 138.7 of 140 GiB: runs, with a note
    note = capsys.readouterr().err.strip().splitlines()
    assert len(note) == 1 and note[0].startswith("labs: note: labs.memory predicts 138.7 GiB of host memory")
    monkeypatch.setattr(preflight, "host_memory_bytes", lambda: 125 * 2**30)
    with pytest.raises(LabsError, match=r"predicts 138\.7 GiB of host memory .* above the 125\.0 GiB"):
        check("qwen2.5-7b", 2, "full")
    monkeypatch.setenv("DS_PIN_MEMORY_BACKEND", "native")
    with pytest.raises(LabsError, match=r"predicts 128\.7 GiB of host memory"):
        check("qwen2.5-7b", 2, "full")


def test_a_start_up_flatten_larger_than_the_card_is_not_refused(monkeypatch, capsys):
    """ZeRO-2 with the optimizer offloaded: the 7B's start-up flatten (28.4 GiB, its peak on a larger card) is more
    than a 20 GiB card holds in all, so DeepSpeed makes it on the CPU and labs weighs the largest training moment: no
    refusal, a note that says which moment it weighs."""
    from labs import memory, models, preflight

    monkeypatch.setattr(preflight, "ranks_that_fit", lambda on_gpu: 1)
    monkeypatch.setattr(preflight, "host_memory_bytes", lambda: 250 * 2**30)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    dims, card = models.shape("qwen2.5-7b"), memory.parse_bytes("20GiB")
    setting = dict(dims=dims, gpus_per_node=1, seq_len=4096, loss="liger", kernels="liger", micro_batch=1, grad_accum=1,
                   activation_checkpointing="full", ds_config=json.loads(
                       (ROOT / "ds_configs/bench/labs_zero2_offload.json").read_text()))
    est = memory.estimate(**setting)
    fit = est.fit_bytes_on(card)
    assert est.peak_phase == "init" and est.total_per_gpu_bytes > 1.25 * card > fit      # refused on the peak
    preflight.check_hardware(1, True, 4096, dims, setting, card)
    note = capsys.readouterr().err                                  # near the card: a note, on the largest moment
    assert f"predicts {fit / 2**30:,.1f} GiB per GPU at {est.fit_phase_on(card)} (the peak, its " \
           f"{est.total_per_gpu_bytes / 2**30:,.1f} GiB start-up flatten, is made on the CPU on this card)" in note


def test_a_start_up_flatten_on_the_cpu_without_the_host_memory(monkeypatch, capsys):
    """Where the flatten falls back to the CPU, each rank holds its bf16 weights twice on the host at once (its
    parameters' cpu_data and the CPU flat buffer): 8 ranks of the 7B on RTX 4090s need 227 GiB while they start.
    A host with less is refused in one line; one with more starts."""
    from labs import memory, models, preflight

    monkeypatch.setattr(preflight, "ranks_that_fit", lambda on_gpu: 8)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")      # no allocator note
    dims, card = models.shape("qwen2.5-7b"), memory.gpu_bytes("RTX4090")
    setting = dict(dims=dims, gpus_per_node=8, nodes=8, stage=2, seq_len=4096, loss="liger", kernels="liger",
                   activation_checkpointing="full")
    est = memory.estimate(**setting, host_pinning="torch")
    need = est.start_up_host_per_node_bytes_on(card)
    assert est.fits(card) and need == 8 * est.phases["init"]["total"] and est.host_per_node_bytes == 0
    monkeypatch.setattr(preflight, "host_memory_bytes", lambda: 200 * 2**30)
    with pytest.raises(LabsError) as refused:
        preflight.check_hardware(8, True, 4096, dims, setting, card)
    assert str(refused.value).startswith(f"labs.memory predicts {need / 2**30:,.1f} GiB of host memory at start-up "
                                         "for 8 rank(s), above the 200.0 GiB this host has")
    assert "\n" not in str(refused.value) and "use ZeRO-3" in str(refused.value)
    monkeypatch.setattr(preflight, "host_memory_bytes", lambda: 250 * 2**30)
    preflight.check_hardware(8, True, 4096, dims, setting, card)
    assert capsys.readouterr().err == ""
    # a card that holds the copy flattens on the GPU: no start-up host need, however small the host
    monkeypatch.setattr(preflight, "host_memory_bytes", lambda: 16 * 2**30)
    preflight.check_hardware(8, True, 4096, dims, setting, memory.gpu_bytes("A100-40GB"))


def test_a_gpu_run_within_2_gib_of_the_card_gets_a_note_on_the_allocator(monkeypatch, capsys):
    """labs.memory predicts allocated memory; PyTorch's cache holds more. On one H100, stock's 4 x 2 at 74% of 3e8
    sub-groups (73.4 GiB predicted, 74.7 usable) ran out of memory with 11.2 GiB reserved but unallocated and ran with
    expandable segments (round 42), so a run predicted within 2 GiB of the usable memory gets one note naming the
    setting; labs' one-card row (70.5 GiB) gets none, nor does a run that already sets it."""
    from labs import memory, models, preflight

    monkeypatch.setattr(preflight, "ranks_that_fit", lambda on_gpu: 1)
    monkeypatch.setattr(preflight, "host_memory_bytes", lambda: 250 * 2**30)        # no host note here
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    dims = models.shape("qwen2.5-7b")
    stock = json.loads((ROOT / "results/gpu/one_card_7b_1xh100/round42/stock_z3_off74_sg3.json").read_text())
    labs_row = json.loads((ROOT / "ds_configs/bench/labs_zero3_offload_70.json").read_text())

    def notes(config, micro_batch, grad_accum, checkpointing, loss, kernels):
        preflight.check_hardware(1, True, 4096, dims, dict(
            dims=dims, gpus_per_node=1, seq_len=4096, loss=loss, kernels=kernels, ds_config=config,
            micro_batch=micro_batch, grad_accum=grad_accum, activation_checkpointing=checkpointing),
            memory.gpu_bytes("H100"))
        return capsys.readouterr().err.strip().splitlines()

    stock_4x2 = (stock, 4, 2, "full", "hf", "stock")
    assert notes(*stock_4x2) == ["labs: note: labs.memory predicts a peak of 73.4 GiB per GPU, within 2 GiB of the "
                                 "74.7 GiB PyTorch can use here; it counts allocated memory, and PyTorch's cache can "
                                 "hold GiBs more reserved but unallocated: if the run stops out of GPU memory saying "
                                 "so, set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"]
    assert notes(labs_row, 8, 1, 25, "liger", "liger") == []
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    assert notes(*stock_4x2) == []


# ------------------------------------------------------------------------------------------ config
def test_misspelt_top_level_key(tmp_path, capsys):
    path = tmp_path / "cfg.json"
    config = {k: v for k, v in ZERO3.items() if k != "zero_optimization"}
    path.write_text(json.dumps({**config, "zero_optimisation": ZERO3["zero_optimization"]}))
    assert "config key 'zero_optimisation'" in (line := _refused(tmp_path, capsys, "--config", path))
    assert "did you mean 'zero_optimization'?" in line


@pytest.mark.parametrize("changes, message", [
    (dict(zero_optimization__stage=5), "config key 'zero_optimization.stage' in "),
    (dict(zero_optimization__stage=5), "is 5; the ZeRO stages are 0, 1, 2, 3 (0: plain data parallelism)"),
    (dict(zero_optimization__overlap_com=True), "config key 'zero_optimization.overlap_com'"),
    (dict(zero_optimization__reduce_bucket_size="big"), "config key 'zero_optimization.reduce_bucket_size'"),
    (dict(optimizer__type="AdamWW"), "did you mean 'AdamW'?"),
    (dict(optimizer__params__lr=-0.1), "config key 'optimizer.params.lr'"),
    (dict(scheduler__type="Cosine"), "config key 'scheduler.type'"),
    (dict(train_micro_batch_size_per_gpu=0), "config key 'train_micro_batch_size_per_gpu' must be a positive"),
])
def test_config_values_deepspeed_would_refuse_in_every_rank(tmp_path, capsys, changes, message):
    assert message in _refused(tmp_path, capsys, "--config", _config(tmp_path, **changes))


@pytest.mark.parametrize("content, message", [
    (b"\xff\xfe{}", "is not UTF-8 text"), (b"[1, 2]", "must hold a JSON object ({...}), not a list"),
    (b'{"a": 1,}', "is not valid JSON: line 1"),
])
def test_config_files_of_the_wrong_kind(tmp_path, capsys, content, message):
    (tmp_path / "cfg.json").write_bytes(content)
    assert message in _refused(tmp_path, capsys, "--config", tmp_path / "cfg.json")


def test_a_directory_given_as_a_file(tmp_path, capsys):
    (tmp_path / "folder").mkdir()
    assert "is a directory" in _refused(tmp_path, capsys, "--config", tmp_path / "folder")
    assert "is a directory" in _refused(tmp_path, capsys, "--data", tmp_path / "folder")


# ------------------------------------------------------------------------------------------ data
@pytest.mark.parametrize("name, content, message", [
    ("short.txt", b"just a few words", "fewer than 4 sequence(s) of 64"),      # 2 ranks x micro-batch 2
    ("empty.jsonl", b"", "has 0 tokens"),
    ("latin1.txt", "caf\u00e9 ".encode("latin-1") * 500, "is not UTF-8 text"),
    ("bad.jsonl", b'{"text": "ok"}\n{"txt": "no"}\n', 'bad.jsonl:2: needs a string field "text"'),
    ("notes.md", b"# hello", "must end in .txt or .jsonl"),
])
def test_data_that_cannot_feed_one_batch(tmp_path, capsys, name, content, message):
    (tmp_path / name).write_bytes(content)
    assert message in _refused(tmp_path, capsys, "--data", tmp_path / name)


# ------------------------------------------------------------------------------------------ model folder
def _saved_tiny(folder, **config_changes):
    import torch
    from transformers import AutoModelForCausalLM

    from labs import models

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(models.qwen2_config("tiny"))
    model.save_pretrained(folder)
    if config_changes:
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, **config_changes}))
    return folder


def test_model_folders_labs_cannot_train(tmp_path, capsys):
    other = _saved_tiny(tmp_path / "llama", model_type="llama")
    reshaped = _saved_tiny(tmp_path / "reshaped", intermediate_size=256)
    capsys.readouterr()                         # save_pretrained's own progress bars
    assert "holds a 'llama' model; labs trains the Qwen2 architecture" in \
        _refused(tmp_path, capsys, "--model-path", other)
    assert "has shape [192, 64], but config.json says [256, 64]" in \
        _refused(tmp_path, capsys, "--model-path", reshaped)
    for weights in (tmp_path / "reshaped").glob("*.safetensors"):
        weights.unlink()
    assert "has no *.safetensors weights" in _refused(tmp_path, capsys, "--model-path", reshaped)


def _saved(folder, **config_changes):
    """A tiny-preset model with some of its config changed, saved with weights of that shape."""
    import torch
    from transformers import AutoModelForCausalLM

    from labs import models

    config = models.qwen2_config("tiny")
    for key, value in config_changes.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


def test_a_model_folder_with_a_smaller_vocabulary_than_qwens_tokenizer(tmp_path, capsys):
    """labs feeds every model Qwen's BPE ids, up to <|endoftext|> (151,643): a smaller embedding table passed the
    folder checks and failed in every rank with an IndexError."""
    small = _saved(tmp_path / "small_vocab", vocab_size=32000)
    capsys.readouterr()
    line = _refused(tmp_path, capsys, "--model-path", small, "--preset", "tiny")
    assert "config.json's vocab_size is 32000" in line and "ids up to 151,643 (<|endoftext|>)" in line


def test_model_path_without_preset_takes_the_folders_preset_or_is_refused(tmp_path, capsys, monkeypatch):
    """--model-path without --preset used the tiny preset's defaults (seq_len 64, lr 5e-3) for any folder: now the
    preset of the folder's shape, and a folder of no preset's shape needs --preset."""
    from labs import launch, model_folder, models

    assert {name: model_folder.preset_of(tmp_path, models.shape(name)) for name in models.PRESETS} == \
        {name: name for name in models.PRESETS}
    released = dict(models.shape("qwen2.5-7b"), max_position_embeddings=131072)     # Qwen2.5-7B's own config.json
    assert model_folder.preset_of(tmp_path, released) == "qwen2.5-7b"
    wider = _saved(tmp_path / "wider", intermediate_size=256)
    capsys.readouterr()
    assert "has no preset's shape: give --preset" in _refused(tmp_path, capsys, "--model-path", wider)
    spec, _ = launch.prepare(model_path=str(wider), preset="tiny", out=str(tmp_path / "run"), steps=2)
    assert spec["preset"] == "tiny" and spec["dims"]["intermediate_size"] == 256
    monkeypatch.setattr(model_folder, "check", lambda path: models.shape("qwen2.5-7b"))   # a 7B folder's dims
    spec, resolved = launch.prepare(model_path=str(wider), out=str(tmp_path / "run"), steps=2, memory_check=False)
    assert spec["preset"] == "qwen2.5-7b" and spec["seq_len"] == 4096 and resolved["optimizer"]["params"]["lr"] == 1e-4
    assert not (tmp_path / "run").exists()


def test_liger_asked_for_where_liger_kernel_is_not_installed(tmp_path, monkeypatch):
    """On a GPU host without requirements-gpu.txt (`make train` used to skip it), --loss/--kernels liger failed in
    every rank after the model was built: refused before, naming what to install."""
    import importlib.util

    import torch

    from labs import launch, preflight

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "liger_kernel" else real(name, *a))
    preflight.check_liger("hf", "stock")                                         # not asked for: nothing to check
    with pytest.raises(LabsError, match=r"--loss liger and --kernels liger: Liger Kernel is not installed .*"
                                        r"-m pip install -r requirements-gpu.txt"):
        preflight.check_liger("liger", "liger")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)               # a GPU host, as launch sees it
    with pytest.raises(LabsError, match="--kernels liger: Liger Kernel is not installed"):
        launch.prepare(kernels="liger", out=str(tmp_path / "run"), steps=2)
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------------------------------ --out
def test_out_never_replaces_what_labs_did_not_write(tmp_path, capsys):
    mine = tmp_path / "thesis"
    mine.mkdir()
    (mine / "chapter1.tex").write_text("years of work")
    assert "is a folder labs did not write" in _refused(tmp_path, capsys, out=mine)
    assert (mine / "chapter1.tex").read_text() == "years of work"
    notes = tmp_path / "notes.txt"
    notes.write_text("keep me")
    assert "is an existing file" in _refused(tmp_path, capsys, out=notes)
    assert notes.read_text() == "keep me" and not list(tmp_path.glob(".notes*"))


def test_out_in_a_folder_that_cannot_be_written(tmp_path, monkeypatch):
    import os

    locked = tmp_path / "locked"
    locked.mkdir()
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if str(p) == str(locked) else real(p, mode))
    with pytest.raises(LabsError, match="is not a writable folder"):
        runfolder.check_out(locked / "run")


def test_out_where_access_says_yes_and_the_file_system_says_no(tmp_path, capsys):
    """Root passes every access() check; /proc still refuses to create the lock file. One line, exit 2, not a
    traceback (another user is refused by the access() check)."""
    import os

    refused = _refused(tmp_path, capsys, out="/proc/labs-run")
    assert ("--out '/proc/labs-run': cannot write there: '/proc' refused a new file" in refused if os.geteuid() == 0
            else "'/proc' is not a writable folder" in refused)


def test_out_below_a_folder_this_user_may_not_enter(tmp_path, monkeypatch):
    """Not root, under a folder of mode 700: Path.exists() raises PermissionError (Python 3.11). One line."""
    from pathlib import Path

    locked = tmp_path / "locked"
    real = Path.exists

    def exists(self, *args, **kwargs):
        if str(self).startswith(str(locked) + "/"):
            raise PermissionError(13, "Permission denied", str(self))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "exists", exists)
    with pytest.raises(LabsError, match=r"--out '.*/locked/sub/run': cannot look there \(Permission denied"):
        runfolder.check_out(locked / "sub" / "run")


def test_publish_replaces_an_earlier_run_and_clears_stale_partials(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / runfolder.MARKER).write_text("{}")
    (out / "summary.json").write_text('{"old": true}')
    stale = tmp_path / ".run.partial-99999"          # left by a labs process that was killed
    stale.mkdir()
    (stale / runfolder.MARKER).write_text("{}")
    runfolder.check_out(out)
    with runfolder.claim(out) as work:
        assert not stale.exists() and (work / runfolder.MARKER).is_file()
        (work / "summary.json").write_text('{"new": true}')
        runfolder.publish(work, out)
    assert json.loads((out / "summary.json").read_text()) == {"new": True}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]        # no lock, partial or old copy left


def test_a_run_killed_between_publishs_renames_gets_its_earlier_run_back(tmp_path):
    """SIGKILL between publish's two renames left the earlier run hidden as .run.old-PID and no run: the next claim
    puts it back (the state before that run); a hidden earlier run beside a published one goes; other names stay."""
    earlier = tmp_path / ".run.old-4242"
    earlier.mkdir()
    (earlier / runfolder.MARKER).write_text("{}")
    (earlier / "summary.json").write_text('{"earlier": true}')
    (tmp_path / ".run.old-notes").mkdir()                      # no marker: not labs' run folder, left alone
    out = tmp_path / "run"
    runfolder.check_out(out)
    with runfolder.claim(out):
        assert json.loads((out / "summary.json").read_text()) == {"earlier": True}
    superseded = tmp_path / ".run.old-4343"
    superseded.mkdir()
    (superseded / runfolder.MARKER).write_text("{}")
    with runfolder.claim(out):
        assert not superseded.exists() and (out / "summary.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".run.old-notes", "run"]


def test_a_run_killed_just_before_its_last_rename_is_published_by_the_next_claim(tmp_path):
    """Killed between publish's renames with its run finished (summary.json written): the swap is finished, not
    undone. Folders of another --out whose name starts with this one's (run.old-5's work folder) are not touched, and
    a folder of the work folder's name that labs did not mark is named, not removed."""
    import os

    out = tmp_path / "run"
    for name, summary in ((".run.old-77", '{"earlier": true}'), (".run.partial-77", '{"finished": true}'),
                          (".run.old-5.partial-9", '{"another run": true}')):
        (tmp_path / name).mkdir()
        (tmp_path / name / runfolder.MARKER).write_text("{}")
        (tmp_path / name / "summary.json").write_text(summary)
    with runfolder.claim(out):
        assert json.loads((out / "summary.json").read_text()) == {"finished": True}
    assert sorted(p.name for p in tmp_path.iterdir()) == [".run.old-5.partial-9", "run"]
    (tmp_path / f".run.partial-{os.getpid()}").mkdir()             # unmarked, in the way of this process's
    with pytest.raises(LabsError, match="is in the way and labs did not mark it as its own"):
        with runfolder.claim(out):
            pass
    assert (tmp_path / f".run.partial-{os.getpid()}").is_dir()


def test_a_second_run_on_the_same_out_is_told_at_once(tmp_path):
    out = tmp_path / "run"
    with runfolder.claim(out):
        with pytest.raises(LabsError, match=r"is being written by another labs process \(pid \d+"):
            with runfolder.claim(out):
                pass


# ------------------------------------------------------------------------------------------ help
def test_help_teaches(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    top = capsys.readouterr().out
    assert "examples:" in top and "labs train --preset qwen2.5-7b" in top
    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    text = capsys.readouterr().out
    assert "examples:" in text and "--out: a new folder, or a run folder labs wrote earlier" in text
    described = text.split("options:", 1)[1].split("examples:", 1)[0]
    options = [line.split()[0] for line in described.splitlines() if line.startswith("  --")]
    assert len(options) >= 18
    for option in options:
        block = described.split(f"  {option}", 1)[1].split("\n  -", 1)[0]
        assert "default" in block or option in ("--help", "--no-memory-check", "--quiet"), option
