"""The foundation's end-to-end run: labs train, tiny preset, ZeRO-3, 2 CPU ranks, 30 steps."""
import json

from labs.multinode import TORCHRUN_LOGS


def test_loss_falls_and_summary_is_complete(zero3_run):
    out, result = zero3_run
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 31))
    first, last5 = records[0]["loss"], sum(r["loss"] for r in records[-5:]) / 5
    assert last5 <= first - 1.0, (first, last5)
    summary = json.loads((out / "summary.json").read_text())
    for key in ("preset", "params", "zero_stage", "world_size", "steps", "first_loss", "final_loss",
                "tokens_per_s", "tokens_per_s_per_gpu", "tflops_per_gpu", "peak_memory_bytes", "versions",
                "flops_per_token", "median_step_time_s"):
        assert summary[key] is not None, key
    assert summary["zero_stage"] == 3 and summary["world_size"] == 2 and summary["steps"] == 30
    assert len(summary["peak_memory_bytes"]) == 2 and all(b > 100e6 for b in summary["peak_memory_bytes"])
    assert all(len(r["peak_memory_bytes"]) == 2 for r in records)
    assert records[0]["lr"] < records[3]["lr"]            # warm-up
    assert records[-1]["lr"] < max(r["lr"] for r in records)  # decay
    for name in ("run.json", "ds_config.json", "command.txt", "environment.json", "launch.log"):
        assert (out / name).is_file(), name
    assert not list(out.parent.glob(".zero3*")), "the working folder was not published"
    assert "--log-dir=" in (out / "command.txt").read_text() and not (out / TORCHRUN_LOGS).exists()   # removed
    recorded = json.loads((out / "environment.json").read_text())      # what moves speed and memory between runs
    assert {"OMP_NUM_THREADS", "DS_PIN_MEMORY_BACKEND", "PYTORCH_CUDA_ALLOC_CONF", "offload_copy"} <= set(recorded)
    assert "done: 30 steps" in result.stdout


def test_model_path_loads_local_weights_under_zero3(tmp_path):
    """--model-path: a saved model trains from its weights (first loss is that model's loss, not a fresh one's)."""
    import torch
    from transformers import AutoModelForCausalLM

    from conftest import ROOT, run_labs
    from labs import models

    torch.manual_seed(123)
    model = AutoModelForCausalLM.from_config(models.qwen2_config("tiny"))
    with torch.no_grad():
        model.model.norm.weight.mul_(0)       # a model whose logits are all zero: loss exactly ln(vocab) at first
    model.save_pretrained(tmp_path / "weights")
    result = run_labs("train", "--config", ROOT / "ds_configs/zero3.json", "--steps", 2, "--lr", 1e-9,
                      "--out", tmp_path / "run", "--model-path", tmp_path / "weights", "--quiet")
    assert result.returncode == 0, result.stderr[-3000:]
    first = json.loads((tmp_path / "run/metrics.jsonl").read_text().splitlines()[0])
    assert abs(first["loss"] - models.expected_initial_loss(151936)) < 1e-3


def test_rank_failure_raises_with_the_rank_traceback(tmp_path):
    from conftest import ROOT, run_labs

    cfg = json.loads((ROOT / "ds_configs/zero3.json").read_text())
    cfg["optimizer"]["params"]["momentum_decay"] = 0.5   # passes labs' checks, torch's AdamW refuses it on each rank
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    result = run_labs("train", "--config", tmp_path / "cfg.json", "--steps", 2, "--out", tmp_path / "run", "--quiet")
    assert result.returncode == 1
    first = result.stderr.splitlines()[0]
    assert first.startswith(("labs: rank 0 failed: ", "labs: rank 1 failed: ")) and "momentum_decay" in first
    assert "Traceback" in result.stderr
    assert not (tmp_path / "run").exists() and not list(tmp_path.glob(".run*"))


def test_start_up_objects_are_frozen_and_the_collector_runs_again():
    """labs.rank turns the garbage collector off for start-up (imports, engine); labs.train.main then freezes what
    start-up made and turns it back on: a rank that trained for hours with the collector off would leak every cycle."""
    import gc

    from labs import train

    gc.disable()
    try:
        frozen = gc.get_freeze_count()
        train.settle_startup_objects()
        assert gc.isenabled() and gc.get_freeze_count() > frozen
    finally:
        gc.enable()     # no unfreeze: it would also undo conftest's freeze for every later test
