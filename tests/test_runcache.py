"""labs.runcache: under `make test` a run with the very same inputs is copied, never one that differs in anything the
ranks read. No rank starts here: the keys come from launch.prepare, the stored run is a folder written by hand."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT
from labs import launch, runcache


def _key(tmp_path, env=None, **changes):
    options = {"preset": "tiny", "config": "zero3.json", "steps": 2, "out": tmp_path / "run", **changes}
    spec, resolved = launch.prepare(**options)
    return runcache.key(spec, resolved, env or {})


@pytest.fixture
def cache(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    folder.mkdir()
    monkeypatch.setenv(runcache.ENV, str(folder))
    return folder


def test_no_cache_without_the_variable(tmp_path, monkeypatch):
    monkeypatch.delenv(runcache.ENV, raising=False)
    assert _key(tmp_path) is None


def test_the_key_covers_what_the_ranks_read_and_nothing_else(tmp_path, cache):
    same = _key(tmp_path)
    assert same == _key(tmp_path / "elsewhere", config=ROOT / "ds_configs" / "zero3.json")   # --out, config's path
    assert same == _key(tmp_path, env={"HOME": "/somewhere"})
    different = [_key(tmp_path, steps=3), _key(tmp_path, config="zero2.json"), _key(tmp_path, seed=1),
                 _key(tmp_path, instruments=("comm",)), _key(tmp_path, precision="fp32"),
                 _key(tmp_path, env={"OMP_NUM_THREADS": "1"}), _key(tmp_path, env={"LABS_TEST_KILL": "1:step:2"}),
                 _key(tmp_path, env={"ACCELERATE_USE_FSDP": "true"})]
    assert same not in different and len(set(different)) == len(different)
    assert _key(tmp_path, save_every=1) is None                  # checkpoints, other files and resumes: never
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("some text " * 2000)
    assert _key(tmp_path, data_path=corpus) is None


def test_a_stored_run_comes_back_with_this_runs_spec(tmp_path, cache):
    spec, resolved = launch.prepare(preset="tiny", config="zero3.json", steps=2, out=tmp_path / "first")
    key = runcache.key(spec, resolved, {})
    first = tmp_path / "first"
    first.mkdir()
    (first / "run.json").write_text(json.dumps(spec))
    (first / "summary.json").write_text('{"final_loss": 1.5}')
    (first / "metrics.jsonl").write_text('{"step": 1, "loss": 1.5}\n')
    work = tmp_path / "work"
    work.mkdir()
    assert not runcache.restore(key, work, spec)                 # nothing stored yet
    runcache.store(key, first)
    again = dict(spec, out=str(tmp_path / "second"))
    assert runcache.restore(key, work, again)
    assert json.loads((work / "run.json").read_text()) == again
    assert (work / "summary.json").read_text() == '{"final_loss": 1.5}' and (work / "metrics.jsonl").is_file()
    assert json.loads((work / runcache.NOTE).read_text())["from"] == str(tmp_path / "first")
    assert not (work / runcache.STORED_FROM).exists()             # the cache's own bookkeeping stays in the cache
    assert not runcache.restore(None, tmp_path / "elsewhere", spec)


def test_launch_run_trains_once_then_copies_through_one_path(tmp_path, cache, monkeypatch, capsys):
    """labs.launch.run with a cache: the first call trains (here a writer stands in for the ranks), publishes, stores
    and notes; the same run again publishes the stored copy, streams its launch log and notes the reuse."""
    trained = []

    def ranks(spec, resolved, env, repairs, work, out, stream, nodes, cpu_offload):
        trained.append(str(out))
        (work / "run.json").write_text(json.dumps(spec))
        (work / "launch.log").write_text("step 1 loss 11.9\n")
        (work / "metrics.jsonl").write_text('{"step": 1, "loss": 11.9}\n')

    monkeypatch.setattr(launch, "_train", ranks)
    options = dict(preset="tiny", config="zero3.json", steps=2)
    first = launch.run(out=tmp_path / "first", stream=False, **options)
    second = launch.run(out=tmp_path / "second", stream=True, **options)
    assert trained == [str(tmp_path / "first")]
    assert [m["loss"] for m in first.metrics] == [m["loss"] for m in second.metrics] == [11.9]
    assert json.loads((second.path / "run.json").read_text())["out"] == str(tmp_path / "second")
    assert json.loads((second.path / runcache.NOTE).read_text())["from"] == str(tmp_path / "first")
    assert "step 1 loss 11.9" in capsys.readouterr().out
    rows = [json.loads(line) for line in (cache / runcache.LEDGER).read_text().splitlines()]
    assert [(r["reused"], Path(r["out"]).name) for r in rows] == [(False, "first"), (True, "second")]
    assert not list(tmp_path.glob(".*partial*"))                  # both working folders were published


def test_a_stored_route_comes_back_with_this_calls_route_json(tmp_path, cache):
    """Chapter 8's route folders have route.json and rank<r>.json, no run.json or summary.json."""
    from labs.course import routes

    spec = routes.prepare("trainer", out=tmp_path / "first", steps=8, checkpoint_step=6)
    key = runcache.key(spec, {"config": {"train_batch_size": 8}, "accelerate": None}, {})
    first = tmp_path / "first"
    (first / "trainer" / "checkpoint-6").mkdir(parents=True)
    (first / "route.json").write_text(json.dumps(dict(spec, ds_config="FIRST/ds_config.json")))
    (first / "rank0.json").write_text('{"losses": [11.9]}')
    runcache.store(key, first)
    work = tmp_path / "work"
    work.mkdir()
    assert runcache.restore(key, work, dict(spec, ds_config="WORK/ds_config.json"), spec_file="route.json")
    assert json.loads((work / "route.json").read_text())["ds_config"] == "WORK/ds_config.json"
    assert (work / "rank0.json").is_file() and (work / "trainer" / "checkpoint-6").is_dir()
    assert not (work / "run.json").exists() and not (work / runcache.STORED_FROM).exists()


