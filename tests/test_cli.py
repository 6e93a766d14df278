"""Bad input: one clear line naming the key or path, exit code 2, no run folder left behind."""
import json


from conftest import ROOT, run_labs


def _bad(tmp_path, *args):
    out = tmp_path / "run"
    result = run_labs("train", "--out", out, "--steps", 2, *args)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("labs: error: "), result.stderr
    assert not out.exists() and not list(tmp_path.glob(".run*")), "a run folder was left behind"
    return lines[0]


def test_unknown_preset(tmp_path):
    assert "unknown preset 'giant'" in _bad(tmp_path, "--preset", "giant")


def test_missing_config(tmp_path):
    assert f"config '{tmp_path / 'nope.json'}' does not exist" in _bad(tmp_path, "--config", tmp_path / "nope.json")


def test_invalid_json(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"zero_optimization": {"stage": 3},}')
    assert "is not valid JSON: line 1" in _bad(tmp_path, "--config", bad)


def test_batch_size_disagreement(tmp_path):
    cfg = json.loads((ROOT / "ds_configs/zero3.json").read_text())
    cfg.update(train_batch_size=7, train_micro_batch_size_per_gpu=2)
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(cfg))
    assert "'train_batch_size' is 7 but micro-batch 2" in _bad(tmp_path, "--config", path)


def test_missing_model_path(tmp_path):
    assert f"--model-path '{tmp_path / 'weights'}' does not exist" in _bad(tmp_path, "--model-path",
                                                                            tmp_path / "weights")


def test_done_line_says_how_many_steps_it_averaged():
    from labs.cli import done_line

    summary = dict(first_loss=12.0, final_loss=11.5, tokens_per_s_per_gpu=1000, timing="median")
    assert "-> 11.500 (mean of last 3)," in done_line(dict(summary, steps=3), "runs/x")
    assert "(mean of last 5)" in done_line(dict(summary, steps=30), "runs/x")
    assert "(one step)" in done_line(dict(summary, steps=1), "runs/x")


def test_unknown_flag(tmp_path):
    assert "unrecognized arguments: --stpes" in _bad(tmp_path, "--stpes", "3")


def test_env_report_names_the_installed_versions():
    import importlib.metadata as md

    result = run_labs("env")
    assert result.returncode == 0 and f"deepspeed {md.version('deepspeed')}" in result.stdout
    assert f"transformers {md.version('transformers')}" in result.stdout


def test_ops_to_build_looks_where_torch_builds_them(tmp_path, monkeypatch):
    """The ranks get TORCH_EXTENSIONS_DIR, and torch then builds an op in <dir>/<op>/ (no py3XX_cpu subfolder):
    an op found there is not announced as a build again."""
    from labs import env

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert env.ops_to_build(on_gpu=False, cpu_offload=True, fused_adam=False) == ["cpu_adam"]
    (tmp_path / "cpu_adam").mkdir()
    (tmp_path / "cpu_adam" / "cpu_adam.so").write_bytes(b"")
    assert env.ops_to_build(on_gpu=False, cpu_offload=True, fused_adam=False) == []
