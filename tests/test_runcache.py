"""labs.runcache: under `make test` a run with the very same inputs is copied, never one that differs in anything the
ranks read. No rank starts here: the keys come from launch.prepare, the stored run is a folder written by hand."""
import json

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
                 _key(tmp_path, env={"OMP_NUM_THREADS": "1"}), _key(tmp_path, env={"LABS_TEST_KILL": "1:step:2"})]
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
    assert not runcache.restore(None, tmp_path / "elsewhere", spec)