def test_the_ledger_counts_every_launch_and_the_report_sums_it(tmp_path, cache):
    import importlib.util

    spec, resolved = launch.prepare(preset="tiny", config="zero3.json", steps=2, out=tmp_path / "a")
    key = runcache.key(spec, resolved, {})
    runcache.note(key, spec, False, 12.5)
    runcache.note(key, dict(spec, out=str(tmp_path / "b")), True, 0.1)
    runcache.note(None, dict(spec, steps=3, save_every=1), False, 20.0)
    rows = [json.loads(line) for line in (cache / runcache.LEDGER).read_text().splitlines()]
    assert [(r["reused"], r["seconds"], r["steps"]) for r in rows] == [(False, 12.5, 2), (True, 0.1, 2), (False, 20.0, 3)]
    loader = importlib.util.spec_from_file_location("launch_report", ROOT / "tools" / "launch_report.py")
    report = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(report)
    assert report.LEDGER == runcache.LEDGER
    text = report.report(cache)
    assert text.startswith("launch report: 3 labs runs, 1 reused from the run cache, 2 trained in 32 s (1 of them")
    assert "zero3.json x2: 2 runs, 32 s; (steps, instruments): [(2, 'state_bytes'), (3, 'state_bytes')]" in text
    assert "no ledger" in report.report(tmp_path)


def test_a_held_key_makes_another_process_wait(tmp_path, cache):
    """make test runs the tests and the notebooks side by side: while one process trains a run, another launch of
    the same run must wait for it (then copy it), not train it too. The lock is per key and per process."""
    probe = ("import fcntl, sys; f = open(sys.argv[1], 'w')\n"
             "try:\n    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB); print('free')\n"
             "except BlockingIOError:\n    print('held')")
    lock = cache / ".abc.lock"

    def other_process_sees():
        return subprocess.run([sys.executable, "-c", probe, str(lock)], capture_output=True, text=True).stdout.strip()

    with runcache.held("abc"):
        assert other_process_sees() == "held"
        with runcache.held(None):              # a run that is not reusable takes no lock
            pass
    assert other_process_sees() == "free"
