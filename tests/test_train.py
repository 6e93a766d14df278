"""The foundation's end-to-end run: labs train, tiny preset, ZeRO-3, 2 CPU ranks, 30 steps."""
import json


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
    assert "done: 30 steps" in result.stdout
