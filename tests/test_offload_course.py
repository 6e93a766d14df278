"""Chapter 3's readers (labs.course.offload) and exercise 03.3's setting: the offload scenarios count PyTorch's
pinning from the chapter's config files, the recorded runs r and q are read as their files say, the NVMe refusal
names no GPU-side buffer, and 03.3's answer does not hinge on labs.memory's heuristic reserve."""
from labs import CONFIGS, config, memory, resolve
from labs.course import offload
from labs.course.exercises import ch03

GiB = 2**30
OPTIONS = dict(micro_batch=1, seq_len=2048, activation_checkpointing="full")


def test_scenarios_count_pytorch_pinning():
    rows = {r["offload"]: r for r in offload.scenario_rows("qwen-7b", 4, "RTX3090", **OPTIONS)}
    assert [rows[k]["config"] for k in resolve.OFFLOAD_LEVELS] == list(offload.SCENARIO_CONFIGS.values())
    assert rows["none"]["host_bytes"] == 0 and not rows["none"]["fits"]
    for level in ("optimizer", "optimizer+params"):
        exact = memory.estimate("qwen-7b", gpus_per_node=4, host_pinning="exact", **OPTIONS,
                                ds_config=config.load(CONFIGS / offload.SCENARIO_CONFIGS[level])).host_per_node_bytes
        assert rows[level]["host_bytes"] > exact * 1.02, level       # pin_memory true: rounded up on a GPU host
    unpinned = memory.estimate("qwen-7b", gpus_per_node=4, offload_optimizer="cpu", **OPTIONS).host_per_node_bytes
    assert rows["optimizer"]["host_bytes"] > unpinned * 1.02           # what the chapter printed before


def test_recorded_runs_r_and_q():
    threads = offload.recorded_thread_rows()
    assert [r["threads"] for r in threads] == [16, 8, 4]
    assert {(r["gpu"], r["cpu_cores"], r["preset"]) for r in threads} == {("NVIDIA H200", 16, "qwen2.5-3b")}
    steps = [r["optimizer_step_s"] for r in threads]
    assert steps == sorted(steps) and 1.0 < steps[0] < steps[-1] < 5.0
    q = offload.recorded_nvme()
    assert "nvme" in q["nvme"]["case"] and "nvme" not in q["cpu"]["case"]
    assert q["nvme"]["optimizer_step_s"] > 10 * q["cpu"]["optimizer_step_s"]
    assert q["disk"]["read"] > 0 and q["swap_gib"] > 0


def test_nvme_refusal_names_no_gpu_side_buffer(monkeypatch):
    monkeypatch.setattr(offload, "_has_gpu", lambda: False)
    ready, reason = offload.nvme_ready()
    assert not ready and "GPU-side" not in reason and "libaio" in reason


def test_exercise_03_3_is_clear_of_the_reserve():
    setting = dict(ch03.SINGLE_4090)
    preset, gpus, gpu = setting.pop("preset"), setting.pop("gpus"), setting.pop("gpu")
    usable = memory.usable_bytes(memory.GPUS[gpu])
    for optimizer, param in resolve.OFFLOAD_LEVELS.values():
        peak = memory.estimate(preset, stage=3, gpus_per_node=gpus, offload_optimizer=optimizer, offload_param=param,
                               **setting).total_per_gpu_bytes
        assert abs(peak - usable) > 0.2 * usable, (optimizer, param, peak / GiB, usable / GiB)
